"""Training throughput on one GPU: mcorekit's Megatron-Core loop next to HF transformers training the same shape,
in one run (same GPU, same sequence length, micro-batch and global batch).

    python bench/train_bench.py [--shape dense|moe|all] [--steps 16] [--out DIR] [--runs hf-bf16,bf16,fp8-tensorwise]
                                [--gpus 1,2] [--multi parallel.ep=2 ...]

Shapes: `dense` is the 0.89B Llama shape (16 x 2048, GQA 16/8, SwiGLU 5632, vocab 32768) at seq 2048, micro-batch
8; `moe` the 8-expert top-2 shape (16 x 2048, expert FFN 1408) at seq 2048, micro-batch 4; `dense-3b` the speed
issue's dense shape (`llama-3b`: 24 x 3072, GQA 24/8, SwiGLU 8192) at seq 4096, micro-batch 2 (not in `all`). Global batch: 8
micro-batches (gradient accumulation in both). Each run is its own process:
  hf-bf16            transformers (SDPA attention, bf16 weights, fused torch AdamW), a plain loop
  bf16, fp8-*        `python -m mcorekit.train` (the real entry) on mock data; fp8-* names the TE recipe
  bf16-te-experts    bf16 with moe.expert_gemm=te (MoE shape: experts through TE's GroupedLinear, not the
                     default torch._grouped_mm)
With --gpus 1,2 every mcorekit run is made on 1 and on 2 GPUs (torchrun on this node; data parallel, plus the
--multi overrides, e.g. parallel.ep=2 for MoE), with 8 micro-batches per GPU per step (weak scaling); the table
gives tokens/s per GPU and the scaling efficiency against the same run on one GPU.
Tokens/s is the median over the logged intervals after the first (the first holds start-up and warm-up);
MFU uses Megatron's FLOP formula and the H200's dense bf16 peak (989 TFLOP/s) for every row, FP8 included.
Prints a Markdown table and writes results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from results import finish, metrics_summary, run_training, run_worker, single_gpu_env, timed

SHAPES = {
    "dense": {"preset": "llama-0.9b", "mbs": 8},
    "moe": {"preset": "moe-8x-1.4b", "mbs": 4},
    "dense-3b": {"preset": "llama-3b", "mbs": 2, "seq": 4096},
}
SEQ = 2048  # unless the shape names its own
MICRO_BATCHES = 8
PEAK = 989.0
DEFAULT_RUNS = ["hf-bf16", "bf16", "fp8-tensorwise", "fp8-delayed"]


def write_config(shape: str, run: str, steps: int, run_dir: Path, gpus: int = 1, log_interval: int = 2) -> Path:
    """The experiment file of one mcorekit run of this benchmark (also used by profile_step.py)."""
    s = SHAPES[shape]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    cfg = {"name": f"bench-{shape}-{run}", "model": {"preset": s["preset"]},
           "precision": {"dtype": "bf16", "fp8": run.removeprefix("fp8-") if run.startswith("fp8-") else None},
           "data": {"kind": "mock", "seq_length": s.get("seq", SEQ)},
           "schedule": {"train_iters": steps, "warmup_iters": 1, "micro_batch_size": s["mbs"],
                        "global_batch_size": s["mbs"] * MICRO_BATCHES * gpus},
           "checkpoint": {"save_interval": 10**6, "dir": str(run_dir / "ckpt")},
           "logging": {"log_interval": log_interval}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run_dir / "config.yaml"


def mcore_run(shape: str, run: str, steps: int, out: Path, extra: list[str], gpus: int = 1) -> dict:
    run_dir = out / f"{shape}-{run}-{gpus}gpu"
    precision = run
    if run == "bf16-te-experts":  # MoE experts through TE's GroupedLinear instead of the default torch._grouped_mm
        precision, extra = "bf16", [*extra, "moe.expert_gemm=te"]
    write_config(shape, precision, steps, run_dir, gpus)
    launcher = [sys.executable] if gpus == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   f"--nproc-per-node={gpus}"]
    cmd = [*launcher, "-m", "mcorekit.train", "--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir), *extra]
    proc = run_training(cmd, single_gpu_env(29571), run_dir)
    if proc.returncode:
        return {"shape": shape, "run": run, "gpus": gpus, "error": (proc.stdout + proc.stderr)[-1500:]}
    got = metrics_summary(run_dir)
    return {"shape": shape, "run": run, "gpus": gpus, **got, "tokens_per_s": got["tokens_per_s"] / gpus}


HF_WORKER = r"""
import json, statistics, sys, time, torch, transformers
from mcorekit.models.spec import resolve
from mcorekit.train.data import batches
from mcorekit.train.data.mock import MockDataset
from mcorekit.train.flops import train_flops_per_token
preset, mbs, micro, steps, seq, peak = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
spec = resolve(preset, None, {})
common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
              num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_query_groups,
              head_dim=spec.kv_channels, max_position_embeddings=spec.max_position_embeddings,
              rms_norm_eps=spec.norm_epsilon, tie_word_embeddings=False)
