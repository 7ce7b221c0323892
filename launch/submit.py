"""Render and submit sbatch jobs with submitit: srun-native, one task per GPU, values quoted or rejected.

`render()` gives the exact script `sbatch` will receive (what `--dry-run` prints and the golden tests pin);
`submit()` hands the same parameters to submitit and records the job in the run root's job registry.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from mcorekit.errors import ConfigError, LaunchError, MCoreKitError
from mcorekit.launch.config import ENV_KEY_RE, NAME_RE, ClusterProfile, _no_control, parse_time_minutes, shown

# Environment every Megatron job gets; a profile's env can override any of them.
GPU_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # keeps TP/SP communication ordered with compute (Megatron needs it)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a hung collective ends the job instead of burning its time
    "NCCL_DEBUG": "WARN",
}
COMMON_ENV = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
INHERITED_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

REGISTRY = "jobs.jsonl"


def _checked(value: str, what: str) -> str:
    try:
        return _no_control(value, what)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass
class JobSpec:
    name: str
    run_dir: Path
    nodes: int = 1
    time: str | None = None  # default: the profile's limit
    exclusive: bool | None = None
    dependency: str | None = None  # e.g. "afterok:123"
    array_size: int | None = None  # a job array of this many tasks
    array_parallelism: int | None = None
    gpus_per_node: int | None = None  # default: the profile's; 0 runs a CPU job on a GPU cluster
    tasks_per_node: int | None = None  # default: one per GPU (a single-process GPU tool such as trtllm-build sets 1)
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ConfigError(f"job name {self.name!r} must be letters, digits, '.', '_' or '-' (max 64)")
        _checked(str(self.run_dir), "run directory")
        for what, value, low in (("nodes", self.nodes, 1), ("array size", self.array_size, 1),
                                 ("array parallelism (--max-parallel)", self.array_parallelism, 1),
                                 ("GPUs per node", self.gpus_per_node, 0), ("tasks per node", self.tasks_per_node, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ConfigError(f"{what} must be a whole number >= {low}, got {value!r}")
        if self.dependency is not None and not all(
            part.split(":")[0] in ("afterok", "afterany", "afternotok", "after", "singleton") and
            all(p.replace("_", "").isdigit() for p in part.split(":")[1:])
            for part in self.dependency.split(",")
        ):
            raise ConfigError(f"dependency {self.dependency!r} is not of the form afterok:JOBID[:JOBID]")


def sbatch_parameters(profile: ClusterProfile, spec: JobSpec) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for this profile and job."""
    gpus = profile.gpus_per_node if spec.gpus_per_node is None else spec.gpus_per_node
    if spec.tasks_per_node:
        tasks = spec.tasks_per_node
    elif gpus > 0:
        tasks = gpus  # one task per GPU; ranks come from SLURM_PROCID (never torchrun inside srun)
    else:
        tasks = profile.tasks_per_node or 1
    env = {**COMMON_ENV, **(GPU_ENV if gpus > 0 else {}), **profile.env, **spec.env}
    for key, value in env.items():
        if not ENV_KEY_RE.match(key):
            raise ConfigError(f"environment variable name {key!r} is not a valid shell identifier")
        _checked(str(value), f"environment value of {key}")
    # sbatch passes the submitting shell's environment on: rendezvous variables left there by a torchrun or
    # an interactive session would pin every job to one port (jobs sharing a node collide) or to wrong ranks.
    # Ranks and ports come from SLURM_* and the job id; a profile or job that sets them still wins below.
    setup = [f"unset {' '.join(INHERITED_RENDEZVOUS)}"]
    setup += [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()] + list(profile.setup)

    srun_args = []
    if profile.container.image:
        srun_args.append(f"--container-image={profile.container.image}")
        if profile.container.mounts:
            srun_args.append(f"--container-mounts={','.join(profile.container.mounts)}")
        srun_args.append(f"--container-workdir={profile.container.workdir or str(Path.cwd())}")
    srun_args += profile.srun_args

    params: dict[str, Any] = {
        "job_name": spec.name,
        "nodes": spec.nodes,
        "ntasks_per_node": tasks,
        "cpus_per_task": profile.cpus_per_task,
        "time": parse_time_minutes(spec.time or profile.time_limit),
        "signal_delay_s": profile.signal_seconds,
        "setup": setup,
        "srun_args": srun_args,
        "stderr_to_stdout": False,
    }
    if gpus > 0:
        params["gpus_per_node"] = gpus
        if profile.mem_per_gpu_gb:
            params["mem_per_gpu"] = f"{profile.mem_per_gpu_gb}G"
    for key in ("partition", "account", "qos"):
        if getattr(profile, key):
            params[key] = getattr(profile, key)
    exclusive = profile.exclusive if spec.exclusive is None else spec.exclusive
    if exclusive:
        params["exclusive"] = True
    extra: dict[str, Any] = {}
    if spec.dependency:
        params["dependency"] = spec.dependency
        extra["kill-on-invalid-dep"] = "yes"  # a failed parent ends its children instead of leaving them pending
    if extra:
        params["additional_parameters"] = extra
    if spec.array_parallelism:
        params["array_parallelism"] = spec.array_parallelism
    return params


