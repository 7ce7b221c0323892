"""Rank, world size and rendezvous address on the nodes, from SLURM_* (srun, one task per GPU) or torchrun's env."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mcorekit.caches import precompile_in_background, use_bytecode_cache, user_cache
from mcorekit.errors import ConfigError

COMPILE_CACHE = "TORCHINDUCTOR_CACHE_DIR"
# torch's CUDA allocators take their settings from the first of these that is set (both set: the first wins, seen
# on one H200 with torch 2.11, 2026-12-03)
ALLOC_CONFS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
REGISTERED_PINNING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


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

    def number(name: str, default: str | None = None) -> int:
        value = env.get(name) or default
        if value is None or not value.isascii() or not value.isdigit():
            raise ConfigError(f"environment variable {name}={env.get(name, '')!r} is not a whole number; it is set by "
                              f"srun or torchrun for each process (unset it to run one process by hand)")
        return int(value)

    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job_id = env.get("SLURM_ARRAY_JOB_ID", "") + env.get("SLURM_ARRAY_TASK_ID", "") or env.get("SLURM_JOB_ID", "0")
        return DistEnv(
            rank=number("SLURM_PROCID"),
            world_size=number("SLURM_NTASKS"),
            local_rank=number("SLURM_LOCALID", "0"),
            master_addr=env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "localhost")),
            master_port=number("MASTER_PORT", str(port_for_job(job_id))),
            source="slurm",
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=number("RANK"),
            world_size=number("WORLD_SIZE"),
            local_rank=number("LOCAL_RANK", "0"),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=number("MASTER_PORT", "29500"),
            source="torchrun",
        )
    return DistEnv(0, 1, 0, "127.0.0.1", number("MASTER_PORT", "29500"), "single")


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


def prepare_training_process(env: dict[str, str] | None = None) -> None:
    """What a training process sets in its environment before torch and Megatron-Core are imported."""
    folder = use_bytecode_cache(env, children=True)
    if folder is not None:
        precompile_in_background(folder, env)
    use_compile_cache(env)
    use_registered_pinning(env)


def use_registered_pinning(env: dict[str, str] | None = None) -> str:
    """Pinned host memory from malloc + cudaHostRegister on 8 threads instead of cudaHostAlloc (torch's caching host
    allocator options, added to the allocator settings the environment has). An async save without room for its
    copy on the GPU stages the whole checkpoint in pinned memory at its first save, which blocks the loop: for 36 GB
    on one H200 (2026-12-03, bench/host_alloc_probe.py) 22.0 s with cudaHostAlloc, 5.1 s with this (3.4 s with 16
    threads), and pinning on another thread slowed the GPU steps launched meanwhile 94x with cudaHostAlloc (it holds
    CUDA's lock), 4% with this. In a 3B run the first async save blocked 14.0 s (23-26 s before; its writer a thread,
    not a fork, which would copy these pages: train/checkpoint_writer.WriterThread) and the staging was handed back at
    the end in 2.4 s (6.1-9.6 s). Settings that already name pinned_use_cuda_host_register are left as they are. Returns
    them."""
    env = os.environ if env is None else env
    name = next((n for n in ALLOC_CONFS if n in env), ALLOC_CONFS[0])  # set, even to nothing, is what torch reads
    conf = env.get(name, "")
    if "pinned_use_cuda_host_register" not in conf:
        extra = "pinned_use_cuda_host_register:True" if "pinned_num_register_threads" in conf else REGISTERED_PINNING
        conf = f"{conf},{extra}" if conf else extra
        env[name] = conf
    return conf


def use_compile_cache(env: dict[str, str] | None = None) -> Path | None:
    """Where torch.compile keeps what it compiled (Megatron-Core's fused kernels, the FP8 experts' quantization), so a
    later process loads it instead of compiling: $TORCHINDUCTOR_CACHE_DIR if set (a cluster profile's `env` can put
    it on shared storage), else $XDG_CACHE_HOME/mcorekit/torchinductor (~/.cache/...). Torch's own default,
    /tmp/torchinductor_$USER, is per node and on many clusters per job, so requeued and later jobs compiled from
    scratch: step 1 of the 3B shape took 15.0 s cold and 3.8 s with the cache warm (one H200, 2026-12-02).
    Sets the variable in `env` (os.environ) and returns the folder; None (torch's default stays) where no home
    folder is known or the folder cannot be created and written. Call it before Megatron-Core is imported: importing
    it has torch write its own default into the environment (torch._dynamo.package reads the cache folder)."""
    env = os.environ if env is None else env
    if env.get(COMPILE_CACHE):
        return Path(env[COMPILE_CACHE])
    folder = user_cache(env, "torchinductor")
    if folder is not None:
        env[COMPILE_CACHE] = str(folder)
    return folder
