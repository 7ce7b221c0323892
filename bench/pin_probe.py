"""Could an async save's pinned staging be allocated before the save, beside training? The first async save of a
run blocks the loop while torch's caching host allocator pins a host copy of the whole checkpoint (23-26 s for the
3B shape's 36.6 GB on one H200); later saves reuse the cached blocks (about 1 s). This probe measures, in one
process per mode, with torch alone:

    python bench/pin_probe.py [--gb 36] [--out DIR]

  cold     the staging copies (GPU -> host, non_blocking=True, as Megatron-Core's async staging) into nothing
           cached: what the first async save blocks for
  prepin   a thread pins blocks of the same sizes (torch.empty(pin_memory=True)) and frees them to the cache while
           the main thread runs GPU steps (bf16 matmuls); the steps' times with and without the thread, then the
           same staging copies, now from the cache
The GPU state is --gb GB in 256 MiB tensors. Prints one JSON line per mode and writes results.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, threading, time, torch
gb, mode = float(sys.argv[1]), sys.argv[2]
block = 256 << 20
src = [torch.empty(block, dtype=torch.uint8, device="cuda") for _ in range(int(gb * 1e9) // block)]
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

def step():
    start = time.perf_counter()
    for _ in range(20):
        a.matmul(a)
    torch.cuda.synchronize()
    return time.perf_counter() - start

for _ in range(5):
    step()
free = [step() for _ in range(20)]
out = {"mode": mode, "gb": gb, "tensors": len(src), "step_ms_free": round(statistics.median(free) * 1e3, 2)}
if mode == "prepin":
    busy, done = [], threading.Event()
    def pin():
        start = time.perf_counter()
        held = [torch.empty(t.numel(), dtype=torch.uint8, pin_memory=True) for t in src]
        del held  # to the cache
        out["pin_s"] = round(time.perf_counter() - start, 2)
        done.set()
    thread = threading.Thread(target=pin)
    thread.start()
    while not done.is_set():
        busy.append(step())
    thread.join()
    out["steps_while_pinning"] = len(busy)
    out["step_ms_while_pinning"] = round(statistics.median(busy) * 1e3, 2) if busy else None
    out["step_ms_max_while_pinning"] = round(max(busy) * 1e3, 2) if busy else None
start = time.perf_counter()
staged = [t.to("cpu", non_blocking=True) for t in src]
torch.cuda.synchronize()
out["staging_blocks_s"] = round(time.perf_counter() - start, 2)
print(json.dumps(out), flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=36.0)
    p.add_argument("--out", default="pin-probe")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in ("cold", "prepin"):
        proc = subprocess.run([sys.executable, "-c", CHILD, str(a.gb), mode], capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        rows.append(json.loads(lines[-1]) if proc.returncode == 0 and lines else
                    {"mode": mode, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
        print(json.dumps(rows[-1]), flush=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
