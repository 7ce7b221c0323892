"""The launcher's public API: prepare (load + validate), then submit one job, a chain, or a sweep array.

Everything is validated before the first sbatch call, so a bad layout or key never leaves a job behind.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mcorekit.errors import ConfigError, LaunchError, LayoutError, ModelError, NotBuiltError
from mcorekit.launch import config as cfg
from mcorekit.launch import layout
from mcorekit.launch.submit import (JobSpec, check_writable, make_executor, record, removed_on_error, render, sbatch_errors,
                                    scancel)
from mcorekit.models.spec import ModelSpec

log = logging.getLogger("mcorekit.launch")


@dataclass
class Prepared:
    experiment: cfg.Experiment
    profile: cfg.ClusterProfile
    model: ModelSpec
    spec: JobSpec
    warnings: list[str] = field(default_factory=list)

    def save(self) -> None:
        """Write the resolved experiment and profile into the run directory, next to logs/."""
        self.spec.run_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.run_dir / "config.yaml").write_text(cfg.dump(self.experiment))
        (self.spec.run_dir / "cluster.yaml").write_text(cfg.dump(self.profile))

    def script(self) -> str:
        return render(self.profile, self.spec)


def new_run_dir(profile: cfg.ClusterProfile, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(profile.run_root).resolve() / f"{name}-{stamp}"
    run_dir, n = base, 1
    while run_dir.exists():  # two launches in the same second get distinct folders
        run_dir, n = base.with_name(f"{base.name}.{n}"), n + 1
    return run_dir


def prepare(experiment: cfg.Experiment, profile: cfg.ClusterProfile, run_dir: Path | None = None) -> Prepared:
    model, warnings = layout.check(experiment, profile)
    spec = JobSpec(
        name=experiment.name,
        run_dir=run_dir or new_run_dir(profile, experiment.name),
        nodes=experiment.resources.nodes,
        time=experiment.resources.time,
        exclusive=experiment.resources.exclusive,
    )
    return Prepared(experiment, profile, model, spec, warnings)


def _with_nodes(overrides: list[str] | None, nodes: int | None) -> list[str]:
    """--nodes N is the override resources.nodes=N, so it is validated like the file's value."""
    return (overrides or []) + ([f"resources.nodes={nodes}"] if nodes is not None else [])


def _naming(config: str | Path, e: ConfigError | ModelError) -> ConfigError | ModelError:
    """The same error, prefixed with the experiment file it came from."""
    return type(e)(f"{cfg.shown(config)}: {e}")


def load(config: str | Path, cluster: str | Path = "local", overrides: list[str] | None = None,
         profile_overrides: list[str] | None = None, nodes: int | None = None) -> Prepared:
    experiment = cfg.load_experiment(config, _with_nodes(overrides, nodes))
    profile = cfg.load_profile(cluster, profile_overrides)
    try:
        return prepare(experiment, profile)
    except (LayoutError, ModelError) as e:
        raise _naming(config, e) from None


def require_gpus(profile: cfg.ClusterProfile) -> None:
    """Training is refused on a CPU-only profile, whatever the launch kind (single job, sweep, chain)."""
    if profile.gpus_per_node == 0:
        raise LaunchError(f"training runs on GPUs (Megatron-Core has no CPU forward pass) and profile {profile.name!r} "
                          f"is CPU-only; use a GPU profile, or --dry-run to see the job")


def training_payload(run_dir: Path) -> Callable[[], Any]:
    """The callable every task runs for a training job; refuses to submit while train/ is missing."""
    try:
        from mcorekit.train.job import TrainJob
    except ImportError:
        raise NotBuiltError(
            "training jobs need train/ (mcorekit.train.job), which is not built yet; `--dry-run` shows the job that would be submitted"
        ) from None
    return TrainJob(str(run_dir / "config.yaml"), str(run_dir))


