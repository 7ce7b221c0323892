"""The cluster-profile schema: what a Slurm cluster offers (partition, GPUs per node, time limit, container, the
nodes' Python and Transformer Engine) and where runs go. Profiles live in slurm/clusters/<name>.yaml or anywhere
as a path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from mcorekit.config.loading import load
from mcorekit.config.values import ENV_KEY_RE, NAME_RE, Strict, no_control, path_value, shown, slurm_time, text_problem
from mcorekit.errors import ConfigError
from mcorekit.options import MAX_INT

RUN_ROOT_ENV = "MCOREKIT_RUN_ROOT"  # where runs go when a profile names no run_root
PROFILES = Path(__file__).resolve().parent.parent / "slurm" / "clusters"  # mcorekit.slurm's data, next to this part


class ContainerConfig(Strict):
    image: str | None = None  # pyxis/enroot image, e.g. nvcr.io#nvidia/pytorch:25.01-py3
    mounts: list[str] = Field(default_factory=list)  # src:dst[:flags]
    workdir: str | None = None

    @field_validator("image")
    @classmethod
    def _plain(cls, v: str | None) -> str | None:
        return None if v is None else no_control(v, "container setting")

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        return path_value(v, "container workdir")

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for m in v:
            no_control(m, "container mount")
            if "," in m:
                raise ValueError(f"container mount {m!r} contains ',', which pyxis uses to separate mounts")
        return v


H100_BF16_TFLOPS = 989.0  # dense bf16 peak per GPU of an H100/H200 SXM, the default for MFU


class ClusterProfile(Strict):
    name: str
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    # counts are strict (lax mode reads `true` as 1 and `2.0` as 2) and bounded (a huge one went into the script)
    gpus_per_node: int = Field(8, ge=0, le=MAX_INT, strict=True)  # 0: a CPU-only cluster (tests, the dev cluster)
    # only for CPU-only clusters; GPU clusters run one task per GPU
    tasks_per_node: int | None = Field(None, ge=1, le=MAX_INT, strict=True)
    cpus_per_task: int = Field(8, ge=1, le=MAX_INT, strict=True)
    mem_per_gpu_gb: int | None = Field(None, ge=1, le=MAX_INT, strict=True)
    # memory per node of a CPU-only job (a chain's convert and export stages: peak about 3x the largest
    # checkpoint shard); GPU jobs take mem_per_gpu_gb, or the site's default
    cpu_mem_gb: int = Field(32, ge=1, le=MAX_INT, strict=True)
    time_limit: str = "04:00:00"
    exclusive: bool = False
    # USR2 this long before the time limit: enough to save a checkpoint; sbatch's --signal=SIG@TIME takes 16 bits
    signal_seconds: int = Field(120, ge=10, le=2**16 - 1, strict=True)
    gpu_memory_gb: float = Field(80.0, gt=0)
    gpu_peak_tflops_bf16: float = Field(H100_BF16_TFLOPS, gt=0)  # what MFU is measured against
    transformer_engine: bool = True  # FP8 needs it on the nodes
    container: ContainerConfig = Field(default_factory=ContainerConfig)
    env: dict[str, str] = Field(default_factory=dict)
    setup: list[str] = Field(default_factory=list)  # shell lines run before srun (module load, venv activation)
    srun_args: list[str] = Field(default_factory=list)
    python: str | None = None  # the interpreter on the nodes; default: the one running the launcher
    # where run folders (logs, resolved config, checkpoints) and the job registry go; shared by all nodes.
    # None: $MCOREKIT_RUN_ROOT, else the user's state folder (default_run_root); load_profile makes it absolute.
    run_root: str | None = None

    @field_validator("name", "partition", "account", "qos")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        if v is not None and not NAME_RE.fullmatch(v):
            raise ValueError(f"{v!r} must be letters, digits, '.', '_' or '-'")
        return v

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time(cls, v: object) -> object:
        return slurm_time(v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not ENV_KEY_RE.fullmatch(key):
                raise ValueError(f"environment variable name {key!r} is not a valid shell identifier")
        return {k: no_control(str(val), f"environment value of {k}") for k, val in v.items()}

    @field_validator("setup", "srun_args", "python")
    @classmethod
    def _lines(cls, v: Any) -> Any:
        for item in [v] if isinstance(v, str) else (v or []):
            no_control(item, "profile value")
        return v

    @field_validator("run_root")
    @classmethod
    def _run_root(cls, v: str | None) -> str | None:
        return path_value(v, "the run root", f"give a folder, or null for ${RUN_ROOT_ENV} or the default")


def _home_expanded(path: str, what: str) -> Path:
    """Path(path).expanduser(), with a ConfigError naming `what` for ~user of a user this machine does not know."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory." names neither the path nor its source
        raise ConfigError(f"{what} {shown(path)}: a path starts with ~ and a user name this machine does not know; "
                          f"give an absolute path") from None


