"""How much communication the overlaps hide, on one node with 2+ GPUs (torchrun, no Slurm needed).

    python bench/overlap_bench.py [--gpus 2] [--steps 8] [--out DIR] [--runs dp-off,dp-grad,dp-both,tp-sp,tp-sp-ub]

Runs `train/loop.py` on the 0.89B dense shape (seq 2048, micro-batch 4, 2 micro-batches per step and GPU):
  dp-off     DP=N, distributed optimizer, overlap_grad_reduce and overlap_param_gather off
  dp-grad    DP=N, gradient reduce-scatter overlapped with the backward pass
  dp-both    DP=N, and the parameter all-gather overlapped with the next forward pass
  tp-sp      TP=N with sequence parallelism, TP communication not overlapped
  tp-sp-ub   TP=N with sequence parallelism and TE userbuffers (optimizer.tp_comm_overlap)
Each run profiles two steps on rank 0 (torch.profiler, CUDA kernels only) and reports, per step, the time GPU 0
spends in communication kernels (NCCL, TE userbuffers, peer-to-peer copies), the part of it that ran while a
compute kernel was running on another stream ("hidden"), and the exposed rest. Step time is the median of all
logged steps after the second. Prints a Markdown table; writes results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

import yaml
from results import finish, run_training, timed

RUNS = {
    "dp-off": ({"overlap_grad_reduce": False, "overlap_param_gather": False}, {}),
    "dp-grad": ({"overlap_grad_reduce": True, "overlap_param_gather": False}, {}),
    "dp-both": ({"overlap_grad_reduce": True, "overlap_param_gather": True}, {}),
    "tp-sp": ({"tp_comm_overlap": False}, {"tp": "N", "sequence_parallel": True}),
    "tp-sp-ub": ({"tp_comm_overlap": True}, {"tp": "N", "sequence_parallel": True}),
}
SEQ, MBS, MICRO = 2048, 4, 2
PROFILE_FROM, PROFILE_STEPS = 5, 2
COMM = re.compile(r"nccl|userbuffers|PtoP", re.IGNORECASE)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Total length of `intervals` (disjoint, sorted) that lies inside `cover` (disjoint, sorted)."""
    total, j = 0.0, 0
    for a, b in intervals:
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            total += min(b, cover[k][1]) - max(a, cover[k][0])
            k += 1
    return total


def overlap_from_trace(trace: dict, steps: int) -> dict[str, float]:
    """Communication time per step on this GPU, and how much of it overlapped compute kernels (ms)."""
    comm, compute = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy"):
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if COMM.search(e.get("name", "")):
            comm.append(span)
        elif e["cat"] == "kernel":
            compute.append(span)
    comm_u, compute_u = union(comm), union(compute)
    comm_ms = sum(b - a for a, b in comm_u) / 1e3 / steps
    hidden_ms = covered(comm_u, compute_u) / 1e3 / steps
    return {"comm_ms": comm_ms, "hidden_ms": hidden_ms, "exposed_ms": comm_ms - hidden_ms,
            "hidden_frac": hidden_ms / comm_ms if comm_ms else 0.0}


def worker(config: str, run_dir: str) -> int:
    """One rank under torchrun: train, profiling steps PROFILE_FROM+1 .. PROFILE_FROM+PROFILE_STEPS on rank 0."""
    import torch
    import torch.distributed as dist

    from mcorekit.config.experiment import load_experiment
    from mcorekit.train.loop import train

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])

    def on_step(m: dict) -> None:
        if dist.get_rank() != 0:
            return
        if m["step"] == PROFILE_FROM:
            prof.start()
        elif m["step"] == PROFILE_FROM + PROFILE_STEPS:
            prof.stop()
            prof.export_chrome_trace(str(Path(run_dir) / "trace.json"))

    train(load_experiment(config), Path(run_dir), on_step=on_step)
    if dist.get_rank() == 0:
        stats = overlap_from_trace(json.loads((Path(run_dir) / "trace.json").read_text()), PROFILE_STEPS)
        (Path(run_dir) / "overlap.json").write_text(json.dumps(stats))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run(name: str, gpus: int, steps: int, out: Path) -> dict:
    optimizer, parallel = RUNS[name]
    parallel = {k: (gpus if v == "N" else v) for k, v in parallel.items()}
    dp = gpus // parallel.get("tp", 1)
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    cfg = {"name": f"overlap-{name}", "model": {"preset": "llama-0.9b"}, "parallel": parallel,
           "optimizer": optimizer, "data": {"kind": "mock", "seq_length": SEQ},
           "schedule": {"train_iters": steps, "warmup_iters": 1, "micro_batch_size": MBS,
                        "global_batch_size": MBS * MICRO * dp},
           "checkpoint": {"save_interval": 10**6, "dir": str(run_dir / "ckpt")}, "logging": {"log_interval": 1}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "UB_SKIPMC": "1"}  # no NVLink multicast (see KINDS.md)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", __file__,
           "--worker", str(run_dir / "config.yaml"), str(run_dir)]
    proc = run_training(cmd, env, run_dir)
    if proc.returncode:
        return {"run": name, "error": (proc.stdout + proc.stderr)[-2000:]}
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = cfg["schedule"]["global_batch_size"] * SEQ
    step_ms = statistics.median(tokens_per_step / x["tokens_per_s"] for x in m[2:]) * 1e3
    return {"run": name, "gpus": gpus, "parallel": parallel, "step_ms": step_ms,
            "tokens_per_s_per_gpu": tokens_per_step / step_ms * 1e3 / gpus, "mfu": statistics.median(x["mfu"] for x in m[2:]),
            **json.loads((run_dir / "overlap.json").read_text())}


def table(results: list[dict]) -> str:
    rows = ["| run | layout | step ms | tokens/s/GPU | MFU | comm ms/step (GPU 0) | hidden | exposed ms |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['run']} | failed: {r['error'].strip().splitlines()[-1][:90]} | | | | | | |")
            continue
        lay = ", ".join(f"{k}={v}" for k, v in r["parallel"].items()) or f"dp={r['gpus']}"
        rows.append(f"| {r['run']} | {lay} | {r['step_ms']:.1f} | {r['tokens_per_s_per_gpu'] / 1e3:.1f}k | "
                    f"{r['mfu'] * 100:.1f}% | {r['comm_ms']:.1f} | {r['hidden_frac'] * 100:.0f}% | {r['exposed_ms']:.1f} |")
    return "\n".join(rows)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--out", default="/tmp/mcorekit-overlap-bench")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [timed(lambda: run(name, a.gpus, a.steps, out)) for name in a.runs.split(",")]
    return finish(results, out, table)


if __name__ == "__main__":
    sys.exit(main())