if spec.is_moe:
    cfg = transformers.MixtralConfig(**common, intermediate_size=spec.moe_ffn_hidden_size, num_local_experts=spec.num_experts,
                                     num_experts_per_tok=spec.moe_router_topk, router_aux_loss_coef=0.0)
else:
    cfg = transformers.LlamaConfig(**common, intermediate_size=spec.ffn_hidden_size)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
data = batches(MockDataset(1234, spec.vocab_size, seq), mbs, 0, 0, 1)
flops = train_flops_per_token(spec, seq, spec.vocab_size) * mbs * micro * seq
times, losses = [], []
for step in range(steps):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(micro):
        b = next(data)
        loss = model(input_ids=b["tokens"], labels=b["tokens"]).loss / micro  # HF shifts the labels itself
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(); times.append(time.perf_counter() - t); losses.append(loss.item() * micro)
steady = times[2:]
tps = mbs * micro * seq / statistics.median(steady)
print("RESULT " + json.dumps({"tokens_per_s": tps, "mfu": flops / statistics.median(steady) / 1e12 / peak,
      "mem_gb": torch.cuda.max_memory_allocated() / 1e9, "loss_first": losses[0], "loss_last": losses[-1]}))
"""


def hf_run(shape: str, steps: int) -> dict:
    s = SHAPES[shape]
    payload, output = run_worker(HF_WORKER, s["preset"], str(s["mbs"]), str(MICRO_BATCHES), str(steps),
                                 str(s.get("seq", SEQ)), str(PEAK))
    if payload is None:
        return {"shape": shape, "run": "hf-bf16", "error": output[-1500:]}
    return {"shape": shape, "run": "hf-bf16", **json.loads(payload)}


def table(results: list[dict]) -> str:
    rows = ["| shape | run | GPUs | tokens/s per GPU | MFU | peak mem GB | vs HF bf16 | scaling vs 1 GPU | loss first -> last |",
            "|---|---|---|---|---|---|---|---|---|"]
    hf = {r["shape"]: r.get("tokens_per_s") for r in results if r["run"] == "hf-bf16"}
    one = {(r["shape"], r["run"]): r.get("tokens_per_s") for r in results if r.get("gpus", 1) == 1}
    for r in results:
        gpus = r.get("gpus", 1)
        if "error" in r:
            rows.append(f"| {r['shape']} | {r['run']} | {gpus} | failed: {r['error'].splitlines()[-1][:80]} | | | | | |")
            continue
        base, single = hf.get(r["shape"]), one.get((r["shape"], r["run"]))
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
        scaling = f"{r['tokens_per_s'] / single * 100:.0f}%" if single and gpus > 1 else ""
        rows.append(f"| {r['shape']} | {r['run']} | {gpus} | {r['tokens_per_s'] / 1e3:.1f}k | {r['mfu'] * 100:.1f}% | "
                    f"{r['mem_gb']:.1f} | {ratio} | {scaling} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=[*SHAPES, "all"], default="all", help="all: dense and moe")
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="comma-separated: hf-bf16, bf16, fp8-<recipe>")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--gpus", default="1", help="comma-separated GPU counts for the mcorekit runs, e.g. 1,2")
    p.add_argument("--multi", nargs="*", default=[], help="overrides for runs on more than one GPU, e.g. parallel.ep=2")
    p.add_argument("--out", default="/tmp/mcorekit-train-bench")
    p.add_argument("extra", nargs="*", help="key=value overrides for the mcorekit runs, e.g. moe.router_fusion=true")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for shape in (["dense", "moe"] if a.shape == "all" else [a.shape]):
        for run in a.runs.split(","):
            for gpus in ([1] if run == "hf-bf16" else [int(g) for g in a.gpus.split(",")]):
                extra = a.extra + (a.multi if gpus > 1 else [])
                results.append(timed(lambda: hf_run(shape, a.steps) if run == "hf-bf16" else
                                     mcore_run(shape, run, a.steps, out, extra, gpus)))
    return finish(results, out, table)


if __name__ == "__main__":
    sys.exit(main())
