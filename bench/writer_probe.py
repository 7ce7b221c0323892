"""Why a background checkpoint write staged on the GPU ran slower beside training steps than one staged in host memory
(docs/train.md: 0.84 against 1.11 GB/s on one H200 on 2026-12-03): one process, torch and mcorekit's writer parts
(no Megatron-Core), the parts apart.

    [CUDA_DEVICE_MAX_CONNECTIONS=1] python bench/writer_probe.py [--gb 8] [--out /tmp/writer-probe] [--scenarios all]

A writer thread writes --gb of tensors (128 MB each) to files with torch.save and fsyncs them, as a checkpoint
writer does, while the main thread either rests or runs "steps" (bf16 matmuls on the GPU, each step ended by a
`.item()`, as a training step ends with its loss; `sync` ends each with torch.cuda.synchronize instead). The
writer takes its tensors either from pinned host memory staged before (`host`) or from the GPU, copied to pinned
memory on the writer's high-priority side stream one tensor ahead of the writer by
train/checkpoint_writer.copied_ahead (`gpu`); `copy` copies without writing. Run it with
CUDA_DEVICE_MAX_CONNECTIONS=1, as the launcher's jobs run, and without: with one connection a copy waits for the
step queued before it. Reported per scenario: the writer's GB/s and the steps' seconds (against the steps alone).
Host memory is pinned through cudaHostRegister, as in training (runtime/env.use_registered_pinning). CPU only: a
smoke run with tiny sizes and no copies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
import torch  # noqa: E402

SCENARIOS = {  # name: (tensors from, main thread, write)
    "steps": (None, "item", False),
    "host-idle": ("host", None, True),
    "host-steps": ("host", "item", True),
    "gpu-idle": ("gpu", None, True),
    "gpu-steps": ("gpu", "item", True),
    "gpu-steps-sync": ("gpu", "sync", True),
    "copy-steps": ("gpu", "item", False),
}


def writer(tensors: Iterator[Any], out: Path, write: bool, result: dict[str, float]) -> None:
    start, n = time.perf_counter(), 0
    for i, t in enumerate(tensors):
        n += t.numel() * t.element_size()
        if write:
            with open(out / f"t{i}.pt", "wb") as f:
                torch.save(t, f)
                f.flush()
                os.fsync(f.fileno())
    result["seconds"] = time.perf_counter() - start
    result["gb_per_s"] = n / 1e9 / result["seconds"]


def steps(until: Callable[[], bool], how: str, size: int, count: int = 0) -> list[float]:
    """Step times: each step 300 matmuls of size x size (about 0.5 s on an H200), then .item() (or synchronize)."""
    a = torch.randn(size, size, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)
    out: list[float] = []
    while not until() or len(out) < count:
        start = time.perf_counter()
        x = a
        for _ in range(300):
            x = x @ a
        if how == "sync" and torch.cuda.is_available():
            torch.cuda.synchronize()
        else:
            x[0, 0].item()
        out.append(time.perf_counter() - start)
        if count and len(out) >= count and until():
            break
    return out


def run(name: str, gpu_tensors: list[Any], host_tensors: list[Any], out: Path, size: int) -> dict[str, Any]:
    source, main, write = SCENARIOS[name]
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    if source is None:
        times = steps(lambda: True, main, size, count=20)
        return {"scenario": name, "step_s": round(statistics.median(times), 4)}
    if source == "host":
        tensors: Iterator[Any] = iter(host_tensors)
    else:
        from mcorekit.train.checkpoint_writer import copied_ahead

        tensors = (t for _, t in copied_ahead([(None, t) for t in gpu_tensors]))
    result: dict[str, float] = {}
    thread = threading.Thread(target=writer, args=(tensors, folder, write, result))
    thread.start()
    times = steps(lambda: not thread.is_alive(), main, size) if main else []
    thread.join()
    for f in folder.iterdir():
        f.unlink()
    return {"scenario": name, "writer_gb_per_s": round(result["gb_per_s"], 3), "writer_s": round(result["seconds"], 2),
            "step_s": round(statistics.median(times), 4) if times else None, "steps": len(times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=8.0)
    p.add_argument("--out", default="/tmp/writer-probe")
    p.add_argument("--scenarios", default="all", help=f"comma-separated, of {', '.join(SCENARIOS)}")
    a = p.parse_args(argv)
    names = list(SCENARIOS) if a.scenarios == "all" else a.scenarios.split(",")
    if bad := [n for n in names if n not in SCENARIOS]:
        p.error(f"unknown scenario(s) {bad}")
    gpu = torch.cuda.is_available()
    each, size = (2**27, 8192) if gpu else (2**16, 64)  # 128 MB tensors on a GPU; a smoke run on CPU
    count = max(1, int(a.gb * 1e9 / each)) if gpu else 4
    device = "cuda" if gpu else "cpu"
    gpu_tensors = [torch.full((each // 4,), float(i), device=device) for i in range(count)]
    start = time.perf_counter()
    host_tensors = [torch.empty_like(t, device="cpu", pin_memory=gpu).copy_(t) for t in gpu_tensors]
    print(json.dumps({"tensors": count, "gb": round(count * each / 1e9, 2), "staged_host_s":
                      round(time.perf_counter() - start, 2)}), flush=True)
    out = Path(a.out)
    results = []
    for name in names:
        results.append(run(name, gpu_tensors, host_tensors, out, size))
        print(json.dumps(results[-1]), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("| scenario | writer GB/s | step s (median) |\n|---|---|---|")
    for r in results:
        print(f"| {r['scenario']} | {r.get('writer_gb_per_s', '')} | {r['step_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
