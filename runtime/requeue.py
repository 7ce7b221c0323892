"""Surviving time limits and preemption: signal -> flag -> save at a step boundary -> requeue -> resume.

submitit's own USR2 handler checkpoints from inside the signal handler on rank 0 alone, which cannot work for
a distributed checkpoint that every rank must write together. So a payload replaces it with a handler that
only sets a flag; the loop polls `StopSignal.requested()` between steps (all ranks agree through an
all-reduce), saves collectively, and rank 0 asks Slurm to requeue the job. On every start the payload finds
its latest complete checkpoint by itself (nothing is pickled), and `RestartGuard` stops a job that keeps
restarting without progress or past its restart cap.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcorekit.errors import MCoreKitError
from mcorekit.runtime.ranks import any_rank

log = logging.getLogger("mcorekit.requeue")


class StopSignal:
    """Remembers that USR2 (time limit near) or TERM (preemption, scancel) arrived; never acts inside the handler."""

    def __init__(self) -> None:
        self.signum: int | None = None
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

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

    @property
    def is_time_limit(self) -> bool:
        return self.signum == signal.SIGUSR2


def restart_count() -> int:
    value = os.environ.get("SLURM_RESTART_COUNT", "0")
    if not (value.isascii() and value.isdigit()):
        raise MCoreKitError(f"SLURM_RESTART_COUNT={value!r} is not a whole number (Slurm sets it on a requeued job)")
    return int(value)


@dataclass
class RestartGuard:
    """Refuses to loop: caps restarts and stops a restart that finds no progress since the previous one."""

    run_dir: Path
    max_restarts: int

    @property
    def path(self) -> Path:
        return self.run_dir / "restarts.json"

    def check(self, start_step: int) -> None:
        """Call once at start (rank 0) with the step the job resumes from; raises MCoreKitError to stop for good."""
        restarts = restart_count()
        history = self._history()
        if restarts > self.max_restarts:
            raise MCoreKitError(
                f"restart {restarts} exceeds resources.max_restarts={self.max_restarts}; not resuming "
                f"(raise resources.max_restarts or resources.time)"
            )
        if restarts > 0 and history and history[-1]["start_step"] == start_step and history[-1]["restart"] < restarts:
            raise MCoreKitError(
                f"restart {restarts} would resume from step {start_step}, the same step as the previous start: no "
                f"progress was saved in between (a checkpoint save that fails or takes longer than the signal lead "
                f"time?); stopping instead of looping"
            )
        history.append({"restart": restarts, "start_step": start_step, "job_id": os.environ.get("SLURM_JOB_ID")})
        _write_atomic(self.path, json.dumps(history, indent=1))

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

    def allow_requeue(self) -> bool:
        return restart_count() < self.max_restarts


def requeue_and_exit(rank: int) -> None:
    """Rank 0 asks Slurm to requeue this job; every rank then exits without a result, so the job is not 'done'."""
    job_id = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job_id else os.environ.get("SLURM_JOB_ID")
    if rank == 0 and job_id:
        log.warning("requeueing job %s (restart %d)", job_id, restart_count() + 1)
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    sys.stdout.flush()
    # SystemExit is not an Exception: submitit writes no result file, and the requeued job runs the payload again.
    raise SystemExit(-1)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
