"""Build and submit sbatch jobs with submitit: srun-native, one task per GPU, values quoted or rejected.

`build()` is the one place a job is made: it gives submitit's executor parameters and the exact script `sbatch`
will receive. `--dry-run` prints that script, the golden tests pin it, and `submit_built()` hands the same
parameters to submitit, so what is shown is what is submitted.
"""

from __future__ import annotations

import errno
import functools
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from mcorekit.config.cluster import ClusterProfile
from mcorekit.config.rules import time_limit_problem
from mcorekit.config.values import ENV_KEY_RE, NAME_RE, no_control, parse_time_minutes, shown, text_problem
from mcorekit.errors import ConfigError, LaunchError, MCoreKitError

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
        return no_control(value, what)
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
    max_restarts: int = 3  # the job's own requeues on the time limit (runtime/requeue; submitit's max_num_timeout)
    env: dict[str, str] = field(default_factory=dict)
    # an array's tasks whose environment differs (a sweep point with parallel.fsdp): task index -> what it adds to env
    task_env: dict[int, dict[str, str]] = field(default_factory=dict)
    # what each task's pickled payload does, as the command line that does the same (shown in the script)
    task_command: str | None = None

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ConfigError(f"job name {self.name!r} must be letters, digits, '.', '_' or '-' (max 64)")
        _checked(str(self.run_dir), "run directory")
        # Slurm expands %j, %A, %x... in --output/--error, and a backslash there turns that off: the logs would go
        # elsewhere than the run folder
        for char, name in (("%", "'%'"), ("\\", "a backslash")):
            if char in str(self.run_dir):
                raise ConfigError(f"run directory {shown(self.run_dir)} contains {name}, which Slurm's log file names "
                                  f"treat specially (%j is the job id; a backslash turns that off); choose a run_root "
                                  f"without '%' or backslashes")
        if self.task_command is not None:
            _checked(self.task_command, "task command")
        for what, value, low in (("nodes", self.nodes, 1), ("array size", self.array_size, 1),
                                 ("array parallelism (--max-parallel)", self.array_parallelism, 1),
                                 ("GPUs per node", self.gpus_per_node, 0), ("tasks per node", self.tasks_per_node, 1),
                                 ("max restarts", self.max_restarts, 0)):
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
    # srun (Slurm >= 22.05) does not inherit sbatch's --cpus-per-task; it reads this (an srun option would do the
    # same, but the GPU machine's srun shim refuses options it does not know)
    cpus = {"SRUN_CPUS_PER_TASK": str(profile.cpus_per_task)}
    env = {**COMMON_ENV, **cpus, **(GPU_ENV if gpus > 0 else {}), **profile.env, **spec.env}
    for key, value in [*env.items(), *(kv for extra in spec.task_env.values() for kv in extra.items())]:
        if not ENV_KEY_RE.match(key):
            raise ConfigError(f"environment variable name {key!r} is not a valid shell identifier")
        _checked(str(value), f"environment value of {key}")
    # sbatch passes the submitting shell's environment on: rendezvous variables left there by a torchrun or
    # an interactive session would pin every job to one port (jobs sharing a node collide) or to wrong ranks.
    # Ranks and ports come from SLURM_* and the job id; a profile or job that sets them still wins below.
    setup = [f"unset {' '.join(INHERITED_RENDEZVOUS)}"]
    setup += [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()] + _task_env_lines(spec.task_env)
    setup += list(profile.setup)
    if spec.task_command:  # srun starts submitit's runner, which unpickles the payload: say what that payload runs
        setup.append(f"# each task runs (as submitit's pickled payload): {spec.task_command}")

    # one task failing ends the others at once: they would otherwise wait in their next collective for NCCL's
    # timeout (minutes of the allocation) before the job reports the one error line that says what went wrong
    srun_args = ["--kill-on-bad-exit=1"]
    if profile.container.image:
        srun_args.append(f"--container-image={profile.container.image}")
        if profile.container.mounts:
            srun_args.append(f"--container-mounts={','.join(profile.container.mounts)}")
        workdir = profile.container.workdir or str(Path.cwd())
        if problem := text_problem(workdir):  # the current directory's name, which no schema checked
            raise ConfigError(f"the container's workdir is the current directory {shown(workdir)}, which {problem}; "
                              f"set container.workdir in the cluster profile, or launch from another directory")
        srun_args.append(f"--container-workdir={workdir}")
    srun_args += profile.srun_args

    limit = spec.time or profile.time_limit
    if problem := time_limit_problem(limit, profile.signal_seconds):  # every job's, as config.rules a training job's
        raise ConfigError(f"job {spec.name!r}: {problem}: lower signal_seconds={profile.signal_seconds} below "
                          f"{parse_time_minutes(limit) * 60 - 60} (--set signal_seconds=N) or raise the time limit")
    params: dict[str, Any] = {
        "job_name": spec.name,
        "nodes": spec.nodes,
        "ntasks_per_node": tasks,
        "cpus_per_task": profile.cpus_per_task,
        "time": parse_time_minutes(limit),
        "signal_delay_s": profile.signal_seconds,
        "setup": setup,
        "srun_args": srun_args,
        "stderr_to_stdout": False,
    }
    if gpus > 0:
        params["gpus_per_node"] = gpus
        if profile.mem_per_gpu_gb:
            params["mem_per_gpu"] = f"{profile.mem_per_gpu_gb}G"
    cpu_job = spec.gpus_per_node == 0  # a CPU job on the cluster (a chain's convert, export): no whole GPU node
    if cpu_job:
        params["mem"] = f"{profile.cpu_mem_gb}G"
    for key in ("partition", "account", "qos"):
        if getattr(profile, key):
            params[key] = getattr(profile, key)
    exclusive = (profile.exclusive and not cpu_job) if spec.exclusive is None else spec.exclusive
    if exclusive:
        params["exclusive"] = True
    # eligible for requeue whatever the site's JobRequeue default: the time-limit requeue (`scontrol requeue` is
    # refused for a job that is not), and Slurm's own requeue after preemption or a node failure
    extra: dict[str, Any] = {"requeue": True}
    if spec.dependency:
        params["dependency"] = spec.dependency
        extra["kill-on-invalid-dep"] = "yes"  # a failed parent ends its children instead of leaving them pending
    params["additional_parameters"] = extra
    if spec.array_parallelism:
        params["array_parallelism"] = spec.array_parallelism
    return params


