"""How long a process takes to end while torch's caching host allocator holds pinned memory, by how it ends: what
a training run with async_save pays after its final save (its first async save pinned a host copy of the
checkpoint, which stays cached). One child process per mode and size, timed from the parent:

    python bench/exit_probe.py [--gb 8,36] [--modes none,release,exit,interpreter] [--out DIR]

  none         no pinned memory: the CUDA context alone, then os._exit (the floor)
  release      torch._C._host_emptyCache() (cudaFreeHost of every cached block), then os._exit (train/shutdown.py)
  exit         os._exit with the blocks still cached: the kernel and the driver unpin them as the process ends
  interpreter  sys.exit: the interpreter's own finalization and torch's exit path
The pinned memory is allocated as an async save stages a checkpoint: one tensor per weight and optimizer state,
here 256 MiB each, copied from the GPU with non_blocking=True (pinned by torch's caching host allocator), then
freed back to its cache. Prints a Markdown table and writes results.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import os, sys, time, torch
gb, mode = float(sys.argv[1]), sys.argv[2]
torch.cuda.init()
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
held = []
if mode != "none":
    for _ in range(int(gb * 1e9) // (256 << 20)):
        held.append(x.to("cpu", non_blocking=True))  # pinned, as Megatron-Core's async staging
    torch.cuda.synchronize()
    del held  # back to the cache, as after the async save is finalized
print("ready", time.time(), flush=True)
if mode == "release":
    start = time.time()
    torch._C._host_emptyCache()
    print("released", time.time() - start, flush=True)
if mode == "interpreter":
    sys.exit(0)
os._exit(0)
"""


def one(gb: float, mode: str) -> dict[str, float | str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(gb), mode], stdout=subprocess.PIPE, text=True)
    ready, released = None, None
    assert proc.stdout is not None
    for line in proc.stdout:  # the child's two marks; anything else a library prints is passed over
        match line.split():
            case ["ready", value]:
                ready = float(value)
            case ["released", value]:
                released = float(value)
    proc.wait()
    ended = time.time()
    if proc.returncode != 0 or ready is None:
        return {"gb": gb, "mode": mode, "error": f"exit code {proc.returncode}"}
    out: dict[str, float | str] = {"gb": gb, "mode": mode, "end_s": round(ended - ready, 2)}
    if released is not None:
        out["release_s"] = round(released, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", default="8,36", help="pinned GB, comma-separated")
    p.add_argument("--modes", default="none,release,exit,interpreter")
    p.add_argument("--out", default="exit-probe")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for gb in (float(g) for g in a.gb.split(",")):
        for mode in a.modes.split(","):
            rows.append(one(gb, mode))
            print(json.dumps(rows[-1]), flush=True)
            (out / "results.json").write_text(json.dumps(rows, indent=1))
    print("\n| pinned GB | how it ends | from ready to the process's end, s | of which cudaFreeHost, s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['gb']:g} | {r['mode']} | {r.get('end_s', r.get('error'))} | {r.get('release_s', '')} |")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
