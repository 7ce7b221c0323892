"""Run as a script (one gloo process, CPU, local layer spec, fp32): train/generate.py on a tiny random Megatron
GPTModel. Prints `GEN {json}` with
  manual   greedy completions from a loop written here (the model's forward on the whole prefix, argmax over the
           tokenizer's vocabulary, stop at eos or max_new)
  plain    greedy completions from generate(backend="plain")
  static   greedy completions from generate(backend="static") (Megatron-Core's static-batch engine, KV cache)
  sampled  two sampled runs with one seed and one with another (plain backend)
With an argument (the example's data folder, from examples/grpo/make_data.py), also one GRPO step of
train/tasks/grpo.py on the example's model: its prompts, rollouts (plain backend), rewards, advantages and training
micro-batches, and the loss of each micro-batch through forward_step with its gradient (`task` in the json).
Used by test_grpo.py. Megatron-Core runs on CPU once RotaryEmbedding's device is pointed at the CPU (see
megatron_cpu_logits.py) the static engine's one `.cuda()` is a no-op and its per-step CUDA timing events time nothing."""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    import torch.distributed as dist

    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self  # the static engine moves one counter with .cuda()

    class Event:  # the static engine times each step with CUDA events; on CPU they time nothing
        def __init__(self, *a: object, **k: object) -> None: ...
        def record(self, *a: object) -> None: ...
        def synchronize(self) -> None: ...
        def elapsed_time(self, other: object) -> float:
            return 0.0

    torch.cuda.Event = Event
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("GRPO_PORT", "29591"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    from mcorekit.models.megatron import build_gpt, transformer_config
    from mcorekit.models.spec import ModelSpec
    from mcorekit.train.generate import Sampling, generate

    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(3)
    spec = ModelSpec("llama", 2, 64, 4, 2, 16, 128, 40)
    vocab, padded, eos = 37, 40, 27  # the tokenizer's 37 tokens inside a padded vocabulary of 40; 27 ends some paths
    model = build_gpt(spec, transformer_config(spec, cpu_init=True), padded, use_te=False)
    with torch.no_grad():  # a peaked, input-dependent distribution: greedy paths of varied lengths, some hitting eos
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 7, 5, 4, 9, 6)]
    max_new = 8

    def manual(prompt: list[int]) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(max_new):
                x = torch.tensor([ids])
                logits = model(x, torch.arange(len(ids)).unsqueeze(0), None)[0, -1, :vocab]
                ids.append(int(logits.argmax()))
                if ids[-1] == eos:
                    break
        return ids[len(prompt):]

    model.eval()
    expected = [manual(p) for p in prompts]
    model.train()
    greedy = Sampling(max_new_tokens=max_new, greedy=True)
    plain = generate([model], prompts, greedy, eos, vocab, backend="plain")
    static = generate([model], prompts, greedy, eos, vocab, backend="static")
    sampled = [generate([model], prompts, Sampling(max_new, temperature=1.0, top_p=0.9, seed=s), eos, vocab,
                        backend="plain").completions for s in (5, 5, 6)]
    # on-policy: the engine's samples (temperature 1) follow the training forward's distribution, the one GRPO's
    # log-probs are taken from: one prompt, 20000 samples of its next token, against softmax of the model's logits
    # (and, to show the comparison can tell, against the distribution at temperature 0.7)
    prompt, draws = prompts[1], 20000
    with torch.no_grad():
        model.eval()
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0), None)[0, -1].float()
        model.train()
    probs = torch.softmax(logits[:vocab], -1)
    one = generate([model], [prompt] * draws, Sampling(1, temperature=1.0, seed=11), eos, vocab, backend="static")
    counts = torch.bincount(torch.tensor([c[0] for c in one.completions]), minlength=vocab).double() / draws
    on_policy = {"tv_distance": 0.5 * float((counts[:vocab] - probs.double()).abs().sum()),
                 "tv_to_tempered": 0.5 * float((counts[:vocab] - torch.softmax(logits[:vocab] / 0.7, -1).double())
                                               .abs().sum()),
                 "max_p": float(probs.max()), "outside_vocab": float(counts[vocab:].sum())}
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope_cached = RotaryEmbedding.forward.cache_info().currsize  # after generate: its tables are not kept
    result = {"rope_cached_after_generate": rope_cached, "manual": expected, "plain": plain.completions, "static": static.completions,
              "plain_finished": plain.finished, "static_finished": static.finished,
              "sampled": sampled, "training_after": model.training, "vocab": vocab, "on_policy": on_policy}
    if len(sys.argv) > 1:
        result["task"] = grpo_step(sys.argv[1])
    print("GEN " + json.dumps(result))
    dist.destroy_process_group()


def grpo_step(data: str) -> dict:
    """One prepare_step + forward_step of the GRPO task on the example's model (random weights, CPU, fp32)."""
    import types
    from pathlib import Path

    from mcorekit.config.experiment import Experiment
    from mcorekit.models.megatron import build_gpt, transformer_config
    from mcorekit.models.spec import from_hf_config, load_hf_config
    from mcorekit.train.tasks.grpo import GroupRelativePolicyOptimization

    here = Path(__file__).resolve().parent.parent
    exp = Experiment.model_validate({
        "name": "cpu-grpo", "model": {"hf_config": f"{data}/model"},
        "data": {"kind": "grpo", "tokenizer": f"{data}/model", "paths": [f"{data}/train.jsonl"], "seq_length": 16},
        "grpo": {"group_size": 4, "prompts_per_step": 3, "max_new_tokens": 6, "generation": "plain",
                 "rewards": [{"function": "mcorekit.train.rewards:math_answer", "weight": 1.0},
                             {"function": f"{here}/examples/grpo/rewards.py:digits_only", "weight": 0.5}]},
        "schedule": {"global_batch_size": 12, "micro_batch_size": 4, "train_iters": 5, "warmup_iters": 0}})
    spec = from_hf_config(load_hf_config(f"{data}/model"))
    torch.manual_seed(0)
    model = build_gpt(spec, transformer_config(spec, cpu_init=True), 128, use_te=False)
    task = GroupRelativePolicyOptimization(exp, spec, Path(data))
    dataset = task.dataset()
    trainer = types.SimpleNamespace(model=[model], dp_rank=0, dp_size=1)
    step = next(task.batches(dataset, 2 * 12, 0, 1))  # the loop starts step 2's iterator at sample 2 x 12
    batches = list(task.prepare_step(trainer, [task.batches(dataset, 2 * 12, 0, 1)], 3)[0])
    rows, losses, grads = [], [], []
    for b in batches:
        for i in range(b["tokens"].shape[0]):
            mask = b["loss_mask"][i].bool()
            rows.append({"tokens": b["tokens"][i].tolist(), "labels": b["labels"][i].tolist(),
                         "completion": b["labels"][i][mask].tolist(), "advantage": float(b["advantages"][i])})
        model.zero_grad()
        out, loss_func = task.forward_step(iter([b]), model)
        loss, metrics = loss_func(out)
        loss.backward()
        losses.append({k: float(v) for k, v in metrics.items()})
        grads.append(sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None))
    return {"step": step["step"], "prompts": [dataset.prompts[i].text for i in step["prompts"]],
            "answers": [dataset.prompts[i].fields["answer"] for i in step["prompts"]], "rows": rows,
            "metrics": losses, "grads": grads, "token_total": batches[0]["token_total"], "metric_names": task.metrics}


if __name__ == "__main__":
    main()
    sys.exit(0)