def _task_env_lines(task_env: dict[int, dict[str, str]]) -> list[str]:
    """One sbatch script serves every task of an array: the tasks whose environment differs get it from a `case` on
    the task's index (tasks with the same additions share one branch)."""
    branches: dict[str, list[int]] = {}
    for task, extra in sorted(task_env.items()):
        if extra:
            exports = "; ".join(f"export {k}={shlex.quote(str(v))}" for k, v in extra.items())
            branches.setdefault(exports, []).append(task)
    if not branches:
        return []
    return (['case "$SLURM_ARRAY_TASK_ID" in  # array tasks whose environment differs'] +
            [f"  {'|'.join(map(str, tasks))}) {exports} ;;" for exports, tasks in branches.items()] + ["esac"])


def literal_env_warnings(profile: ClusterProfile) -> list[str]:
    """Profile env values reach the job quoted, as written: a `$` there is no expansion, which is what setup: is for."""
    return [f"cluster profile env {k}={v} is exported literally (values are quoted, so {v!r} stays as written); "
            f"for shell expansion use a setup: line, e.g. `export {k}=\"...\"`"
            for k, v in profile.env.items() if "$" in v]


def python_for(profile: ClusterProfile) -> str:
    return profile.python or sys.executable


def train_command(profile: ClusterProfile, run_dir: Path | str, sweep: bool = False) -> str:
    """The command line a training task's payload (train/job.py: TrainJob) amounts to; for a sweep, run_dir is the
    sweep's folder and each array task trains its own point-N."""
    run = shlex.quote(str(run_dir)) + ("/point-$SLURM_ARRAY_TASK_ID" if sweep else "")
    return f"{shlex.quote(python_for(profile))} -m mcorekit.train --config {run}/config.yaml --run-dir {run}"


