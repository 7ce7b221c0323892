"""Requeue on the real cluster: a job too long for its time limit is signalled, saves, requeues, resumes, completes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import cloudpickle
import pytest

from mcorekit.config.cluster import load_profile
from mcorekit.launch.accounting import JobRecord, sacct, wait_final
from mcorekit.launch.smoke import CountingJob
from mcorekit.launch.submit import JobSpec, submit

pytestmark = pytest.mark.slurm

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the job's python imports no tests module


def test_time_limit_requeue_resumes_every_step_exactly_once(tmp_path: Path) -> None:
    # 2-minute limit with USR2 40 s before it (Slurm may send it up to ~60 s early); 100 steps of 1 s cannot
    # finish in one allocation.
    profile = load_profile("local", ["signal_seconds=40", "tasks_per_node=1"])
    run_dir = tmp_path / "requeue"
    run_dir.mkdir()
    spec = JobSpec(name="test-requeue", run_dir=run_dir, time="00:02:00")
    job = submit(profile, spec, CountingJob(str(run_dir), total_steps=100, step_seconds=1.0, max_restarts=4), kind="test")

    record = wait_final(job.job_id, timeout_s=600, poll_s=3)
    steps = [int(line.split()[0]) for line in (run_dir / "steps.log").read_text().splitlines()]
    restarts_seen = {int(line.split()[1]) for line in (run_dir / "steps.log").read_text().splitlines()}

    assert record.state == "COMPLETED", (record, (run_dir / "logs").iterdir())
    assert steps == list(range(1, 101))  # every step exactly once, in order, across restarts
    assert record.restarts >= 1 and max(restarts_seen) >= 1
    assert job.result() == {"final_step": 100, "restarts": record.restarts}
    assert (run_dir / "ckpt" / "latest").read_text() == "100"


def _cancel_for_good(job_id: str) -> None:
    """Cleanup that works even if the job requeues itself on TERM: KILL its steps, then cancel it."""
    subprocess.run(["scancel", "--signal=KILL", "--full", job_id], capture_output=True)
    subprocess.run(["scancel", job_id], capture_output=True)


def _wait_until(started: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not started():
        assert time.monotonic() < deadline, f"the job did not {what} within 60 s"
        time.sleep(0.5)


def _scancel_and_settle(job_id: str) -> tuple[JobRecord, str]:
    """scancel, the job's final accounting record, and what squeue still shows of it."""
    subprocess.run(["scancel", job_id], check=True)
    wait_final(job_id, timeout_s=30, poll_s=1)
    time.sleep(5)  # a requeue after the cancel would show by now (KillWait is 5 s on the dev cluster)
    live = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
    return sacct([job_id])[job_id], live


def _logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in (run_dir / "logs").glob("*.err"))


def test_cancel_of_a_running_job_saves_and_ends_cancelled_not_requeued(tmp_path: Path) -> None:
    """`mcorekit cancel` (scancel: TERM, then KILL after KillWait) means stop: the payload saves at its step boundary
    and exits; it must not run `scontrol requeue`, which also requeues a job that is being cancelled."""
    profile = load_profile("local", ["tasks_per_node=1"])
    run_dir = tmp_path / "cancel"
    run_dir.mkdir()
    spec = JobSpec(name="test-cancel", run_dir=run_dir, time="00:10:00")
    payload = CountingJob(str(run_dir), total_steps=300, step_seconds=1.0, max_restarts=4)
    job = submit(profile, spec, payload, kind="test")
    try:
        steps = run_dir / "steps.log"
        _wait_until(lambda: steps.exists() and len(steps.read_text().splitlines()) >= 3, "start stepping")
        record, live = _scancel_and_settle(job.job_id)
    finally:
        _cancel_for_good(job.job_id)
    assert (record.state, record.restarts, live.strip()) == ("CANCELLED", 0, ""), (record, live)
    saved = int((run_dir / "ckpt" / "latest").read_text())  # the save on TERM: the last step it finished
    assert saved == len(steps.read_text().splitlines()) >= 3
    log = _logs(run_dir)
    assert "not requeueing" in log and "requeueing job" not in log


def warned_then_terminated(run_dir: str) -> str:
    """A job told that its time limit is near (USR2, sent here at once instead of Slurm's slack-prone timing) whose
    save is still running when TERM comes: then what stop_and_exit decides. Its restart returns at once."""
    import os
    import signal
    import time
    from pathlib import Path

    from mcorekit.runtime.requeue import RestartGuard, StopSignal, restart_count, stop_and_exit

    if restart_count() > 0:
        return "restarted"
    stop, guard = StopSignal(), RestartGuard(Path(run_dir), max_restarts=2)
    guard.check(0)
    os.kill(os.getpid(), signal.SIGUSR2)
    (Path(run_dir) / "warned").write_text("")
    deadline = time.monotonic() + 300
    while stop.signum != signal.SIGTERM and time.monotonic() < deadline:  # the save, outlasting the lead
        time.sleep(0.1)
    stop_and_exit(stop, guard, 0, 1)


def test_a_cancel_while_the_warnings_save_runs_stops_the_job(tmp_path: Path) -> None:
    """scancel after the time-limit warning: Slurm's TERM, as at the limit, but the job was cancelled (Reason=None
    where the limit gives TimeLimit): it ends CANCELLED, not requeued to run again."""
    profile = load_profile("local", ["tasks_per_node=1"])
    run_dir = tmp_path / "late-cancel"
    run_dir.mkdir()
    job = submit(profile, JobSpec(name="test-late-cancel", run_dir=run_dir, time="00:10:00"),
                 warned_then_terminated, str(run_dir), kind="test")
    try:
        _wait_until((run_dir / "warned").exists, "start")
        record, live = _scancel_and_settle(job.job_id)
    finally:
        _cancel_for_good(job.job_id)
    assert (record.state, record.restarts, live.strip()) == ("CANCELLED", 0, ""), (record, live)
    log = _logs(run_dir)
    assert "Slurm ends the job for another reason (None" in log and "requeueing job" not in log, log


def test_the_time_limits_term_during_the_warnings_save_requeues(tmp_path: Path) -> None:
    """The same job at its time limit (lowered to one minute once it runs; the launcher refuses a limit that short
    for its signal lead): Slurm's TERM there (Reason=TimeLimit) requeues it (its second start is not waited for:
    Slurm holds a requeued job a while; test_time_limit_requeue_resumes_every_step_exactly_once goes on)."""
    profile = load_profile("local", ["tasks_per_node=1"])
    run_dir = tmp_path / "late-limit"
    run_dir.mkdir()
    job = submit(profile, JobSpec(name="test-late-limit", run_dir=run_dir, time="00:10:00"),
                 warned_then_terminated, str(run_dir), kind="test")
    try:
        _wait_until((run_dir / "warned").exists, "start")
        subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "TimeLimit=1"], check=True)
        deadline = time.monotonic() + 240
        while "requeueing job" not in _logs(run_dir) and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(3)  # the requeue reaches the controller
        shown = subprocess.run(["scontrol", "show", "job", "-o", job.job_id], capture_output=True, text=True).stdout
    finally:
        _cancel_for_good(job.job_id)
    log = _logs(run_dir)
    assert f"requeueing job {job.job_id} (restart 1)" in log and "another reason" not in log, log
    assert "Restarts=1" in shown.split(), shown
