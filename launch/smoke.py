"""The smallest real job: every task joins one torch.distributed group and all-reduces its rank.

`mcorekit launch smoke --cluster X` runs it to prove a cluster profile works end to end (srun, SLURM_*
environment, rendezvous, collective, accounting) before spending GPU hours.
"""

from __future__ import annotations

import socket
from typing import Any


def allreduce_check() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from mcorekit.launch.env import init_process_group

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    d = init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(d.local_rank)
    device = "cuda" if backend == "nccl" else "cpu"
    value = torch.tensor([float(d.rank + 1)], device=device)
    dist.all_reduce(value)
    result = {
        "rank": d.rank,
        "world_size": d.world_size,
        "sum": value.item(),
        "expected": d.world_size * (d.world_size + 1) / 2,
        "backend": backend,
        "host": socket.gethostname(),
        "env_source": d.source,
    }
    dist.destroy_process_group()
    return result
