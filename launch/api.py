"""The launcher's public API: prepare (load + validate), then submit one job, a chain, or a sweep array.

Each launch kind has one function that builds its job(s) (`Prepared.job`, `sweep_job`, `chain_jobs`/`stage_job`,
`smoke_job`, all through `submit.build`); `--dry-run` prints what they build and the submit paths submit it.
Everything is validated before the first sbatch call, so a bad layout or key never leaves a job behind.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from mcorekit.config.cluster import ClusterProfile, load_profile
from mcorekit.config.experiment import Experiment, load_experiment
from mcorekit.config.loading import dump, parse_value, validate
from mcorekit.config.values import plain_argument, shown, text_problem
from mcorekit.errors import ConfigError, LaunchError, LayoutError, ModelError
from mcorekit.hub import HUB_ID_RE, is_hub_id
from mcorekit.launch.plan import check
from mcorekit.launch.submit import (REGISTRY, Built, JobSpec, Run, build, check_writable, cli_command,
                                    literal_env_warnings, next_name, record, run_folder, scancel, submit_one,
                                    train_command)
from mcorekit.models.spec import ModelSpec
from mcorekit.outputs import write_atomic

log = logging.getLogger("mcorekit.launch")


@dataclass
class Prepared:
    experiment: Experiment
    profile: ClusterProfile
    model: ModelSpec
    spec: JobSpec
    warnings: list[str] = field(default_factory=list)
    # a resumed folder whose config.yaml held relative paths: the job reads it, so the submission rewrites it
    config_resolved: bool = False

    def save(self, run_dir: Path | None = None) -> None:
        """Write the resolved experiment and profile into the run folder (default: the spec's), next to logs/, each
        file whole or not at all. A launch writes them into the folder it claimed (see submit.run_folder)."""
        run_dir = run_dir or self.spec.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", dump(self.experiment))
        write_atomic(run_dir / "cluster.yaml", dump(self.profile))

    def move(self, run_dir: Path) -> None:
        """Point the job at another run folder: the one its launch claimed, when the planned name was taken."""
        self.spec.run_dir = run_dir
        self.spec.task_command = train_command(self.profile, run_dir)

    def save_config(self) -> None:
        """Rewrite config.yaml with the resolved experiment, whole or not at all (it is the run's only copy)."""
        write_atomic(self.spec.run_dir / "config.yaml", dump(self.experiment))

    def job(self) -> Built:
        """The training job (built when asked: a caller may still adjust the profile)."""
        return build(self.profile, self.spec)


def new_run_dir(profile: ClusterProfile, name: str) -> Path:
    """The folder planned for a new run, <run_root>/<name>-<stamp>[.N]; nothing is created. The submission claims
    it (submit.claim), and takes the next .N if another launch of the same second took it by then."""
    run_dir = Path(profile.run_root).resolve() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    while run_dir.exists() or run_dir.is_symlink():
        run_dir = next_name(run_dir)
    return run_dir


# The experiment's fields that name files or folders. Each is made absolute against the launching directory before
# config.yaml is written: the job reads it from another working directory (its container's, a later --resume's).
PATH_FIELDS = ("checkpoint.dir", "checkpoint.load", "peft.lora.load", "data.paths", "data.valid_paths",
               "data.cache_dir")
MODEL_DIR_FIELDS = ("model.hf_config", "data.tokenizer")  # there `org/name` with no such folder is a Hub model ID


def absolute(path: str, what: str, base: str | None = None) -> str:
    """`path` absolute against `base` (default: the current directory), `~` expanded (symbolic links kept as named).
    The folder it is read against must be fit for the job's files: one line of UTF-8 text."""
    expanded = os.path.expanduser(path)
    if expanded.startswith("~"):
        raise ConfigError(f"{what} {shown(path)}: a path starts with ~ and a user name this machine does not know")
    result = os.path.normpath(os.path.join(base, expanded)) if base else os.path.abspath(expanded)
    if not text_problem(path) and (problem := text_problem(result)):
        against = (f"the home folder {shown(os.path.expanduser('~'))}" if expanded != path else
                   shown(base) if base else f"the current directory {shown(os.getcwd())}")
        raise ConfigError(f"{what} {shown(path)} is read against {against}, which {problem}; give an absolute path")
    return result


def _each_path(exp: Experiment, change: Callable[[str, str], str], hub_id: Callable[[str], bool]) -> Experiment:
    """The experiment with change(value, field) applied to every path: PATH_FIELDS, MODEL_DIR_FIELDS unless hub_id
    says a Hub model ID, and reward functions given as path/to/file.py:function."""
    data = exp.model_dump()
    for key in PATH_FIELDS + MODEL_DIR_FIELDS:
        *parents, last = key.split(".")
        node = data
        for part in parents:
            node = node.get(part) or {}  # peft.lora unset
        value = node.get(last)
        if isinstance(value, list):
            node[last] = [change(v, key) for v in value]
        elif value is not None and not (key in MODEL_DIR_FIELDS and hub_id(value)):
            node[last] = change(value, key)
    for reward in data["grpo"]["rewards"]:
        where, _, name = reward["function"].rpartition(":")
        if where.endswith(".py") or "/" in where:  # as train/rewards.py tells a file from a module
            reward["function"] = f"{change(where, 'grpo.rewards function')}:{name}"
    return validate(Experiment, data, "the experiment's paths made absolute")  # absolute() says the known cases first


def absolute_paths(exp: Experiment, base: str | None = None) -> Experiment:
    """The experiment with every path field absolute against `base` (default: the current directory)."""
    return _each_path(exp, lambda value, key: absolute(value, key, base), lambda value: is_hub_id(value, base))


def relative_paths(exp: Experiment) -> list[str]:
    """"field 'path'" for each path the experiment holds relative; `org/name` in a model field counts as a Hub model
    ID (by its shape: which folder would make it a path is what is not known yet)."""
    found: list[str] = []

    def note(value: str, key: str) -> str:
        if not (value.startswith("~") or os.path.isabs(value)):
            found.append(f"{key} {value!r}")
        return value

    _each_path(exp, note, lambda value: bool(HUB_ID_RE.fullmatch(value)))
    return found


def prepare(experiment: Experiment, profile: ClusterProfile, run_dir: Path | None = None) -> Prepared:
    experiment = absolute_paths(experiment)
    model, warnings = check(experiment, profile)
    spec = JobSpec(
        name=experiment.name,
        run_dir=run_dir or new_run_dir(profile, experiment.name),
        nodes=experiment.resources.nodes,
        time=experiment.resources.time,
        exclusive=experiment.resources.exclusive,
        max_restarts=experiment.resources.max_restarts,
        # Megatron-FSDP overlaps its collectives on side streams: several CUDA queues, not submit.GPU_ENV's one
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"} if experiment.parallel.fsdp else {},
    )
    spec.task_command = train_command(profile, spec.run_dir)
    return Prepared(experiment, profile, model, spec, warnings + literal_env_warnings(profile))


def _with_nodes(overrides: list[str] | None, nodes: int | None) -> list[str]:
    """--nodes N is the override resources.nodes=N, so it is validated like the file's value."""
    return (overrides or []) + ([f"resources.nodes={nodes}"] if nodes is not None else [])


MAX_JOB_NAME = 64  # config.values.NAME_RE


def check_job_name(config: str | Path, name: str, job_name: str, what: str) -> None:
    """A sweep's or chain's jobs are named after the experiment plus a suffix: too long is said as such, at load."""
    suffix = job_name.removeprefix(name)
    if len(job_name) > MAX_JOB_NAME:
        raise ConfigError(f"{shown(config)}: name {name!r} ({len(name)} characters) is too long for {what}: its jobs "
                          f"are named <name>{suffix}, at most {MAX_JOB_NAME} characters; shorten name to at most "
                          f"{MAX_JOB_NAME - len(suffix)}")


def _naming(config: str | Path, e: ConfigError | ModelError) -> ConfigError | ModelError:
    """The same error, prefixed with the experiment file it came from."""
    return type(e)(f"{shown(config)}: {e}")


def load(config: str | Path, cluster: str | Path = "local", overrides: list[str] | None = None,
         profile_overrides: list[str] | None = None, nodes: int | None = None) -> Prepared:
    experiment = load_experiment(config, _with_nodes(overrides, nodes))
    profile = load_profile(cluster, profile_overrides)
    try:
        return prepare(experiment, profile)
    except (LayoutError, ModelError) as e:
        raise _naming(config, e) from None


def require_gpus(profile: ClusterProfile) -> None:
    """Training is refused on a CPU-only profile, whatever the launch kind (single job, sweep, chain)."""
    if profile.gpus_per_node == 0:
        raise LaunchError(f"training runs on GPUs (Megatron-Core has no CPU forward pass) and profile {profile.name!r} "
                          f"is CPU-only; use a GPU profile, or --dry-run to see the job")


def training_payload(run_dir: Path) -> Callable[[], Any]:
    """The callable every task runs for a training job."""
    from mcorekit.train.job import TrainJob

    return TrainJob(str(run_dir / "config.yaml"), str(run_dir))


class CliPayload:
    """A chain stage that runs one `mcorekit` command on the node (convert, export)."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    def __call__(self) -> int:
        from mcorekit.cli import main
        from mcorekit.caches import use_bytecode_cache

        use_bytecode_cache()  # before the command imports torch (see there)
        code = main(self.argv)
        if code:
            raise RuntimeError(f"mcorekit {' '.join(self.argv)} exited with {code}")
        return code


def cli_payload(argv: list[str]) -> CliPayload:
    """Refuses an unknown command at submission time, not later on the node."""
    from mcorekit.cli import PARTS

    if argv[0] not in PARTS:
        raise ConfigError(f"chain stage `mcorekit {argv[0]}` does not exist; commands: {', '.join(PARTS)}")
    return CliPayload(argv)


def submit_prepared(p: Prepared, payload: Callable[[], Any] | None = None, kind: str = "train") -> Any:
    """Submit a new run: its folder is claimed first (p moves to it if the planned name was taken), then the job
    and its payload are made for that folder."""
    if payload is None:
        require_gpus(p.profile)
    p.job()  # a job the profile cannot build is refused before anything is created
    check_writable(p.spec.run_dir.parent)
    with run_folder(p.spec.run_dir) as run:
        p.move(run.path)
        p.save()
        [job] = run.submit(p.job(), [payload or training_payload(run.path)])
        record(run.path.parent, job_id=job.job_id, name=p.spec.name, kind=kind, run_dir=str(run.path))
    log.info("submitted %s job %s (%s)", kind, job.job_id, run.path)
    return job


# ---------------------------------------------------------------- resume


def _registry_root(run_dir: Path) -> Path:
    """The run root whose jobs.jsonl lists this folder: its parent, or a sweep's parent for a sweep point."""
    for root in (run_dir.parent, run_dir.parent.parent):
        if (root / REGISTRY).is_file():
            return root
    return run_dir.parent


def resume(run_dir: str | Path) -> tuple[Prepared, Path]:
    """A run folder as `mcorekit launch` left it (config.yaml, cluster.yaml), prepared for its next job: the same
    resolved experiment and profile, the same folder and checkpoints (training resumes from the latest one).
    Returns it with the run root whose registry lists the folder."""
    folder = Path(run_dir).expanduser().resolve()
    missing = [f for f in ("config.yaml", "cluster.yaml") if not (folder / f).is_file()]
    if not folder.is_dir() or missing:
        what = "no such folder" if not folder.exists() else "not a folder" if not folder.is_dir() else f"no {' or '.join(missing)} in it"
        raise ConfigError(f"--resume {shown(run_dir)}: not a run folder ({what}); give a folder that `mcorekit launch` "
                          f"printed (it holds config.yaml and cluster.yaml next to logs/)")
    experiment = load_experiment(folder / "config.yaml")
    profile = load_profile(folder / "cluster.yaml")
    root = _registry_root(folder)
    profile = profile.model_copy(update={"run_root": str(root)})
    relative, base, job = relative_paths(experiment), None, None
    if relative:  # a folder from before paths were made absolute at launch: read them where that launch would have
        ids = _jobs_of(folder, root)
        job = ids[0] if ids else None
        if profile.container.image and profile.container.workdir:  # the job ran in the container's workdir
            base = profile.container.workdir
        elif job:  # sbatch runs a job where it was called: an older launcher's relative paths were read there
            from mcorekit.launch.accounting import work_dir

            base = work_dir(job)
        if base is None:
            why = (f"Slurm no longer knows the directory its job {job} was launched from" if job else
                   f"{root / REGISTRY} lists no job of it to ask Slurm where it was launched from")
            raise ConfigError(f"--resume {shown(run_dir)}: {folder / 'config.yaml'} holds relative paths "
                              f"({', '.join(relative)}) from a launcher that did not make them absolute, and {why}, "
                              f"which they were read against; make them absolute in that file, then resume again")
        experiment = absolute_paths(experiment, base)
    try:
        p = prepare(experiment, profile, run_dir=folder)
    except (LayoutError, ModelError) as e:
        raise _naming(folder / "config.yaml", e) from None
    checkpoints = Path(experiment.checkpoint.dir or folder / "checkpoints")
    if (checkpoints / "latest_checkpointed_iteration.txt").is_file():  # the job resumes: its inputs must not change
        from mcorekit.train import run_inputs  # no torch: what the job's start checks, asked before queueing

        try:
            run_inputs.check(experiment, checkpoints, elsewhere=True)
        except ConfigError as e:
            raise ConfigError(f"--resume {shown(run_dir)}: {e}") from None
    if relative:
        p.config_resolved = True
        p.warnings.append(f"{folder / 'config.yaml'}: its relative paths ({', '.join(relative)}) are read against "
                          f"{base}, where job {job} ran (Slurm's WorkDir, or the container's workdir); the submission "
                          f"rewrites config.yaml with them absolute")
    return p, root


def _jobs_of(run_dir: Path, root: Path) -> list[str]:
    """The registry's job ids for this run folder, in submission order: its own, a sweep point's array task, and a
    chain's stages (each in its own folder inside the run folder)."""
    import json

    ids = []
    registry = root / REGISTRY
    for line in registry.read_text(errors="replace").splitlines() if registry.is_file() else []:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("run_dir"), str):
            continue
        if str(run_dir) in (entry["run_dir"], entry.get("point_dir"), str(Path(entry["run_dir"]).parent)):
            ids.append(str(entry.get("job_id")))
    return ids


def still_running(run_dir: Path, root: Path) -> list[str]:
    """'123 RUNNING' for each job of the registry in this run folder that has not ended: a second job would write
    the same checkpoints. A chain records each stage in its own folder inside the run folder (<run>/<name>-train):
    those count too (the later stages read the checkpoints)."""
    from mcorekit.launch.accounting import job_record

    records = [job_record(jid) for jid in _jobs_of(run_dir, root)]  # squeue first: accounting lags a just-submitted job
    return [f"{r.job_id} {r.state}" for r in records if r is not None and not r.final]


def refuse_if_running(p: Prepared, root: Path) -> None:
    if live := still_running(p.spec.run_dir, root):
        raise LaunchError(f"{p.spec.run_dir}: job {', '.join(live)} there has not ended; resuming now would run two "
                          f"jobs on the same checkpoints: wait for it, or `mcorekit cancel` it first")


def submit_resumed(p: Prepared, root: Path, payload: Callable[[], Any] | None = None, kind: str = "train") -> Any:
    """The run folder's next job, recorded in its registry; refused while an earlier job there has not ended."""
    if payload is None:
        require_gpus(p.profile)
    refuse_if_running(p, root)
    return submit_one(p.job(), payload or training_payload(p.spec.run_dir), kind,
                      save=p.save_config if p.config_resolved else None, run_root=root)


def smoke_job(profile: ClusterProfile, nodes: int) -> Built:
    return build(profile, JobSpec(name="mcorekit-smoke", run_dir=new_run_dir(profile, "smoke"), nodes=nodes, time="00:05:00"))


# ---------------------------------------------------------------- chains


@dataclass
class Stage:
    """One job of a chain: its own name, payload, and shape (convert needs no GPUs, training the experiment's nodes)."""

    name: str
    payload: Callable[[], Any]
    gpus_per_node: int | None = None  # None: the profile's; 0: a CPU job
    time: str | None = None
    tasks_per_node: int | None = None  # None: one per GPU
    nodes: int = 1
    exclusive: bool | None = None  # None: the profile's
    max_restarts: int = 3
    env: dict[str, str] = field(default_factory=dict)  # on top of the profile's (training: the experiment's)


def training_stage(p: Prepared) -> Stage:
    """A chain's training stage: the experiment's own job shape and environment, under the stage's name."""
    s = p.spec
    return Stage(f"{p.experiment.name}-train", training_payload(s.run_dir), time=s.time, nodes=s.nodes,
                 exclusive=s.exclusive, max_restarts=s.max_restarts, env=s.env)


def stage_command(profile: ClusterProfile, stage: Stage) -> str | None:
    """The command line a stage's payload amounts to: training, or one `mcorekit` command."""
    from mcorekit.train.job import TrainJob

    if isinstance(stage.payload, CliPayload):
        return cli_command(profile, stage.payload.argv)
    if isinstance(stage.payload, TrainJob):
        return train_command(profile, stage.payload.run_dir)
    return None


def stage_job(profile: ClusterProfile, stage: Stage, run_dir: Path, parent: str | None) -> Built:
    """A stage's job in run_dir/<stage name>; it runs only if job `parent` COMPLETED (afterok)."""
    spec = JobSpec(name=stage.name, run_dir=run_dir / stage.name, nodes=stage.nodes, time=stage.time,
                   exclusive=stage.exclusive, gpus_per_node=stage.gpus_per_node, tasks_per_node=stage.tasks_per_node,
                   max_restarts=stage.max_restarts, env=stage.env, dependency=f"afterok:{parent}" if parent else None,
                   task_command=stage_command(profile, stage))
    return build(profile, spec)


# Before submission a stage's parent has no job id; dry runs show this one (Slurm's ids start at 1).
UNSUBMITTED_PARENT = "0"


def chain_jobs(profile: ClusterProfile, stages: list[Stage], run_dir: Path) -> list[Built]:
    """Every stage's job as a dry run shows it, each after the one before."""
    return [stage_job(profile, s, run_dir, UNSUBMITTED_PARENT if i else None) for i, s in enumerate(stages)]


def submit_chain(profile: ClusterProfile, stages: list[Stage], run_dir: Path, kind: str = "chain",
                 save: Callable[[Path], None] | None = None) -> list[Any]:
    """Submit stages as dependent jobs: each runs only if the previous one COMPLETED (afterok); a failed parent
    makes its children end at once (--kill-on-invalid-dep=yes) instead of pending forever. The run folder is a new
    one, claimed (the stages move with it if the planned name was taken); `save(folder)` writes its files first. A
    failure cancels the stages already queued, and leaves no run folder unless one of them could not be cancelled."""
    chain_jobs(profile, stages, run_dir)  # validates every stage's parameters before the first submission
    check_writable(run_dir.parent)
    jobs: list[Any] = []
    with run_folder(run_dir) as run:
        stages = [_moved(s, run_dir, run.path) for s in stages]
        if save:
            save(run.path)
        for stage in stages:
            built = stage_job(profile, stage, run.path, jobs[-1].job_id if jobs else None)
            try:
                [job] = run.submit(built, [stage.payload])
            except LaunchError as e:  # a half-submitted chain would run its first stages for nothing
                if not jobs:
                    raise
                raise LaunchError(f"{e}; {_cancel(run)}") from None
            record(run.path.parent, job_id=job.job_id, name=stage.name, kind=kind, run_dir=str(built.spec.run_dir),
                   dependency=built.spec.dependency)
            jobs.append(job)
    return jobs


def _moved(stage: Stage, planned: Path, run_dir: Path) -> Stage:
    """The stage in run_dir instead of the planned folder: the paths its payload names there move too (training's
    config and folder, the checkpoints convert reads)."""
    from mcorekit.train.job import TrainJob

    def move(value: str) -> str:
        return str(run_dir / Path(value).relative_to(planned)) if Path(value).is_relative_to(planned) else value

    if planned == run_dir:
        return stage
    if isinstance(stage.payload, TrainJob):
        return replace(stage, payload=TrainJob(move(stage.payload.config_path), move(stage.payload.run_dir),
                                               stage.payload.peak_tflops))
    if isinstance(stage.payload, CliPayload):
        return replace(stage, payload=CliPayload([move(a) for a in stage.payload.argv]))
    return stage


def _cancel(run: Run) -> str:
    """Cancel the run's queued jobs, the last first: which were cancelled, and for the others scancel's error and
    the command to cancel them by hand (they stay in run.jobs: the run folder is kept while they may run)."""
    errors = {job_id: scancel(job_id) for job_id in reversed(run.jobs)}
    cancelled = [j for j in run.jobs if errors[j] is None]
    run.jobs[:] = [j for j in run.jobs if errors[j] is not None]
    said = [f"cancelled the chain's earlier jobs {', '.join(cancelled)}"] if cancelled else []
    if run.jobs:
        said.append(f"could not cancel {', '.join(f'job {j} ({errors[j]})' for j in run.jobs)}: cancel by hand "
                    f"with `scancel {' '.join(run.jobs)}`")
    return "; ".join(said)


# ---------------------------------------------------------------- sweeps


def grid(axes: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """{'optimizer.lr': [1e-4, 3e-4], 'parallel.tp': [1, 2]} -> the 4 points of the grid."""
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]


SWEEP_SUFFIX = "-sweep"  # the array job's name: the experiment's, then this
# One array task per point; Slurm's default MaxArraySize (1001) allows indices 0-1000.
MAX_SWEEP_POINTS = 1000


def parse_axes(items: list[str]) -> dict[str, list[Any]]:
    """['optimizer.lr=1e-4,3e-4'] -> {'optimizer.lr': [0.0001, 0.0003]} (values parsed as YAML)."""
    axes: dict[str, list[Any]] = {}
    raws: dict[str, list[str]] = {}  # as written, for messages
    for item in items:
        if "=" not in item:
            raise ConfigError(f"sweep axis {item!r} is not of the form key.path=v1,v2,...")
        plain_argument(item, "sweep axis")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key in axes:
            raise ConfigError(f"sweep axis {key!r} is given twice; list all its values in one --grid {key}=v1,v2,...")
        raws[key] = _values(raw)
        axes[key] = [parse_value(v, f"sweep axis {key!r}") for v in raws[key]]
    points = 1
    for values in axes.values():
        points *= len(values)
    if points > MAX_SWEEP_POINTS:
        raise ConfigError(f"the grid has {points:,} points; one sweep is one Slurm job array of at most "
                          f"{MAX_SWEEP_POINTS} tasks: use fewer values")
    for key, values in axes.items():  # compared as parsed: 1e-4 and 0.0001 are one value, 0 and false are two
        kinds = [(isinstance(v, bool), v) for v in values]
        for i, value in enumerate(values):
            if (first := kinds.index(kinds[i])) != i:
                raise ConfigError(f"sweep axis {key!r} lists {raws[key][first]!r} and {raws[key][i]!r}, the same "
                                  f"value ({value!r}): the grid would queue identical points; list each value once")
    return axes


def _values(raw: str) -> list[str]:
    """An axis's values: split on the commas outside brackets and quoted strings, so that a value can be a list, a
    mapping or a string holding commas (data.paths=[a,b],[c] is two values, and so is "/a,b","/c"). A quote opens a
    string only where YAML's would: first in a value or after a bracket, comma or ': ' (it's,x is two values)."""
    values: list[str] = []
    depth = start = 0
    quote = None  # the quote character of the string we are in
    i = 0
    while i < len(raw):
        char = raw[i]
        if quote:
            if quote == '"' and char == "\\":
                i += 1  # an escaped character: \" does not close the string
            elif quote == "'" and raw[i:i + 2] == "''":
                i += 1  # '' is a quote inside a single-quoted string
            elif char == quote:
                quote = None
        elif char in "\"'" and (raw[start:i].rstrip()[-1:] in ("", "[", "{", ",")
                                  or raw[start:i].endswith((": ", ":\t"))):
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            values.append(raw[start:i])
            start = i + 1
        i += 1
    return values + [raw[start:]]


def prepare_sweep(config: str | Path, cluster: str | Path, axes: dict[str, list[Any]], overrides: list[str] | None = None,
                  profile_overrides: list[str] | None = None, nodes: int | None = None) -> tuple[list[Prepared], Path]:
    """Resolve and validate every point as a full experiment first (nothing is written or submitted before all
    pass); the points share one array job, so they must share resources."""
    profile = load_profile(cluster, profile_overrides)
    overrides = _with_nodes(overrides, nodes)
    base = load_experiment(config, overrides)
    check_job_name(config, base.name, base.name + SWEEP_SUFFIX, "a sweep")
    sweep_dir = new_run_dir(profile, f"{base.name}{SWEEP_SUFFIX}")
    points = []
    for i, point in enumerate(grid(axes)):
        try:
            exp = load_experiment(config, overrides + [f"{k}={_yaml_value(v)}" for k, v in point.items()])
            points.append(prepare(exp, profile, run_dir=sweep_dir / f"point-{i}"))
        except (ConfigError, ModelError) as e:
            what = str(e).removeprefix(f"{shown(config)}: ")  # load_experiment names the file already
            raise type(e)(f"{shown(config)}: sweep point {i} {point}: {what}") from None
    for p in points:  # a grid over name names the jobs after each point's
        check_job_name(config, p.experiment.name, p.experiment.name + SWEEP_SUFFIX, "a sweep")
    shared: dict[Path, int] = {}
    for i, p in enumerate(points):  # each point resumes from, and prunes, what is in its checkpoint folder
        if p.experiment.checkpoint.dir is None:
            continue  # its own, under its run folder
        folder = Path(p.experiment.checkpoint.dir).expanduser().resolve()
        if folder in shared:
            raise ConfigError(f"{shown(config)}: sweep points {shared[folder]} and {i} share checkpoint.dir {folder}: "
                              f"each would resume from and prune the other's checkpoints; drop checkpoint.dir (each "
                              f"point then keeps its own in its run folder) or make it one of the grid's axes")
        shared[folder] = i
    resources = {(p.spec.nodes, p.spec.time, p.spec.exclusive, p.spec.max_restarts) for p in points}
    if len(resources) > 1:
        raise ConfigError("sweep points differ in resources (nodes/time/exclusive/max_restarts); one array job needs "
                          "the same for all")
    return points, sweep_dir


def _yaml_value(v: Any) -> str:
    import json

    return json.dumps(v)


def sweep_job(points: list[Prepared], sweep_dir: Path, max_parallel: int | None = None) -> Built:
    """One Slurm job array, one task per point, at most max_parallel running at once; the points share their
    resources (prepare_sweep checks), so the array takes the first point's job shape whole.
    A single point is a plain job: submitit submits one payload without an array."""
    if not points:
        raise ConfigError("a sweep needs at least one point")
    first = points[0]
    array = len(points) > 1
    # what every point's environment holds goes to all tasks; the rest (parallel.fsdp's) to its own task only
    shared = {k: v for k, v in first.spec.env.items() if all(p.spec.env.get(k) == v for p in points)}
    task_env = {i: {k: v for k, v in p.spec.env.items() if k not in shared} for i, p in enumerate(points)}
    spec = replace(first.spec, name=first.experiment.name + SWEEP_SUFFIX, run_dir=sweep_dir,
                   array_size=len(points) if array else None, array_parallelism=max_parallel,
                   env=shared if array else first.spec.env, task_env=task_env if array else {},
                   task_command=train_command(first.profile, sweep_dir if array else first.spec.run_dir, sweep=array))
    return build(first.profile, spec)


def submit_sweep(points: list[Prepared], sweep_dir: Path, payloads: list[Callable[[], Any]] | None = None,
                 max_parallel: int | None = None) -> list[Any]:
    """Submit the points as one array in a new folder, claimed: the points move with it if the planned name was
    taken (their spec.run_dir then names the folder, not sweep_dir)."""
    sweep_job(points, sweep_dir, max_parallel)  # validated before anything is created
    if payloads is None:
        for p in points:  # every point, though they share a profile: the rule belongs to each experiment
            require_gpus(p.profile)
    elif len(payloads) != len(points):
        raise ConfigError(f"{len(payloads)} payloads for {len(points)} sweep points")
    check_writable(sweep_dir.parent)
    with run_folder(sweep_dir) as run:
        for p in points:
            p.move(run.path / p.spec.run_dir.name)
            p.save()
        built = sweep_job(points, run.path, max_parallel)
        jobs = run.submit(built, payloads or [training_payload(p.spec.run_dir) for p in points])
        for p, job in zip(points, jobs):
            record(run.path.parent, job_id=job.job_id, name=p.spec.name, kind="sweep", run_dir=str(run.path),
                   point_dir=str(p.spec.run_dir))
    return jobs
