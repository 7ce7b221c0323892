"""Requeue on the real cluster: a job too long for its time limit is signalled, saves, requeues, resumes, completes."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcorekit.config.cluster import load_profile
from mcorekit.launch.accounting import wait_final
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