def cli_command(profile: ClusterProfile, argv: list[str]) -> str:
    """The command line of a chain stage that runs one `mcorekit` command."""
    return shlex.join([python_for(profile), "-m", "mcorekit", *argv])


def logs_dir(spec: JobSpec) -> Path:
    return spec.run_dir / "logs"


@dataclass(frozen=True)
class Built:
    """One job exactly as it will be submitted: submitit's executor settings and the script sbatch receives."""

    spec: JobSpec
    python: str  # shell-quoted interpreter on the nodes
    params: dict[str, Any]  # SlurmExecutor.update_parameters(**params)
    script: str


def build(profile: ClusterProfile, spec: JobSpec) -> Built:
    """The job builder: dry runs print `.script`, submissions hand `.params` to submitit, which renders the same."""
    return _rendered(spec, shlex.quote(python_for(profile)), sbatch_parameters(profile, spec))


def _rendered(spec: JobSpec, python: str, params: dict[str, Any]) -> Built:
    from submitit.slurm.slurm import _make_sbatch_string

    folder = logs_dir(spec).resolve()
    # submitit's own command line (SlurmExecutor._submitit_command_str) and, for arrays, its map_count
    command = " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])
    array = {"map_count": spec.array_size} if spec.array_size else {}
    return Built(spec, python, params, _make_sbatch_string(command=command, folder=folder, **params, **array))


def render(profile: ClusterProfile, spec: JobSpec) -> str:
    """The exact sbatch script submitit will submit for this job."""
    return build(profile, spec).script


def make_executor(job: Built):
    import submitit

    try:
        executor = submitit.SlurmExecutor(folder=logs_dir(job.spec).resolve(), max_num_timeout=job.spec.max_restarts,
                                          python=job.python)
    except RuntimeError as e:
        raise LaunchError(f"{e} (no srun on PATH: run on a Slurm login node, or `make cluster-up` for the dev cluster)") from None
    executor.update_parameters(**job.params)
    return executor


def check_writable(run_root: Path, dry_run: bool = False) -> None:
    """Before anything is submitted: the run root (run folders, job registry) can be written, so that a job is
    never submitted and then left out of the registry that status, logs and cancel read. A dry run creates nothing:
    it asks the nearest existing folder (and the registry, if there is one)."""
    registry = run_root / REGISTRY
    try:
        if dry_run:
            _writable_as_is(run_root)
            return
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


def _writable_as_is(run_root: Path) -> None:
    """OSError (as mkdir or open would raise it) where run_root or its registry could not be written."""
    def refused(code: int) -> OSError:
        return OSError(code, os.strerror(code), str(run_root))

    folder = run_root
    while not (folder.exists() or folder.is_symlink()) and folder != folder.parent:
        folder = folder.parent  # what mkdir(parents=True) would create inside
    if not folder.is_dir():
        raise refused(errno.ENOTDIR)
    for path in (folder, run_root / REGISTRY):
        if path.exists() and not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
            raise refused(errno.EROFS if os.statvfs(path).f_flag & os.ST_RDONLY else errno.EACCES)


def next_name(run_dir: Path) -> Path:
    """The next name for a new run folder whose name is taken: NAME -> NAME.1 -> NAME.2 ..."""
    base, dot, n = run_dir.name.rpartition(".")
    return run_dir.with_name(f"{base}.{int(n) + 1}" if dot and n.isdigit() else f"{run_dir.name}.1")


