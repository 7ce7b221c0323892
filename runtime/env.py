"""Rank, world size and rendezvous address on the nodes, from SLURM_* (srun, one task per GPU) or torchrun's env."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "slurm", "torchrun" or "single"


def first_host(nodelist: str) -> str:
    """First host of a Slurm nodelist expression such as 'gpu[003-005,9],cpu1'."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        head = nodelist.split(",")[0]
        if "[" in head:  # gpu[003-005] -> gpu003
            prefix, rng = head.split("[", 1)
            return prefix + rng.split("-")[0].split(",")[0].rstrip("]")
        return head


def port_for_job(job_id: str) -> int:
    """A rendezvous port derived from the job id, so that jobs sharing a node do not collide."""
    digits = "".join(c for c in job_id if c.isdigit()) or "0"
    return 20000 + int(digits) % 20000


def from_environ(env: dict[str, str] | None = None) -> DistEnv:
    env = dict(os.environ if env is None else env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job_id = env.get("SLURM_ARRAY_JOB_ID", "") + env.get("SLURM_ARRAY_TASK_ID", "") or env.get("SLURM_JOB_ID", "0")
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "localhost")),
            master_port=int(env.get("MASTER_PORT") or port_for_job(job_id)),
            source="slurm",
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            source="torchrun",
        )
    return DistEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", "29500")), "single")


def init_process_group(backend: str, timeout_s: int = 300) -> DistEnv:
    """Form the default torch.distributed group from the environment (tcp:// rendezvous on rank 0's host)."""
    from datetime import timedelta

    import torch.distributed as dist

    d = from_environ()
    os.environ.update(
        RANK=str(d.rank), WORLD_SIZE=str(d.world_size), LOCAL_RANK=str(d.local_rank),
        MASTER_ADDR=d.master_addr, MASTER_PORT=str(d.master_port),
    )
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{d.master_addr}:{d.master_port}",
            rank=d.rank,
            world_size=d.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return d
