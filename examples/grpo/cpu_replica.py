"""The GRPO example on CPU (one gloo process, fp32, Megatron-Core's local layer spec): the same data generator, the
same experiments (examples/grpo/sft.yaml then grpo.yaml: model, data, optimizer, schedule, grpo settings), the same
code path (the tasks' dataset / batches / prepare_step / forward_step, Megatron's no-pipelining schedule as it runs,
OptimizerParamScheduler, train/generate.py's static engine), and the held-out greedy accuracy before and after GRPO,
as examples/grpo/evaluate.py measures it. What differs from the GPU run: fp32 instead of bf16, torch's AdamW (the
same betas, eps, weight decay, gradient clipping) instead of Megatron's distributed optimizer, no DDP wrapper.
A check of the example's settings before spending GPU time on them (~8 minutes a run on two shared cores with
--threads 1; more threads than free cores only slow it down):

    python examples/grpo/cpu_replica.py --work /tmp/grpo-cpu [--seed 1] [--sft-iters N] [--grpo-iters N] [k=v ...]

Overrides `sft.KEY=VALUE` / `grpo.KEY=VALUE` go to the one experiment. Prints one line per logged step and
`REPLICA {json}` at the end (accuracies, their standard error, seconds per step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def cpu_megatron() -> None:
    """What Megatron-Core's GPTModel and the static engine need to run on CPU (as tests/grpo_cpu_driver.py does)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self

    class Event:
        def __init__(self, *a: object, **k: object) -> None: ...
        def record(self, *a: object) -> None: ...
        def synchronize(self) -> None: ...
        def elapsed_time(self, other: object) -> float:
            return 0.0

    torch.cuda.Event = Event
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)


class Run:
    """One experiment's model, optimizer and scheduler, trained through its task as train/loop.train_step does."""

    def __init__(self, exp: Any, run_dir: Path, model: Any = None) -> None:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from mcorekit.config import megatron as margs
        from mcorekit.config.rules import model_of
        from mcorekit.models.megatron import build_gpt, padded_vocab_size
        from mcorekit.train.tasks import task_for

        self.exp, self.spec = exp, model_of(exp)
        config = margs.transformer_config(exp, self.spec, use_te=False, fusions=False)
        config.params_dtype, config.bf16, config.use_cpu_initialization = torch.float32, False, True
        config.gradient_accumulation_fusion = False
        self.padded = padded_vocab_size(self.spec.vocab_size, 128)
        self.model = model if model is not None else build_gpt(self.spec, config, self.padded, use_te=False)
        self.model.config.no_sync_func = None
        self.model.config.finalize_model_grads_func = None
        self.model.config.grad_scale_func = None
        o = exp.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                           eps=o.adam_eps, weight_decay=o.weight_decay)
        self.scheduler = OptimizerParamScheduler(self.optimizer, **margs.scheduler_kwargs(exp))
        self.task = task_for(exp, self.spec, run_dir)
        self.dataset = self.task.dataset()
        if self.task.name == "grpo":
            self.data = [self.task.batches(self.dataset, 0, 0, 1)]
        else:  # the loop's batches on the CPU
            from mcorekit.train.data import batches

            self.data = [batches(self.dataset, exp.schedule.micro_batch_size, 0, 0, 1, device="cpu")]
        # what prepare_step reads of the Trainer
        self.t = type("T", (), {"model": [self.model], "dp_rank": 0, "dp_size": 1, "exp": exp, "spec": self.spec,
                                "padded_vocab": self.padded})()

    def step(self) -> dict[str, float]:
        from mcorekit.train.loop import _mean_metrics

        s = self.exp.schedule
        n = s.global_batch_size // s.micro_batch_size
        step_data = self.task.prepare_step(self.t, self.data, n)
        self.optimizer.zero_grad(set_to_none=True)
        out = no_pipelining(self.task.forward_step, step_data[0], self.model, n, forward_only=False)
        o = self.exp.optimizer
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.clip_grad if o.clip_grad else 1e30)
        self.optimizer.step()
        self.scheduler.step(increment=s.global_batch_size)
        return {**_mean_metrics(out, self.task.metrics), "grad_norm": float(norm),
                "lr": self.optimizer.param_groups[0]["lr"]}