class CliPayload:
    """A chain stage that runs one `mcorekit` command on the node (convert, export)."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    def __call__(self) -> int:
        from mcorekit.cli import main

        code = main(self.argv)
        if code:
            raise RuntimeError(f"mcorekit {' '.join(self.argv)} exited with {code}")
        return code


def cli_payload(argv: list[str]) -> CliPayload:
    """Refuses an unknown command at submission time, not later on the node."""
    from mcorekit.cli import PARTS

    if argv[0] not in PARTS:
        raise NotBuiltError(f"chain stage `mcorekit {argv[0]}` does not exist; commands: {', '.join(PARTS)}")
    return CliPayload(argv)


def submit_prepared(p: Prepared, payload: Callable[[], Any] | None = None, kind: str = "train") -> Any:
    if payload is None:
        require_gpus(p.profile)
    payload = payload or training_payload(p.spec.run_dir)
    check_writable(p.spec.run_dir.parent)
    with removed_on_error(p.spec.run_dir):
        p.save()
        executor = make_executor(p.profile, p.spec, max_restarts=p.experiment.resources.max_restarts)
        with sbatch_errors(p.spec.name):
            job = executor.submit(payload)
    record(p.spec.run_dir.parent, job_id=job.job_id, name=p.spec.name, kind=kind, run_dir=str(p.spec.run_dir))
    log.info("submitted %s job %s (%s)", kind, job.job_id, p.spec.run_dir)
    return job


# ---------------------------------------------------------------- chains


@dataclass
class Stage:
    """One job of a chain: its own name, payload, and whether it needs GPUs (convert does not)."""

    name: str
    payload: Callable[[], Any]
    gpus_per_node: int | None = None  # None: the profile's; 0: a CPU job
    time: str | None = None
    tasks_per_node: int | None = None  # None: one per GPU


def submit_chain(profile: cfg.ClusterProfile, stages: list[Stage], run_dir: Path, kind: str = "chain") -> list[Any]:
    """Submit stages as dependent jobs: each runs only if the previous one COMPLETED (afterok); a failed parent
    makes its children end at once (--kill-on-invalid-dep=yes) instead of pending forever."""
    specs = [JobSpec(name=s.name, run_dir=run_dir / s.name, time=s.time, gpus_per_node=s.gpus_per_node,
                     tasks_per_node=s.tasks_per_node) for s in stages]
    for s in specs:
        render(profile, s)  # validates every stage's parameters before the first submission
    check_writable(run_dir.parent)
    jobs: list[Any] = []
    for stage, spec in zip(stages, specs):
        if jobs:
            spec.dependency = f"afterok:{jobs[-1].job_id}"
        try:
            executor = make_executor(profile, spec)
            with sbatch_errors(spec.name):
                job = executor.submit(stage.payload)
        except LaunchError as e:  # a half-submitted chain would run its first stages for nothing
            if not jobs:
                raise
            cancelled = scancel([j.job_id for j in jobs])
            raise LaunchError(f"{e}; cancelled the chain's earlier jobs {', '.join(cancelled)}") from None
        record(run_dir.parent, job_id=job.job_id, name=spec.name, kind=kind, run_dir=str(spec.run_dir),
               dependency=spec.dependency)
        jobs.append(job)
    return jobs


# ---------------------------------------------------------------- sweeps


def grid(axes: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """{'optimizer.lr': [1e-4, 3e-4], 'parallel.tp': [1, 2]} -> the 4 points of the grid."""
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]


# One array task per point; Slurm's default MaxArraySize (1001) allows indices 0-1000.
MAX_SWEEP_POINTS = 1000


def parse_axes(items: list[str]) -> dict[str, list[Any]]:
    """['optimizer.lr=1e-4,3e-4'] -> {'optimizer.lr': [0.0001, 0.0003]} (values parsed as YAML)."""
    axes: dict[str, list[Any]] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"sweep axis {item!r} is not of the form key.path=v1,v2,...")
        if cfg.CONTROL_RE.search(item):
            raise ConfigError(f"sweep axis {item!r} contains a newline or control character; remove it")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key in axes:
            raise ConfigError(f"sweep axis {key!r} is given twice; list all its values in one --grid {key}=v1,v2,...")
        axes[key] = [cfg.parse_value(v, f"sweep axis {key!r}") for v in raw.split(",")]
    points = 1
    for values in axes.values():
        points *= len(values)
    if points > MAX_SWEEP_POINTS:
        raise ConfigError(f"the grid has {points:,} points; one sweep is one Slurm job array of at most "
                          f"{MAX_SWEEP_POINTS} tasks: use fewer values")
    return axes


def prepare_sweep(config: str | Path, cluster: str | Path, axes: dict[str, list[Any]], overrides: list[str] | None = None,
                  profile_overrides: list[str] | None = None, nodes: int | None = None) -> tuple[list[Prepared], Path]:
    """Resolve and validate every point as a full experiment first (nothing is written or submitted before all
    pass); the points share one array job, so they must share resources."""
    profile = cfg.load_profile(cluster, profile_overrides)
    overrides = _with_nodes(overrides, nodes)
    base = cfg.load_experiment(config, overrides)
    sweep_dir = new_run_dir(profile, f"{base.name}-sweep")
    points = []
    for i, point in enumerate(grid(axes)):
        try:
            exp = cfg.load_experiment(config, overrides + [f"{k}={_yaml_value(v)}" for k, v in point.items()])
            points.append(prepare(exp, profile, run_dir=sweep_dir / f"point-{i}"))
        except (ConfigError, ModelError) as e:
            what = str(e).removeprefix(f"{cfg.shown(config)}: ")  # load_experiment names the file already
            raise type(e)(f"{cfg.shown(config)}: sweep point {i} {point}: {what}") from None
    resources = {(p.spec.nodes, p.spec.time, p.spec.exclusive) for p in points}
    if len(resources) > 1:
        raise ConfigError("sweep points differ in resources (nodes/time/exclusive); one array job needs the same for all")
    return points, sweep_dir


def _yaml_value(v: Any) -> str:
    import json

    return json.dumps(v)


def submit_sweep(points: list[Prepared], sweep_dir: Path, payloads: list[Callable[[], Any]] | None = None,
                 max_parallel: int | None = None) -> list[Any]:
    """One Slurm job array, one task per point, at most max_parallel running at once."""
    if not points:
        raise ConfigError("a sweep needs at least one point")
    if payloads is None:
        for p in points:  # every point, though they share a profile: the rule belongs to each experiment
            require_gpus(p.profile)
        payloads = [training_payload(p.spec.run_dir) for p in points]
    if len(payloads) != len(points):
        raise ConfigError(f"{len(payloads)} payloads for {len(points)} sweep points")
    first = points[0]
    spec = JobSpec(name=first.experiment.name + "-sweep", run_dir=sweep_dir, nodes=first.spec.nodes,
                   time=first.spec.time, exclusive=first.spec.exclusive, array_parallelism=max_parallel)
    check_writable(sweep_dir.parent)
    with removed_on_error(sweep_dir):
        for p in points:
            p.save()
        executor = make_executor(first.profile, spec, max_restarts=first.experiment.resources.max_restarts)
        with sbatch_errors(spec.name), executor.batch():
            jobs = [executor.submit(fn) for fn in payloads]
    for p, job in zip(points, jobs):
        record(sweep_dir.parent, job_id=job.job_id, name=p.spec.name, kind="sweep", run_dir=str(sweep_dir),
               point_dir=str(p.spec.run_dir))
    return jobs
