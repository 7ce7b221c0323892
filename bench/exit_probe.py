"""What ending a training process's distributed state costs, on one GPU: Megatron-Core's process groups (formed as
train/build.py forms them, each used once, as a run uses them) ended three ways, each in a fresh process, timed by
the parent from the child's last line before its ending to the child's exit (what holds a job):
  destroy   torch's destroy_process_group (NCCL's graceful teardown of each communicator), then os._exit
  abort     torch's _abort_process_group (ncclCommAbort), then os._exit
  left      the process groups left to the exit (train/shutdown.ranks_through, then os._exit): what a run does since
            the end-of-run hold of the speed issue

    python bench/exit_probe.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from results import die_with_parent, single_gpu_env

CHILD = r"""
import os, sys, time, torch, torch.distributed as dist
from megatron.core import parallel_state as ps
from mcorekit.runtime.env import init_process_group
from mcorekit.train.shutdown import ranks_through
init_process_group("nccl")
torch.cuda.set_device(0)
ps.initialize_model_parallel()
x = torch.ones(1 << 20, device="cuda")
for group in (ps.get_data_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True),
              ps.get_tensor_model_parallel_group(), ps.get_model_parallel_group(), None):
    dist.all_reduce(x, group=group)
dist.barrier()
torch.cuda.synchronize()
print("READY", time.time(), flush=True)
start = time.perf_counter()
case = sys.argv[1]
if case == "destroy":
    dist.destroy_process_group()
elif case == "abort":
    dist.distributed_c10d._abort_process_group()
else:
    ranks_through(dist.get_rank(), dist.get_world_size())
print("CALL", time.perf_counter() - start, flush=True)
os._exit(0)
"""


def one(case: str, port: int) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", CHILD, case], env=single_gpu_env(port), capture_output=True,
                          text=True, timeout=300, preexec_fn=die_with_parent)
    ended = time.time()
    lines = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines() if ln.startswith(("READY ", "CALL ")))
    if proc.returncode or "READY" not in lines:
        raise SystemExit(f"{case}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return {"call_s": float(lines["CALL"]), "hold_s": ended - float(lines["READY"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    rows: dict[str, list[dict[str, float]]] = {}
    for r in range(a.repeats):
        for i, case in enumerate(("destroy", "abort", "left")):
            rows.setdefault(case, []).append(one(case, 29610 + 3 * r + i))
    for case, runs in rows.items():
        print(json.dumps({"case": case, "call_s": [round(x["call_s"], 3) for x in runs],
                          "hold_s": [round(x["hold_s"], 3) for x in runs],
                          "median_hold_s": round(statistics.median(x["hold_s"] for x in runs), 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