def claim(run_dir: Path) -> Path:
    """Create a new run's folder: run_dir, or the next free name if another launch took it since it was planned
    (launches of the same second plan the same name). mkdir either creates the folder or fails, so no two
    launches ever get the same one."""
    while True:
        try:
            os.mkdir(run_dir)
            return run_dir
        except FileExistsError:
            run_dir = next_name(run_dir)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a submission, raised as Ctrl-C's KeyboardInterrupt is: the same cleanup runs."""


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Interrupted instead of ending the process at once. Only signals left at their
    default: an ignored SIGHUP (nohup) stays ignored, and a handler someone installed stays theirs."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    ours = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) == signal.SIG_DFL]
    for s in ours:
        signal.signal(s, interrupt)
    try:
        yield
    finally:
        for s in ours:
            signal.signal(s, signal.SIG_DFL)


@dataclass
class Run:
    """A submission's run folder and the jobs that may read it: it is removed on failure only if none may."""

    path: Path
    jobs: list[str] = field(default_factory=list)  # submitted and not cancelled
    in_sbatch: str | None = None  # the job whose sbatch has not answered: it may be queued

    def submit(self, job: Built, payloads: list[Callable[[], Any]]) -> list[Any]:
        self.in_sbatch = job.spec.name
        try:
            submitted = submit_built(job, payloads)
        except Exception:
            self.in_sbatch = None  # sbatch answered (refused), or was never called: nothing was queued
            raise
        self.jobs += [j.job_id for j in submitted]
        self.in_sbatch = None
        return submitted


@contextmanager
def run_folder(run_dir: Path, new: bool = True) -> Iterator[Run]:
    """The folder a submission writes: a new run's is claimed (see claim: its path may differ from run_dir); an
    existing one (a resumed run) is used as it is. SIGTERM and SIGHUP raise inside (see Interrupted). If the
    submission fails, a folder it created is removed again, unless a job that reads it may be queued: one
    submitted and not cancelled, or one whose sbatch was interrupted. That folder is kept, and said so."""
    created = new or not (run_dir.exists() or run_dir.is_symlink())
    with _signals_raise():
        run = Run(claim(run_dir) if new else run_dir)
        try:
            run.path.mkdir(parents=True, exist_ok=True)
            yield run
        except BaseException:
            if run.jobs or run.in_sbatch:
                queued = [f"job {j}" for j in run.jobs]
                if run.in_sbatch:
                    queued.append(f"job {run.in_sbatch!r} (its sbatch was interrupted)")
                print(f"mcorekit: warning: kept the run folder {run.path}: {', '.join(queued)} may be queued and "
                      f"reads it; check `squeue --me` (or `mcorekit status`), and remove the folder only once no "
                      f"job of it is queued", file=sys.stderr)
            elif created:
                shutil.rmtree(run.path, ignore_errors=True)
            raise


@contextmanager
def sbatch_errors(name: str) -> Iterator[None]:
    """submitit prints sbatch's stderr, then raises an error carrying it: keep its last line, once, and no traceback."""
    printed = io.StringIO()
    try:
        with redirect_stderr(printed):
            yield
    except MCoreKitError:
        raise
    except Exception as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise LaunchError(f"sbatch refused job {name!r}: {lines[-1]}") from None
    sys.stderr.write(printed.getvalue())  # a submission that went through keeps its warnings


def scancel(job_id: str) -> str | None:
    """Cancel a job this launcher just submitted: None once cancelled, else why not (scancel's last line)."""
    try:
        proc = subprocess.run(["scancel", job_id], capture_output=True, text=True)
    except OSError as e:
        return f"scancel: {e.strerror}"
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"scancel exited with {proc.returncode}"


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


def submit_built(job: Built, payloads: list[Callable[[], Any]]) -> list[Any]:
    """sbatch `job` once: one payload is one job, several are one array of len(payloads) tasks (the count the
    builder was given: submitit writes the array size into the script). sbatch's refusals are one LaunchError line."""
    if len(payloads) != (job.spec.array_size or 1):
        raise ValueError(f"{len(payloads)} payloads for job {job.spec.name!r} built for {job.spec.array_size or 1}")
    executor = make_executor(job)
    with sbatch_errors(job.spec.name), _without_env(overriding_env(job.params, job.spec.array_size)):
        if len(payloads) == 1:
            return [executor.submit(payloads[0])]
        with executor.batch():
            submitted = [executor.submit(fn) for fn in payloads]
    return submitted