def python_for(profile: ClusterProfile) -> str:
    return profile.python or sys.executable


def logs_dir(spec: JobSpec) -> Path:
    return spec.run_dir / "logs"


def render(profile: ClusterProfile, spec: JobSpec) -> str:
    """The exact sbatch script submitit will submit for this job."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = sbatch_parameters(profile, spec)
    folder = logs_dir(spec).resolve()
    command = " ".join([shlex.quote(python_for(profile)), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    if spec.array_size:
        params["map_count"] = spec.array_size
    return _make_sbatch_string(command=command, folder=folder, **params)


def make_executor(profile: ClusterProfile, spec: JobSpec, max_restarts: int = 3):
    import submitit

    try:
        executor = submitit.SlurmExecutor(
            folder=logs_dir(spec).resolve(), max_num_timeout=max_restarts, python=shlex.quote(python_for(profile))
        )
    except RuntimeError as e:
        raise LaunchError(f"{e} (no srun on PATH: run on a Slurm login node, or `make cluster-up` for the dev cluster)") from None
    executor.update_parameters(**sbatch_parameters(profile, spec))
    return executor


def check_writable(run_root: Path) -> None:
    """Before anything is submitted: the run root (run folders, job registry) can be written, so that a job is
    never submitted and then left out of the registry that status, logs and cancel read."""
    registry = run_root / REGISTRY
    try:
        run_root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_root, prefix=".mcorekit-probe-"):
            pass
        if registry.exists() or registry.is_symlink():
            with open(registry, "a"):
                pass
    except OSError as e:
        where = shown(e.filename or run_root)
        raise LaunchError(f"{where}: cannot write the run root there ({e.strerror}); set run_root in the cluster "
                          f"profile or pass --set run_root=DIR") from None


@contextmanager
def removed_on_error(run_dir: Path) -> Iterator[None]:
    """A run folder that a submission creates is removed again if the submission fails: no half-made runs."""
    existed = run_dir.exists()
    try:
        yield
    except BaseException:
        if not existed:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


@contextmanager
def sbatch_errors(name: str) -> Iterator[None]:
    """submitit raises plain errors carrying sbatch's message: keep its last line, drop the traceback."""
    try:
        yield
    except MCoreKitError:
        raise
    except Exception as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise LaunchError(f"sbatch refused job {name!r}: {lines[-1]}") from None


def scancel(job_ids: list[str]) -> list[str]:
    """Cancel jobs this launcher just submitted (best effort); the ids it cancelled."""
    if not job_ids:
        return []
    proc = subprocess.run(["scancel", *job_ids], capture_output=True, text=True)
    return job_ids if proc.returncode == 0 else []


def record(run_root: Path, **entry: Any) -> None:
    """Append a submitted job to the run root's registry, which `mcorekit status` reads."""
    run_root.mkdir(parents=True, exist_ok=True)
    entry.setdefault("submitted_at", time.strftime("%Y-%m-%dT%H:%M:%S"))
    with open(run_root / REGISTRY, "ab+") as f:
        f.seek(0, 2)
        if f.tell() > 0:
            f.seek(-1, 2)
            torn = f.read(1) != b"\n"  # a line cut short (a killed write): ours must not be glued onto it
        else:
            torn = False
        f.write((b"\n" if torn else b"") + json.dumps(entry).encode() + b"\n")


def submit(profile: ClusterProfile, spec: JobSpec, fn: Callable[..., Any], *args: Any, kind: str = "job",
           max_restarts: int = 3) -> Any:
    """Submit fn(*args) as one job (every task runs it); returns the submitit Job."""
    check_writable(spec.run_dir.parent)
    with removed_on_error(spec.run_dir):
        executor = make_executor(profile, spec, max_restarts)
        with sbatch_errors(spec.name):
            job = executor.submit(fn, *args)
    record(spec.run_dir.parent, job_id=job.job_id, name=spec.name, kind=kind, run_dir=str(spec.run_dir))
    return job
