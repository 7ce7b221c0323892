"""Held-out accuracy of a checkpoint on the GRPO example's prompts: greedy completions through train/generate.py (the
generation GRPO trains with, on the model built as training builds it), scored against the `answer` field
(mcorekit.train.rewards.exact_match: the stripped completion is the answer). With --hf, the same prompts also go
through HF transformers' generate on the converted model (`mcorekit convert mcore-to-hf`), greedy too, in this process: tokens/s side by side, and how
often the two give the same completion.

    python examples/grpo/evaluate.py --config examples/grpo/grpo.yaml --checkpoint runs/grpo-example/sft/checkpoints
    python examples/grpo/evaluate.py --config examples/grpo/grpo.yaml --checkpoint runs/grpo-example/grpo/checkpoints \
        [--prompts examples/grpo/data/heldout.jsonl] [--hf HF_DIR] [--backend auto|static|dynamic|plain] [key=value ...]

One process is enough (a torchrun start works too: every rank generates the same prompts). Prints the accuracy
and one line `ACCURACY {json}` for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any


def single_rank_env() -> None:
    """A one-process rendezvous on a free port, unless a launcher (torchrun, srun) set one."""
    if "RANK" in os.environ or "SLURM_PROCID" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def hf_generate(hf_dir: str, tok: Any, prompts: list[str], max_new: int, batch: int) -> dict[str, Any]:
    """Greedy completions from transformers' generate (left-padded batches), timed after one warm-up batch."""
    import torch
    import transformers

    from mcorekit.train.data.tokenizer import bos_ids

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, trust_remote_code=False)
    model = model.cuda().eval()
    tok.padding_side = "left"
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    bos = tok.decode(bos_ids(tok))  # as training's plain prompts start, in front of the left padding's end

    def run(texts: list[str]) -> list[list[int]]:
        enc = tok([bos + t for t in texts], return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=pad)
        rows = []
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            rows.append(row[: row.index(eos) + 1] if eos in row else row)
        return rows

    run(prompts[:batch])  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    completions = [c for i in range(0, len(prompts), batch) for c in run(prompts[i:i + batch])]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"completions": completions, "seconds": seconds, "tokens": sum(len(c) for c in completions)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the experiment whose model (and tokenizer) the checkpoint holds")
    p.add_argument("--checkpoint", required=True, help="checkpoint root (latest iteration) or an iteration directory")
    p.add_argument("--prompts", default="examples/grpo/data/heldout.jsonl")
    p.add_argument("--limit", type=int, default=0, help="the first N prompts only (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="default: the experiment's grpo.max_new_tokens")
    p.add_argument("--backend", default="auto", help="train/generate.py backend: auto, dynamic, static or plain; "
                   "several, comma-separated, are each timed (the first one's completions are scored)")
    p.add_argument("--batch", type=int, default=512, help="prompts per generate call")
    p.add_argument("--hf", default=None, help="the converted HF model: also time transformers' generate on it")
    p.add_argument("overrides", nargs="*", help="key=value experiment overrides")
    a = p.parse_args(argv)

    from mcorekit import quiet
    from mcorekit.config.experiment import load_experiment
    from mcorekit.errors import MCoreKitError

    quiet.install()
    single_rank_env()
    try:
        return evaluate(a, load_experiment(a.config, a.overrides))
    except MCoreKitError as e:
        print(f"mcorekit: error: {e}", file=sys.stderr)
        return 2


def evaluating(exp: Any, start: Path) -> Any:
    """exp with the checkpoint evaluated as its start's source (weights only), not its own checkpoint.load: that
    names the run the config starts from, which need not exist where a checkpoint is evaluated (a start refuses a
    checkpoint.load that is gone)."""
    source = exp.checkpoint.model_copy(update={"load": str(start), "finetune": True})
    return exp.model_copy(update={"checkpoint": source})


def evaluate(a: argparse.Namespace, exp: Any) -> int:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint
    from mcorekit.train.build import build
    from mcorekit.train.data.jsonl import records
    from mcorekit.train.data.tokenizer import bos_ids
    from mcorekit.train.generate import Sampling, generate
    from mcorekit.train.rewards import exact_match

    rows = [r for _, r in records(Path(a.prompts))]
    rows = rows[: a.limit] if a.limit else rows
    if not rows or not all(isinstance(r.get("prompt"), str) and "answer" in r for r in rows):
        raise ConfigError(f"{a.prompts}: expected lines of {{\"prompt\": str, \"answer\": ...}}")
    root = Path(a.checkpoint)
    start = checkpoint.latest(root) or root
    if not start.is_dir():
        raise ConfigError(f"checkpoint not found: {root}")
    tok = AutoTokenizer.from_pretrained(exp.data.tokenizer, trust_remote_code=False)
    max_new = a.max_new_tokens or exp.grpo.max_new_tokens
    if exp.peft.lora is not None:  # a LoRA checkpoint holds the adapters only: its base is another checkpoint
        raise ConfigError("evaluate.py evaluates full checkpoints: merge a LoRA run's adapters into its base first "
                          "(mcorekit convert mcore-to-hf --merge), or evaluate the HF model with --hf")
    t = build(evaluating(exp, start))  # pins and checks the checkpoint as any start's source
    checkpoint.load_weights(Path(t.exp.checkpoint.load), t.model)
    bos = bos_ids(tok)  # as training's plain prompts start (train/tasks/grpo.py)
    ids = [bos + tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    greedy = Sampling(max_new_tokens=max_new, greedy=True)
    eos = tok.eos_token_id

    def text(c: list[int]) -> str:
        return tok.decode([x for x in c if x != eos], skip_special_tokens=True)

    runs = {}
    for backend in a.backend.split(","):
        generate(t.model, ids[: a.batch], greedy, eos, len(tok), backend)  # warm-up (kernels, allocator)
        completions, seconds, name = [], 0.0, backend
        for i in range(0, len(ids), a.batch):
            out = generate(t.model, ids[i:i + a.batch], greedy, eos, len(tok), backend)
            completions += out.completions
            seconds += out.seconds
            name = out.backend
        runs[name] = (completions, seconds)
    backend, (completions, seconds) = next(iter(runs.items()))
    correct = [exact_match(r["prompt"], text(c), r["answer"]) for r, c in zip(rows, completions)]
    tokens = sum(len(c) for c in completions)
    result: dict[str, Any] = {"checkpoint": str(start), "prompts": len(rows), "correct": int(sum(correct)),
                              "accuracy": sum(correct) / len(rows), "backend": backend, "gen_seconds": seconds,
                              "gen_tokens": tokens, "gen_tokens_per_s": tokens / max(seconds, 1e-9),
                              "examples": [[r["prompt"], text(c)] for r, c in zip(rows[:5], completions[:5])],
                              "backends": {name: {"tokens_per_s": sum(len(c) for c in cs) / max(sec, 1e-9),
                                                  "seconds": sec, "same_as_first": sum(x == y for x, y in
                                                                                       zip(cs, completions)) / len(rows)}
                                           for name, (cs, sec) in runs.items()}}
    if a.hf:
        hf = hf_generate(a.hf, tok, [r["prompt"] for r in rows], max_new, a.batch)
        hf_correct = [exact_match(r["prompt"], text(c), r["answer"]) for r, c in zip(rows, hf["completions"])]
        result.update(hf_accuracy=sum(hf_correct) / len(rows), hf_seconds=hf["seconds"], hf_tokens=hf["tokens"],
                      hf_tokens_per_s=hf["tokens"] / max(hf["seconds"], 1e-9),
                      same_completion=sum(text(x) == text(y) for x, y in zip(completions, hf["completions"])) / len(rows))
    if dist.get_rank() == 0:
        print(f"held-out accuracy {result['correct']}/{len(rows)} = {result['accuracy']:.3f} ({backend} backend, "
              f"{result['gen_tokens_per_s']:.0f} generated tokens/s)"
              + (f"; transformers: {result['hf_accuracy']:.3f}, {result['hf_tokens_per_s']:.0f} tokens/s" if a.hf else ""))
        print("ACCURACY " + json.dumps(result), flush=True)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