# sbatch's input environment variables for the options the script sets: sbatch takes them over the script's #SBATCH
# lines (`man sbatch`: command line, then environment, then script), so a user's shell would change the job unseen
ALWAYS_SET = ("SBATCH_JOB_NAME", "SBATCH_TIMELIMIT", "SBATCH_SIGNAL", "SBATCH_OUTPUT", "SBATCH_ERROR",
              "SBATCH_OPEN_MODE", "SBATCH_REQUEUE", "SBATCH_NO_REQUEUE")
SET_IF = {"partition": "SBATCH_PARTITION", "account": "SBATCH_ACCOUNT", "qos": "SBATCH_QOS",
          "exclusive": "SBATCH_EXCLUSIVE", "gpus_per_node": "SBATCH_GPUS_PER_NODE", "mem_per_gpu": "SBATCH_MEM_PER_GPU",
          "mem": "SBATCH_MEM_PER_NODE"}


def overriding_env(params: dict[str, Any], array_size: int | None) -> list[str]:
    """The SBATCH_* variables of this environment that would override an option of this job's script."""
    names = [*ALWAYS_SET, *(env for key, env in SET_IF.items() if key in params)]
    names += ["SBATCH_ARRAY_INX"] if array_size else []
    return [n for n in names if n in os.environ]


@contextmanager
def _without_env(names: list[str]) -> Iterator[None]:
    """sbatch without `names` in its environment, said in one warning line; they are put back afterwards. The
    registry, status, logs and cancel know a job by the name and log files its script gives it."""
    if names:
        print(f"mcorekit: warning: {', '.join(names)} in this environment would override the job script's own "
              f"settings: left out of sbatch's environment", file=sys.stderr)
    saved = {n: os.environ.pop(n) for n in names}
    try:
        yield
    finally:
        os.environ.update(saved)


def submit_one(job: Built, payload: Callable[[], Any], kind: str, save: Callable[[], None] | None = None,
               run_root: Path | None = None) -> Any:
    """Submit a single job and record it in run_root's registry; `save` writes the run folder's files first.
    Without run_root the folder is a new run's: it is claimed, and the job moves if its planned name was taken (see
    moved); the registry is the folder's parent's. With run_root the folder is used as it is (a resumed run, or one
    the caller chose). A failure leaves no folder it created, unless the job may be queued (see run_folder)."""
    new = run_root is None
    run_root = run_root or job.spec.run_dir.parent
    check_writable(run_root)
    with run_folder(job.spec.run_dir, new) as run:
        if run.path != job.spec.run_dir:
            job = moved(job, run.path)
        if save:
            save()
        [submitted] = run.submit(job, [payload])
        record(run_root, job_id=submitted.job_id, name=job.spec.name, kind=kind, run_dir=str(run.path))
    return submitted


def moved(job: Built, run_dir: Path) -> Built:
    """The job in another run folder (the planned one was taken). Its spec moves in place, so that whoever holds it
    shows where the job went. Not for a job whose task names its folder: its payload would name the planned one."""
    if job.spec.task_command:
        raise ValueError(f"job {job.spec.name!r} names its run folder; claim the folder before building the job")
    job.spec.run_dir = run_dir
    return _rendered(job.spec, job.python, job.params)


def submit(profile: ClusterProfile, spec: JobSpec, fn: Callable[..., Any], *args: Any, kind: str = "job") -> Any:
    """Submit fn(*args) as one job (every task runs it) in spec's run folder as given; returns the submitit Job."""
    return submit_one(build(profile, spec), functools.partial(fn, *args) if args else fn, kind,
                      run_root=spec.run_dir.parent)