def accuracy(model: Any, tok: Any, rows: list[dict], max_new: int) -> dict[str, Any]:
    """Greedy held-out accuracy through train/generate.py's static engine, scored as evaluate.py scores it."""
    from mcorekit.train.generate import Sampling, generate
    from mcorekit.train.rewards import exact_match

    ids = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    out = generate([model], ids, Sampling(max_new_tokens=max_new, greedy=True), tok.eos_token_id, len(tok), "static")
    text = [tok.decode([x for x in c if x != tok.eos_token_id], skip_special_tokens=True) for c in out.completions]
    correct = sum(exact_match(r["prompt"], t, r["answer"]) for r, t in zip(rows, text))
    return {"accuracy": correct / len(rows), "correct": int(correct), "seconds": out.seconds,
            "examples": [[r["prompt"], t] for r, t in zip(rows[:4], text[:4])]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/grpo-cpu-replica")
    p.add_argument("--seed", type=int, default=0, help="data seed (make_data.py --seed) and model init seed")
    p.add_argument("--heldout", type=int, default=256)
    p.add_argument("--sft-iters", type=int, default=0, help="default: sft.yaml's")
    p.add_argument("--grpo-iters", type=int, default=0, help="default: grpo.yaml's")
    p.add_argument("--data-args", default="", help="extra make_data.py arguments, e.g. '--sloppy 0.8'")
    p.add_argument("--reuse-sft", action="store_true", help="load WORK/sft.pt if it exists")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--sft-eval", type=int, default=0, help="held-out accuracy every N SFT steps too")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    data = work / "data"
    subprocess.run([sys.executable, str(HERE / "make_data.py"), "--out", str(data), "--heldout", str(a.heldout),
                    "--seed", str(a.seed), *a.data_args.split()], check=True)
    cpu_megatron()
    from transformers import AutoTokenizer

    from mcorekit.config.experiment import load_experiment
    from mcorekit.train.data.jsonl import records

    model_over = [f"model.hf_config={data}/model", f"data.tokenizer={data}/model", "precision.dtype=fp32"]
    sft_over = [o[4:] for o in a.overrides if o.startswith("sft.")]
    grpo_over = [o[5:] for o in a.overrides if o.startswith("grpo.")]
    if a.sft_iters:
        sft_over.append(f"schedule.train_iters={a.sft_iters}")
    if a.grpo_iters:
        grpo_over.append(f"schedule.train_iters={a.grpo_iters}")
    rewards = json.dumps([{"function": "mcorekit.train.rewards:exact_match", "weight": 1.0},
                          {"function": f"{HERE}/rewards.py:digits_correct", "weight": 0.5}])
    sft_exp = load_experiment(HERE / "sft.yaml", [*model_over, f"data.paths=[{data}/sft.jsonl]", *sft_over])
    grpo_exp = load_experiment(HERE / "grpo.yaml", [*model_over, f"data.paths=[{data}/train.jsonl]",
                                                    f"grpo.rewards={rewards}", *grpo_over])
    tok = AutoTokenizer.from_pretrained(data / "model", trust_remote_code=False)
    held = [r for _, r in records(data / "heldout.jsonl")][: a.heldout]
    max_new = grpo_exp.grpo.max_new_tokens
    result: dict[str, Any] = {"seed": a.seed, "sft_iters": sft_exp.schedule.train_iters,
                              "grpo_iters": grpo_exp.schedule.train_iters, "overrides": a.overrides,
                              "data_args": a.data_args}

    torch.manual_seed(a.seed)
    sft = Run(sft_exp, work / "sft")
    saved = work / "sft.pt"
    if a.reuse_sft and saved.is_file():
        sft.model.load_state_dict(torch.load(saved))
        print(f"SFT weights from {saved}", flush=True)
    else:
        started = time.perf_counter()
        for step in range(1, sft_exp.schedule.train_iters + 1):
            m = sft.step()
            if step % (a.log_interval * 10) == 0 or step == 1:
                acc = accuracy(sft.model, tok, held, max_new)["accuracy"] if a.sft_eval and step % a.sft_eval == 0 \
                    else float("nan")
                print(f"sft {step}: loss {m['loss']:.4f} lr {m['lr']:.2e} held-out {acc:.3f} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
        result["sft_seconds_per_step"] = (time.perf_counter() - started) / sft_exp.schedule.train_iters
        torch.save(sft.model.state_dict(), saved)
    before = accuracy(sft.model, tok, held, max_new)
    print(f"held-out accuracy after SFT {before['accuracy']:.3f} {before['examples']}", flush=True)

    policy = sft.model
    grpo = Run(grpo_exp, work / "grpo", model=policy)
    if grpo_exp.grpo.kl_coeff > 0:  # the reference: a frozen copy of the starting weights (dpo.Reference's role)
        frozen = Run(grpo_exp, work / "reference").model  # built as the policy is, then its weights
        frozen.load_state_dict(policy.state_dict())
        grpo.task.reference = FrozenReference(frozen, grpo.task)
    history = []
    started = time.perf_counter()
    for step in range(1, grpo_exp.schedule.train_iters + 1):
        m = grpo.step()
        history.append(m)
        if step % a.log_interval == 0 or step == 1:
            acc = accuracy(policy, tok, held, max_new)["accuracy"] if step % (a.log_interval * 5) == 0 else float("nan")
            print(f"grpo {step}: reward {m['reward_mean']:.3f} (std {m['reward_std']:.3f}, all-equal groups "
                  f"{m['groups_all_equal']:.2f}) kl {m['kl']:.4f} len {m['response_length']:.2f} loss {m['loss']:.4f} "
                  f"grad {m['grad_norm']:.3f} held-out {acc:.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    result["grpo_seconds_per_step"] = (time.perf_counter() - started) / grpo_exp.schedule.train_iters
    after = accuracy(policy, tok, held, max_new)
    se = math.sqrt(max(before["accuracy"] * (1 - before["accuracy"]), 0.05) / len(held))
    first, last = history[:5], history[-5:]
    result.update(before=before["accuracy"], after=after["accuracy"], se=se,
                  gain_in_se=(after["accuracy"] - before["accuracy"]) / se,
                  reward_first5=sum(x["reward_mean"] for x in first) / len(first),
                  reward_last5=sum(x["reward_mean"] for x in last) / len(last), examples_after=after["examples"])
    print(f"held-out accuracy: SFT {before['accuracy']:.3f}, GRPO {after['accuracy']:.3f} (+{result['gain_in_se']:.1f} "
          f"standard errors)")
    print("REPLICA " + json.dumps(result), flush=True)
    return 0


class FrozenReference:
    """dpo.Reference's logps on a frozen copy, through the same schedule, forward only."""

    def __init__(self, model: Any, task: Any) -> None:
        self.model, self.task = model.eval(), task
        for q in self.model.parameters():
            q.requires_grad_(False)

    def logps(self, batches: list[dict[str, Any]]) -> list[torch.Tensor]:
        with torch.no_grad():
            out = no_pipelining(self.task.logps_step, iter(batches), self.model, len(batches), forward_only=True)
        return [o["logps"] for o in out]


def no_pipelining(forward_step: Any, data: Any, model: Any, n: int, forward_only: bool) -> list[dict[str, Any]]:
    """Megatron's forward_backward_no_pipelining (which allocates a CUDA counter) as it runs for one stage and a
    (loss, metrics) loss function: each micro-batch's loss divided by the number of micro-batches, backward."""
    out = []
    for _ in range(n):
        output, loss_func = forward_step(data, model)
        loss, metrics = loss_func(output)
        if not forward_only:
            (loss / n).backward()
        out.append(metrics)
    return out


if __name__ == "__main__":
    sys.exit(main())
