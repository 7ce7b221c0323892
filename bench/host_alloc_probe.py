"""How fast torch's caching host allocator pins an async save's staging, and hands it back, with cudaHostAlloc (its
default) and with malloc + cudaHostRegister on several threads (PYTORCH_CUDA_ALLOC_CONF's
`pinned_use_cuda_host_register:True,pinned_num_register_threads:N`, which torch documents as cutting the time the
allocation holds CUDA's lock). The first async save of a run blocks the loop while the whole checkpoint is pinned
(23-26 s for the 3B shape's 36.6 GB on one H200), and a run with async_save ends 6-10 s after its final save
handing that memory back. One process per setting, torch alone:

    python bench/host_alloc_probe.py [--gb 36] [--threads 8,16] [--out DIR]

Each process holds --gb GB of GPU tensors (256 MiB each) and measures:
  stage_cold_s     the staging copies (`tensor.to("cpu", non_blocking=True)`, as Megatron-Core's async staging)
                   into an empty cache: what the first async save blocks for
  stage_cached_s   the same copies again, the blocks now cached: what a later async save blocks for
  release_s        handing the cached blocks back (torch._C._host_emptyCache, as train/shutdown.py does)
  pin_s, step_ms_* a thread pins blocks of the same sizes while the main thread runs GPU steps (bf16 matmuls):
                   how long, and how much slower the steps are meanwhile
  exit_s           from the process's last line to its end (the blocks handed back before)
Prints one JSON line per setting and writes results.json.

    python bench/host_alloc_probe.py --exit [--gb 36] [--threads 8] [--out DIR]

How a process holding an async save's staging in torch's cache ends fastest: two processes per setting stage --gb
GB as above, then one hands the blocks back (release_s) and leaves by os._exit, as train/shutdown.py and leave() do,
the other leaves by os._exit with the blocks still cached, so the CUDA driver unpins them in the process's teardown.
exit_s is from the process's last line to its end as its parent sees it (what Slurm waits for).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, os, statistics, sys, threading, time, torch
gb = float(sys.argv[1])
block = 256 << 20
src = [torch.empty(block, dtype=torch.uint8, device="cuda") for _ in range(int(gb * 1e9) // block)]
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
out = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "gb": gb, "tensors": len(src)}
try:
    out["thp"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
except OSError:
    pass

def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, round(time.perf_counter() - start, 2)

def staging():
    staged = [t.to("cpu", non_blocking=True) for t in src]
    torch.cuda.synchronize()
    return staged

def step():
    start = time.perf_counter()
    for _ in range(20):
        a.matmul(a)
    torch.cuda.synchronize()
    return time.perf_counter() - start

staged, out["stage_cold_s"] = timed(staging)
assert all(t.is_pinned() for t in staged[:4])
del staged
staged, out["stage_cached_s"] = timed(staging)
del staged
_, out["release_s"] = timed(torch._C._host_emptyCache)

for _ in range(5):
    step()
out["step_ms_free"] = round(statistics.median(step() for _ in range(20)) * 1e3, 2)
busy, done = [], threading.Event()
def pin():
    held, out["pin_s"] = timed(lambda: [torch.empty(t.numel(), dtype=torch.uint8, pin_memory=True) for t in src])
    del held
    done.set()
thread = threading.Thread(target=pin)
thread.start()
while not done.is_set():
    busy.append(step())
thread.join()
out["steps_while_pinning"] = len(busy)
out["step_ms_while_pinning"] = round(statistics.median(busy) * 1e3, 2) if busy else None
out["step_ms_max_while_pinning"] = round(max(busy) * 1e3, 2) if busy else None
_, out["release_after_pin_s"] = timed(torch._C._host_emptyCache)
print(json.dumps(out), flush=True)
"""

EXIT_CHILD = r"""
import json, os, sys, time, torch
gb, release = float(sys.argv[1]), sys.argv[2] == "release"
block = 256 << 20
src = [torch.empty(block, dtype=torch.uint8, device="cuda") for _ in range(int(gb * 1e9) // block)]
staged = [t.to("cpu", non_blocking=True) for t in src]
torch.cuda.synchronize()
assert all(t.is_pinned() for t in staged[:4])
del staged  # into torch's cache of pinned blocks, as after an async save
out = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "gb": gb, "release": release}
if release:
    start = time.perf_counter()
    torch._C._host_emptyCache()
    out["release_s"] = round(time.perf_counter() - start, 2)
print(json.dumps(out), flush=True)
os._exit(0)
"""


def run(gb: float, conf: str, child: str = CHILD, *args: str) -> dict:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf) if conf else {k: v for k, v in os.environ.items()
                                                                     if k != "PYTORCH_CUDA_ALLOC_CONF"}
    proc = subprocess.Popen([sys.executable, "-c", child, str(gb), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    row, last = None, None
    for line in proc.stdout:
        if line.startswith("{"):
            row, last = json.loads(line), time.perf_counter()
    stderr = proc.stderr.read()
    rc = proc.wait()
    if rc != 0 or row is None:
        return {"alloc_conf": conf, "error": (stderr.strip().splitlines() or [f"exit {rc}"])[-1]}
    row["exit_s"] = round(time.perf_counter() - last, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=36.0)
    p.add_argument("--threads", default="8,16", help="pinned_num_register_threads values to try beside the default")
    p.add_argument("--out", default="host-alloc-probe")
    p.add_argument("--exit", action="store_true", help="time a process's end with its staging handed back first "
                   "and with it still cached (and only that)")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    confs = [""] + [f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{n}" for n in a.threads.split(",")]
    runs = [(conf, EXIT_CHILD, how) for conf in confs for how in ("release", "leave")] if a.exit else \
        [(conf, CHILD) for conf in confs]
    rows = []
    for conf, child, *args in runs:
        rows.append({**run(a.gb, conf, child, *args), **({"release": args[0] == "release"} if args else {})})
        print(json.dumps(rows[-1]), flush=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