def default_run_root() -> Path:
    """Where runs go when the profile names no run_root: $MCOREKIT_RUN_ROOT, else $XDG_STATE_HOME/mcorekit/runs,
    else ~/.local/state/mcorekit/runs; absolute, so `mcorekit status` finds the jobs from any directory."""
    if os.environ.get(RUN_ROOT_ENV):
        # relative: to where it was set, i.e. here
        return _home_expanded(os.environ[RUN_ROOT_ENV], f"${RUN_ROOT_ENV}").resolve()
    state = os.environ.get("XDG_STATE_HOME")
    base = Path(state) if state and Path(state).is_absolute() else Path.home() / ".local" / "state"
    return base / "mcorekit" / "runs"


def _absolute_run_root(profile: ClusterProfile, path: Path, overrides: list[str]) -> str:
    """The profile's run root as an absolute path: a relative one is taken from where it was written (the profile
    file's folder; the current directory for --set run_root=...), never from the directory of a later command."""
    if profile.run_root is None:
        return str(default_run_root())
    root = _home_expanded(profile.run_root, "run_root")
    given_here = any(o.split("=", 1)[0].strip() == "run_root" for o in overrides)
    return str((root if root.is_absolute() else (Path.cwd() if given_here else path.parent.resolve()) / root).resolve())


def load_profile(name_or_path: str | Path, overrides: list[str] | None = None) -> ClusterProfile:
    """A profile by path, or by name from slurm/clusters/<name>.yaml; its run_root made absolute."""
    p = Path(name_or_path)
    if not p.suffix and NAME_RE.fullmatch(str(name_or_path)):  # a bare name; anything else is a path
        p = PROFILES / f"{name_or_path}.yaml"
        if not p.is_file():
            known = sorted(q.stem for q in PROFILES.glob("*.yaml"))
            raise ConfigError(f"no cluster profile named {str(name_or_path)!r}; known: {', '.join(known)} (or give a path)")
    if not p.exists():
        raise ConfigError(f"cluster profile not found: {shown(p)} (a profile name from {PROFILES} or a YAML path)")
    profile = load(ClusterProfile, p, overrides)
    root = _absolute_run_root(profile, p, overrides or [])
    if problem := text_problem(root):  # from the current directory, $MCOREKIT_RUN_ROOT or $HOME: never validated
        source = ("run_root" if profile.run_root is not None else f"${RUN_ROOT_ENV}" if os.environ.get(RUN_ROOT_ENV)
                  else "the default under $XDG_STATE_HOME or the home folder")
        raise ConfigError(f"the run root {shown(root)} ({source}) {problem}: it goes into the job's script and "
                          f"files; set run_root in the cluster profile or pass --set run_root=DIR")
    return profile.model_copy(update={"run_root": root})


def gpu_peak_tflops(run_dir: Path) -> float:
    """The per-GPU peak MFU is taken against: the profile's gpu_peak_tflops_bf16 from a launched run folder's
    cluster.yaml (an A100 profile says 312, a B200 one 2250), else an H100/H200's."""
    profile = run_dir / "cluster.yaml"
    return load_profile(profile).gpu_peak_tflops_bf16 if profile.is_file() else H100_BF16_TFLOPS


def world_size(profile: ClusterProfile, nodes: int) -> int:
    """Ranks a job of `nodes` nodes starts: one per GPU, or tasks_per_node on a CPU-only cluster."""
    per_node = profile.gpus_per_node if profile.gpus_per_node > 0 else (profile.tasks_per_node or 1)
    return nodes * per_node
