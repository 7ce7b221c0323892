"""A real 2-task job on the dev cluster, through submitit: gloo group from SLURM_*, all-reduce, sacct."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from mcorekit.config.cluster import load_profile
from mcorekit.launch.accounting import wait_final
from mcorekit.launch.smoke import allreduce_check
from mcorekit.launch.submit import REGISTRY, JobSpec, submit
from mcorekit.runtime.env import port_for_job

pytestmark = pytest.mark.slurm

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the job's python imports no tests module


def test_two_task_gloo_allreduce_completes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rendezvous variables in the submitting shell (here: a stale torchrun's) must not reach the job.
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RANK", "5")
    profile = load_profile("local")
    assert profile.tasks_per_node == 2
    spec = JobSpec(name="test-allreduce", run_dir=tmp_path / "allreduce", time="00:05:00")
    job = submit(profile, spec, allreduce_check, kind="test")

    results = job.results()  # one per task, in task order
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert all(r["sum"] == 3.0 for r in results)  # (0 + 1) + (1 + 1)
    assert all(r["backend"] == "gloo" and r["env_source"] == "slurm" for r in results)
    assert all(r["master_port"] == port_for_job(job.job_id) for r in results)

    record = wait_final(job.job_id, timeout_s=120)
    assert record.state == "COMPLETED"
    assert record.exit_code == "0:0"
    entries = [json.loads(line) for line in (tmp_path / REGISTRY).read_text().splitlines()]
    assert [(e["job_id"], e["name"]) for e in entries] == [(job.job_id, "test-allreduce")]


def one_rank_fails() -> None:
    """Rank 1 fails at once; rank 0 stands for the ranks left waiting in their next collective for its part."""
    import os

    if os.environ["SLURM_PROCID"] == "1":
        raise SystemExit(2)
    time.sleep(600)


def test_one_failing_task_ends_the_others_at_once(tmp_path: Path) -> None:
    """srun --kill-on-bad-exit: without it the job lasts as long as the waiting rank (NCCL's timeout, in training)."""
    profile = load_profile("local")
    spec = JobSpec(name="test-one-fails", run_dir=tmp_path / "one-fails", time="00:15:00")
    start = time.monotonic()
    job = submit(profile, spec, one_rank_fails, kind="test")
    record = wait_final(job.job_id, timeout_s=300)
    assert record.state == "FAILED", record
    assert time.monotonic() - start < 120, record  # rank 0 alone would have kept it 600 s
