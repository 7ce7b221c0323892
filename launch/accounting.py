"""What Slurm knows about a job: sacct when accounting exists, squeue/scontrol otherwise."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from dataclasses import dataclass, replace

from mcorekit.errors import LaunchError

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    name: str
    state: str  # first word of Slurm's state, e.g. "CANCELLED" for "CANCELLED by 0"
    exit_code: str  # "code:signal"
    elapsed: str
    restarts: int

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


def _run(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        raise LaunchError(f"`{cmd[0]}` not found: run on a Slurm login node, or `make cluster-up` for the dev cluster")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LaunchError(f"`{' '.join(cmd)}` failed: {_printed(proc)}")
    return proc.stdout


def _printed(proc: subprocess.CompletedProcess[str]) -> str:
    """What a Slurm command printed when it failed, as one line (sacct and squeue print several)."""
    return " ".join((proc.stderr.strip() or proc.stdout.strip()).split())


def sacct(job_ids: list[str]) -> dict[str, JobRecord]:
    """Allocation-level records (no steps) keyed by job id; array tasks appear as ID_N. Without accounting
    (sacct fails), falls back to squeue, which knows only jobs still in the controller's memory."""
    if not job_ids:
        return {}
    try:
        return _sacct(job_ids)
    except LaunchError as e:
        if "accounting" not in str(e).lower() and "slurmdbd" not in str(e).lower():
            raise
        return _squeue(job_ids)


def _squeue(job_ids: list[str]) -> dict[str, JobRecord]:
    out = _run(["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%j|%T|%M|%R"])
    records = {}
    for line in out.splitlines():
        jid, name, state, elapsed, _ = (line.split("|") + [""] * 5)[:5]
        records[jid] = JobRecord(jid, name, state, "", elapsed, 0)
    return records


def _sacct(job_ids: list[str]) -> dict[str, JobRecord]:
    out = _run(["sacct", "-n", "-P", "-X", "-D", "-j", ",".join(job_ids),
                "-o", "JobID,JobName,State,ExitCode,Elapsed,Submit"])
    lines: dict[str, list[list[str]]] = {}
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) >= 5:
            lines.setdefault(parts[0], []).append((parts + [""])[:6])
    records: dict[str, JobRecord] = {}
    for jid, seen in lines.items():
        # -D lists every incarnation of the id: a requeued job's earlier runs (restarts), and on a cluster whose job
        # ids started again, earlier jobs that had the id, in no order we can rely on. The current one was submitted
        # last (the later line on a tie); the restarts are the other lines of its name.
        now = max(range(len(seen)), key=lambda i: (_submitted(seen[i][5]), i))
        _, name, state, exit_code, elapsed, _ = seen[now]
        restarts = sum(1 for i, other in enumerate(seen) if i != now and other[1] == name)
        records[jid] = JobRecord(jid, name, state.split()[0] if state else "UNKNOWN", exit_code, elapsed, restarts)
    return records


def _submitted(value: str) -> str:
    """sacct's Submit time (ISO 8601, which sorts as text); what is not one (Unknown, None) sorts first."""
    return value if value[:1].isdigit() else ""


def in_array_range(task_id: str, listed: str) -> bool:
    """Whether task BASE_N is one of the tasks of a pending-array line such as BASE_[0-3,7] or BASE_[2-9%2]."""
    base, _, index = task_id.partition("_")
    m = re.fullmatch(rf"{re.escape(base)}_\[([0-9,\-]+)(?:%\d+)?\]", listed)
    if not index.isdigit() or m is None:
        return False
    n = int(index)
    for part in m.group(1).split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (high or low).isdigit() and int(low) <= n <= int(high or low):
            return True
    return False


def record_for(records: dict[str, JobRecord], job_id: str) -> JobRecord | None:
    """Job or array task `job_id` among sacct's records: its own line, else the pending-array line (BASE_[a-b])
    that holds it, as that task."""
    if job_id in records:
        return records[job_id]
    return next((replace(r, job_id=job_id) for k, r in records.items() if in_array_range(job_id, k)), None)


def _squeue_one(job_id: str) -> JobRecord | None:
    """The controller's view (pending, running, and recently ended jobs); None if it does not know the id."""
    if shutil.which("squeue") is None:
        raise LaunchError("`squeue` not found: run on a Slurm login node, or `make cluster-up` for the dev cluster")
    proc = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i|%j|%T|%M"], capture_output=True, text=True)
    if proc.returncode != 0:
        if "invalid job id" in proc.stderr.lower():  # an id the controller does not know (any more)
            return None
        raise LaunchError(f"`squeue` failed: {_printed(proc)}; is the Slurm controller up (`sinfo`)?")
    for line in proc.stdout.splitlines():
        jid, name, state, elapsed = (line.split("|") + [""] * 4)[:4]
        if jid == job_id or in_array_range(job_id, jid):
            return JobRecord(job_id, name, state or "UNKNOWN", "", elapsed, 0)
    return None


def job_record(job_id: str) -> JobRecord | None:
    """One job or array task (ID or ID_N) as Slurm knows it now, or None when Slurm knows no such job or task.
    squeue answers for live jobs (sacct lags by a second or two, and lists a pending array only as ID_[a-b]);
    sacct for ended ones, with their exit code."""
    try:
        live, squeue_failed = _squeue_one(job_id), None
    except LaunchError as e:  # the controller busy or restarting: accounting may still answer
        live, squeue_failed = None, e
    if live is not None and not live.final:
        return live
    try:
        ended = sacct([job_id]).get(job_id)
        if ended is None and "_" in job_id:  # an array cancelled while pending: only ID_[a-b] is recorded
            ended = record_for(sacct([job_id.split("_")[0]]), job_id)
    except LaunchError:
        ended = None
    if ended is None and squeue_failed is not None:
        raise squeue_failed  # neither squeue nor sacct answered: not the same as "no such job"
    return ended or live


def work_dir(job_id: str) -> str | None:
    """The directory job `job_id` ran in (sbatch's working directory, where it was submitted from) as accounting or,
    for a recent job, the controller recorded it; None when neither answers with one."""
    for cmd in (["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "WorkDir"], ["scontrol", "-o", "show", "job", job_id]):
        try:
            out = _run(cmd)
        except LaunchError:  # the tool absent or failing (no accounting, a job the controller forgot): ask the next
            continue
        for line in out.splitlines():
            found = line.strip() if cmd[0] == "sacct" else next(iter(re.findall(r"\bWorkDir=(\S+)", line)), "")
            if found.startswith("/"):
                return found
    return None


def wait_final(job_id: str, timeout_s: float = 300, poll_s: float = 1.0) -> JobRecord:
    """Poll sacct until the job reaches a final state (accounting can lag the job by a second or two)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rec = sacct([job_id]).get(job_id)
        if rec is not None and rec.final:
            return rec
        if time.monotonic() > deadline:
            raise LaunchError(f"job {job_id} not final after {timeout_s:.0f}s (last state: {rec.state if rec else 'unknown'})")
        time.sleep(poll_s)
