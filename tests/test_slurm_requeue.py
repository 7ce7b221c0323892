"""Requeue on the real cluster: a job too long for its time limit is signalled, saves, requeues, resumes, completes."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from mcorekit.config.cluster import load_profile
from mcorekit.launch.accounting import sacct, wait_final
from mcorekit.launch.smoke import CountingJob
from mcorekit.launch.submit import JobSpec, submit

pytestmark = pytest.mark.slurm


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
        deadline = time.monotonic() + 60
        while not (steps.exists() and len(steps.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline, "the job did not start stepping within 60 s"
            time.sleep(0.5)
        subprocess.run(["scancel", job.job_id], check=True)
        record = wait_final(job.job_id, timeout_s=30, poll_s=1)
        time.sleep(5)  # a requeue after the cancel would show by now (KillWait is 5 s on the dev cluster)
        record = sacct([job.job_id])[job.job_id]
        live = subprocess.run(["squeue", "-h", "-j", job.job_id, "-o", "%T"], capture_output=True, text=True).stdout
    finally:
        _cancel_for_good(job.job_id)
    assert (record.state, record.restarts, live.strip()) == ("CANCELLED", 0, ""), (record, live)
    saved = int((run_dir / "ckpt" / "latest").read_text())  # the save on TERM: the last step it finished
    assert saved == len(steps.read_text().splitlines()) >= 3
    log = "".join(p.read_text() for p in (run_dir / "logs").glob("*.err"))
    assert "not requeueing" in log and "requeueing job" not in log
