"""Where one training step's time goes, on one GPU: a torch.profiler trace of `train/loop.py` (CPU and CUDA).

    python bench/profile_step.py [--shape dense|moe|dense-3b] [--run bf16|fp8-<recipe>] [--steps 6] [--at 3] [--out DIR]
                                 [key=value ...]

Runs the benchmark shape of train_bench.py (same experiment file, mock data) with log_interval 1 and profiles
steps AT+1 .. AT+2. Prints, per step: wall time, the time the GPU ran any kernel (the union of kernel intervals;
the rest is the GPU waiting for the host), the host's blocking waits on the GPU (stream/event/device
synchronisations and device-to-host copies, with their count), then the kernels with the most GPU time and the
operators with the most host time. The profiler adds some microseconds per operator, so host time is an upper
bound. Writes summary.json (and the Chrome trace, trace.json.gz) under --out/<shape>-<run>.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

from overlap_bench import union
from results import run_training, single_gpu_env
from train_bench import SHAPES, write_config

PROFILED = 2
SYNC = re.compile(r"cudaStreamSynchronize|cudaEventSynchronize|cudaDeviceSynchronize|cudaMemcpy(?!.*Async)|"
                  r"aten::item|aten::_local_scalar_dense")
# Kernel families by name (first match wins): what a step's GPU time is made of.
KINDS = [("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|cublas", re.I)),
         ("attention", re.compile(r"fmha|flash|attn|attention|cudnn", re.I)),
         ("communication", re.compile(r"nccl", re.I)),
         ("memory copy/set", re.compile(r"^Memcpy|^Memset|copy", re.I))]


def kind_of(kernel: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(kernel)), "other (elementwise, norms, optimizer)")


def summarize(trace: dict, wall_s: float, steps: int) -> dict:
    """Per-step figures from a Chrome trace of `steps` steps that took `wall_s` seconds."""
    kernels: dict[str, list[float]] = defaultdict(list)
    spans, host, syncs = [], defaultdict(float), defaultdict(lambda: [0, 0.0])
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        name, dur = e.get("name", ""), float(e.get("dur", 0.0))
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels[name].append(dur)
            spans.append((float(e["ts"]), float(e["ts"]) + dur))
        elif e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"):
            if SYNC.search(name):
                syncs[name][0] += 1
                syncs[name][1] += dur
            if e.get("cat") == "cpu_op":
                host[name] += dur
    busy_ms = sum(b - a for a, b in union(spans)) / 1e3 / steps
    wall_ms = wall_s * 1e3 / steps
    top_kernels = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:15]
    by_kind: dict[str, float] = defaultdict(float)
    for name, durations in kernels.items():
        by_kind[kind_of(name)] += sum(durations) / 1e3 / steps
    return {
        "wall_ms": wall_ms, "gpu_busy_ms": busy_ms, "gpu_idle_frac": 1 - busy_ms / wall_ms,
        "kernels_per_step": sum(len(v) for v in kernels.values()) / steps,
        "host_waits": {k: {"calls": c // steps, "ms": t / 1e3 / steps} for k, (c, t) in sorted(syncs.items())},
        "kernel_ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"name": k[:110], "calls": len(v) // steps, "ms": sum(v) / 1e3 / steps} for k, v in top_kernels],
        # cpu_op durations nest (an op includes the ops it calls), so these overlap; read them as "time inside"
        "top_host_ops": [{"name": k[:110], "ms": t / 1e3 / steps}
                         for k, t in sorted(host.items(), key=lambda kv: -kv[1])[:15]],
    }


def worker(config: str, run_dir: str, at: int, overrides: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from mcorekit.config.experiment import load_experiment
    from mcorekit.train.loop import train

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    started: list[float] = []

    def on_step(m: dict) -> None:  # called after each step, once its loss is on the host (the GPU is done)
        if m["step"] == at:
            prof.start()
            started.append(time.perf_counter())
        elif m["step"] == at + PROFILED:
            wall = time.perf_counter() - started[0]
            prof.stop()
            path = Path(run_dir) / "trace.json"
            prof.export_chrome_trace(str(path))
            summary = summarize(json.loads(path.read_text()), wall, PROFILED)
            (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
            with path.open("rb") as src, gzip.open(str(path) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            path.unlink()

    train(load_experiment(config, overrides), Path(run_dir), on_step=on_step)
    dist.destroy_process_group()
    return 0


def report(name: str, s: dict) -> str:
    lines = [f"## {name}", f"step {s['wall_ms']:.1f} ms, GPU busy {s['gpu_busy_ms']:.1f} ms "
             f"({(1 - s['gpu_idle_frac']) * 100:.0f}%), {s['kernels_per_step']:.0f} kernels per step", "",
             "host waits on the GPU per step: " + (", ".join(f"{k} x{v['calls']} {v['ms']:.1f} ms"
                                                             for k, v in s["host_waits"].items()) or "none"), "",
             "| kernel family | ms/step |", "|---|---|"]
    lines += [f"| {k} | {ms:.1f} |" for k, ms in s.get("kernel_ms_by_kind", {}).items()]
    lines += ["", "| kernel | calls/step | ms/step |", "|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['calls']} | {k['ms']:.1f} |" for k in s["top_kernels"]]
    lines += ["", "| host operator (nested) | ms/step |", "|---|---|"]
    lines += [f"| `{k['name']}` | {k['ms']:.1f} |" for k in s["top_host_ops"]]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="moe")
    p.add_argument("--run", default="bf16", help="bf16 or fp8-<recipe>")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--at", type=int, default=3, help="profile the two steps after this one")
    p.add_argument("--out", default="/tmp/mcorekit-profile")
    p.add_argument("--name", default=None, help="sub-folder and title (default: <shape>-<run>)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. moe.dispatcher=allgather")
    a = p.parse_args()
    if a.steps < a.at + PROFILED:
        p.error(f"--steps must be at least --at + {PROFILED}")
    name = a.name or f"{a.shape}-{a.run}"
    run_dir = Path(a.out) / name
    config = write_config(a.shape, a.run, a.steps, run_dir, log_interval=1)
    proc = run_training([sys.executable, __file__, "--worker", str(config), str(run_dir), str(a.at), *a.overrides],
                        single_gpu_env(29572), run_dir)
    if proc.returncode or not (run_dir / "summary.json").exists():
        print(f"{name}: failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        return 1
    print(report(name + (" " + " ".join(a.overrides) if a.overrides else ""),
                 json.loads((run_dir / "summary.json").read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
