"""Surviving time limits and preemption: signal -> flag -> save at a step boundary -> requeue -> resume.

submitit's own USR2 handler checkpoints from inside the signal handler on rank 0 alone, which cannot work for
a distributed checkpoint that every rank must write together. So a payload replaces it with a handler that
only sets a flag; the loop polls `StopSignal.requested()` between steps (all ranks agree through an
all-reduce), saves collectively, and then (`stop_and_exit`) rank 0 asks Slurm to requeue the job on the time-limit
warning, while TERM (scancel, preemption) only stops: Slurm requeues a preempted job itself. On every start the
payload finds its latest complete checkpoint by itself (nothing is pickled), and `RestartGuard` stops a job that keeps
requeueing itself without progress or past its cap.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn

from mcorekit.errors import MCoreKitError
from mcorekit.outputs import write_atomic
from mcorekit.runtime.ranks import any_rank, rank_zero_choice

log = logging.getLogger("mcorekit.requeue")


class StopSignal:
    """Remembers that USR2 (time limit near) or TERM (preemption, scancel) arrived; never acts inside the handler.
    What follows the save differs (stop_and_exit): USR2 requeues, TERM only stops."""

    def __init__(self) -> None:
        self.signum: int | None = None
        # sticky: Slurm's TERM at the time limit itself may come while the save USR2 started is still running
        self.time_limit = False
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self.time_limit = self.time_limit or signum == signal.SIGUSR2

    def requested(self, group: Any = None) -> bool:
        """True on every rank as soon as any rank got a signal (one tiny all-reduce when distributed)."""
        return any_rank(self.signum is not None) if group is not False else self.signum is not None

    def work_done(self) -> None:
        """The job's work is complete: a time-limit warning from now on changes nothing, so it is ignored. Left to
        the flag handler, it would kill the process: Python's exit puts the default action (terminate) back before
        the process has ended, and a USR2 in those last seconds (interpreter exit alone took 4.5 s after a 3B run)
        marked a finished job FAILED, whose afterok children (convert, export) then never ran. Seen in the requeue
        test on the dev cluster, 2026-12-02. TERM (scancel, preemption) keeps its handler."""
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def restart_count() -> int:
    value = os.environ.get("SLURM_RESTART_COUNT", "0")
    if not (value.isascii() and value.isdigit()):
        raise MCoreKitError(f"SLURM_RESTART_COUNT={value!r} is not a whole number (Slurm sets it on a requeued job)")
    return int(value)


@dataclass
class RestartGuard:
    """Refuses to loop: caps the job's own requeues and stops a restart that finds no progress since the previous
    start, when that start requeued the job itself (restarts.json marks it: `requeued_at_step`). A start before a
    step this job had reached (started from, or requeued itself at) is refused too: its newer checkpoints look gone
    (NFS showing the folder missing a moment), and its first saves would overwrite or prune them.

    A restart Slurm made (node failure, preemption, an admin's `scontrol requeue`) counts toward neither: the job did
    not ask for it, so it spends none of resources.max_restarts (SLURM_RESTART_COUNT counts it, hence not that), and
    it may find no progress, having been stopped before its first save. The cap is per job: `launch --resume`
    submits a new job, with a budget of its own."""

    run_dir: Path
    max_restarts: int
    checkpoints: Path | None = None  # where the run's checkpoints go (default run_dir/checkpoints): for the message

    @property
    def path(self) -> Path:
        return self.run_dir / "restarts.json"

    def check(self, start_step: int) -> None:
        """Call once at start (rank 0) with the step the job resumes from; raises MCoreKitError to stop for good."""
        restarts = restart_count()
        history = self._history()
        own = self._own_requeues(history)
        if own > self.max_restarts:  # allow_requeue stops at the cap: only a max_restarts lowered since gets here
            raise MCoreKitError(
                f"restart {restarts}: the job has requeued itself {own} times, more than resources.max_restarts="
                f"{self.max_restarts}; not resuming (raise resources.max_restarts or resources.time)"
            )
        reached = self._reached(history)
        if reached is not None and start_step < reached:
            folder = self.checkpoints or self.run_dir / "checkpoints"
            found = f"step {start_step}" if start_step else "step 0 (no checkpoint of its own found)"
            raise MCoreKitError(
                f"restart {restarts}: job {os.environ.get('SLURM_JOB_ID')} had reached step {reached} ({self.path}) "
                f"but would start from {found} in {folder}: the newer checkpoints look missing (a file system that "
                f"shows another view, such as NFS, or removed by hand); not resuming, its saves would overwrite them: "
                f"check the file system or restore iter_{reached:07d} there, then `mcorekit launch --resume "
                f"{self.run_dir}`; or start a new run"
            )
        last = history[-1] if history else None
        if (restarts > 0 and last and "requeued_at_step" in last and last["start_step"] == start_step
                and last["restart"] < restarts):
            raise MCoreKitError(
                f"restart {restarts} would resume from step {start_step}, the same step as the previous start: no "
                f"progress was saved in between (a checkpoint save that fails or takes longer than the signal lead "
                f"time?); stopping instead of looping"
            )
        history.append({"restart": restarts, "start_step": start_step, "job_id": os.environ.get("SLURM_JOB_ID")})
        write_atomic(self.path, json.dumps(history, indent=1))

    def _history(self) -> list[dict[str, Any]]:
        """The starts so far ([] before the first); a file that is not that list is one error line, not a guess."""
        if not self.path.exists():
            return []
        try:
            history = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise MCoreKitError(f"{self.path}: unreadable ({type(e).__name__}); it holds this run's restarts: delete "
                                f"it to start the count afresh") from None
        if not (isinstance(history, list) and all(isinstance(h, dict) and type(h.get("restart")) is int
                                                  and type(h.get("start_step")) is int for h in history)):
            raise MCoreKitError(f"{self.path}: not a list of {{restart, start_step}} records; delete it to start the "
                                f"count afresh")
        return history

    def record_requeue(self, step: int) -> None:
        """Rank 0, just before it requeues the job itself: marks this start as one that asked for its restart."""
        history, restarts, job = self._history(), restart_count(), os.environ.get("SLURM_JOB_ID")
        if not (history and history[-1]["restart"] == restarts and history[-1].get("job_id") == job):
            history.append({"restart": restarts, "start_step": step, "job_id": job})  # check() was not called
        history[-1]["requeued_at_step"] = step
        write_atomic(self.path, json.dumps(history, indent=1))

    @staticmethod
    def _reached(history: list[dict[str, Any]]) -> int | None:
        """The furthest step this job (SLURM_JOB_ID) started from or requeued itself at (each a checkpoint it had
        then); None for a job without a start recorded (its first, or one outside Slurm)."""
        job = os.environ.get("SLURM_JOB_ID")
        steps = [s for h in history if job is not None and h.get("job_id") == job
                 for s in (h["start_step"], h.get("requeued_at_step")) if type(s) is int]
        return max(steps) if steps else None

    @staticmethod
    def _own_requeues(history: list[dict[str, Any]]) -> int:
        """How often this job (SLURM_JOB_ID, kept across requeues) requeued itself: its marked starts."""
        job = os.environ.get("SLURM_JOB_ID")
        return sum(1 for h in history if job is not None and h.get("job_id") == job and "requeued_at_step" in h)

    def own_requeues(self) -> int:
        return self._own_requeues(self._history())

    def allow_requeue(self) -> bool:
        """Whether the time-limit warning may requeue the job once more: its own requeues so far below the cap."""
        return self.own_requeues() < self.max_restarts


# A stop on TERM exits as a process killed by TERM would (128 + 15): the job stopped before its work was done.
TERMINATED_EXIT = 128 + signal.SIGTERM


# what a stop leaves the loggers to close in (W&B's finish), after the requeue: Slurm ends the job KillWait after it
# (30 s by default), and a TERM's save has spent part of that already
CLOSE_S = 10


def stop_and_exit(stop: StopSignal, guard: RestartGuard, rank: int, step: int,
                  close: Callable[[], None] | None = None) -> NoReturn:
    """What follows the save a stop signal asked for; every rank calls it. On the time-limit warning (USR2) rank 0
    requeues the job, unless the restart cap is reached: then every rank stops, saying how to go on. On TERM
    (scancel, or preemption; on any rank: stop means stop) every rank exits without requeueing: `scontrol requeue`
    also requeues a job that is being cancelled, and a preempted job is requeued by Slurm itself (the script asks
    for --requeue). A TERM after the time-limit warning is the time limit itself when Slurm says so (the save outlasted
    the warning's lead): it requeues; an scancel in the warning's lead stops. The ranks decide together (all-reduces;
    a process without a group decides alone). Then `close` (the run's loggers) runs on every rank, for at most
    CLOSE_S, and the ranks leave together: each exits non-zero, and the first to leave makes srun end the others
    (--kill-on-bad-exit), rank 0 in W&B's finish among them."""
    code = _stop(stop, guard, rank, step)
    closed = _at_most(close, CLOSE_S) if close is not None else True
    any_rank(False)  # the barrier: no rank leaves before rank 0 has closed
    if not closed:  # the interpreter's exit would wait for W&B's service without a limit (its own exit handler)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code & 0xFF)
    _exit(code)


def _at_most(close: Callable[[], None], seconds: float) -> bool:
    """close() on a thread, waited for at most `seconds`; whether it ended."""
    def closing() -> None:
        try:
            close()
        except Exception as e:  # noqa: BLE001 - saved and decided already: a logger's failure is only a warning
            log.warning("closing the loggers failed (%s: %s)", type(e).__name__, e)

    thread = threading.Thread(target=closing, name="mcorekit-close-loggers", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        log.warning("the loggers did not close within %g s (W&B's finish?): leaving without them", seconds)
        return False
    return True


def _stop(stop: StopSignal, guard: RestartGuard, rank: int, step: int) -> int:
    """stop_and_exit's decision, carried out (rank 0 requeues): the exit code every rank leaves with."""
    terminated = any_rank(stop.signum == signal.SIGTERM and not stop.time_limit)
    if not terminated and any_rank(stop.signum == signal.SIGTERM):  # after the warning: the limit, or a cancel?
        terminated = not rank_zero_choice(lambda: ended_by_time_limit(job_id()))
    if terminated:
        if rank == 0:
            log.warning("stopping at step %d on TERM (scancel or preemption): checkpoint saved, not requeueing", step)
        return TERMINATED_EXIT
    try:  # restarts.json, on a file system the nodes may see differently: rank 0 reads it for every rank
        own = rank_zero_choice(guard.own_requeues)
    except (MCoreKitError, OSError) as e:
        if rank == 0:
            log.error("%s; the checkpoint of step %d is saved: `mcorekit launch --resume %s` continues from it",
                      e, step, guard.run_dir)
        return 1
    if own >= guard.max_restarts:
        if rank == 0:  # one error line that `mcorekit status` recognises (launch/diagnose.py: RESTART_CAP_RE)
            print(f"mcorekit.train: error: stopped at its restart cap (resources.max_restarts={guard.max_restarts}): "
                  f"time limit near at step {step}, checkpoint saved; not requeueing: the job has requeued itself "
                  f"{own} times (restarts Slurm made are not counted); `mcorekit launch --resume {guard.run_dir}` "
                  f"continues from this checkpoint (raise resources.time or max_restarts for fewer, longer jobs)",
                  file=sys.stderr, flush=True)
        return 1
    failed = None
    if rank == 0:
        try:
            guard.record_requeue(step)
            requeue(job_id())
        except (MCoreKitError, OSError) as e:  # restarts.json unwritable too: the other ranks wait for an answer
            failed = e
    # Every rank waits for rank 0's requeue (an all-reduce is the barrier): a rank that exited non-zero first could
    # end the job FAILED before it is requeued (srun, KillOnBadExit), and a chain's afterok children with it.
    if any_rank(failed is not None):
        if rank == 0:
            log.error("%s; the checkpoint of step %d is saved: `mcorekit launch --resume %s` continues from it",
                      failed, step, guard.run_dir)
        return 1
    # SystemExit is not an Exception: submitit writes no result file, and the requeued job runs the payload again.
    return -1


def ended_by_time_limit(job: str | None) -> bool:
    """Whether Slurm is ending this job at its time limit (asked when TERM follows the time-limit warning): at the
    limit `scontrol show job` gives Reason=TimeLimit with the TERM, for an scancel Reason=None (the dev cluster, Slurm
    22.05), for a preemption its own reason. Without an answer (no Slurm, a controller that does not answer): the
    time limit, as the warning said."""
    if not job:
        return True
    try:  # within Slurm's KillWait, before the requeue: a short timeout
        proc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                              errors="replace", timeout=3)
    except (OSError, subprocess.TimeoutExpired):
        return True
    # the first pair only: fields after it (Comment, WorkDir, Command) are the user's text, spaces and all
    found = re.search(r"(?:^|\s)JobState=(\S+) Reason=(\S+)", proc.stdout)
    if proc.returncode or not found:
        return True
    state, reason = found.groups()
    if reason != "TimeLimit":
        log.warning("TERM after the time-limit warning, but Slurm ends the job for another reason (%s, job state %s): "
                    "a cancel or preemption, not the time limit", reason, state)
        return False
    return True


def job_id() -> str | None:
    """This job as `scontrol requeue` names it: ID, or ARRAY_ID_TASK for an array task."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID")


REQUEUE_ATTEMPTS = 4
REQUEUE_TIMEOUT_S = 20  # per attempt: 4 attempts and the backoff between them take under 2 minutes


def requeue(job: str | None) -> None:
    """Ask Slurm to requeue this job (it ends this run and pends again, SLURM_RESTART_COUNT + 1). A busy slurmctld
    times out or refuses for a moment: asked again with backoff (2, 6, 18 s); MCoreKitError if it never answers."""
    if not job:
        return
    log.warning("requeueing job %s (restart %d)", job, restart_count() + 1)
    backoff = float(os.environ.get("MCOREKIT_REQUEUE_BACKOFF_S", "2"))  # tests shorten it
    for attempt in range(1, REQUEUE_ATTEMPTS + 1):
        try:
            proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                                  timeout=REQUEUE_TIMEOUT_S)
            why = " ".join((proc.stderr or proc.stdout).split()) or f"exit code {proc.returncode}"
            if proc.returncode == 0:
                return
        except (OSError, subprocess.TimeoutExpired) as e:
            why = f"{type(e).__name__}: {e}"
        if attempt < REQUEUE_ATTEMPTS:
            log.warning("scontrol requeue %s failed (%s); retrying in %g s", job, why, backoff * 3 ** (attempt - 1))
            time.sleep(backoff * 3 ** (attempt - 1))
    raise MCoreKitError(f"scontrol requeue {job} failed {REQUEUE_ATTEMPTS} times, last: {why}")


def _exit(code: int) -> NoReturn:
    sys.stdout.flush()
    raise SystemExit(code)


