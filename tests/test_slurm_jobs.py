"""status, logs, cancel and smoke against the real dev cluster (issue 17): the job's own error line, "dependency
failed" for a chain's cancelled children, task counts and finished jobs, state lines while smoke waits, and job
tracking from any directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

from mcorekit.config.cluster import load_profile
from mcorekit.launch import api
from mcorekit.launch.accounting import wait_final

pytestmark = pytest.mark.slurm

cloudpickle.register_pickle_by_value(sys.modules[__name__])

REPO = Path(__file__).resolve().parent.parent


def ok_payload() -> str:
    return "ok"


def mk(*args: str | Path, cwd: Path = REPO, env: dict[str, str] | None = None,
       timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mcorekit", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def one_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("mcorekit: error: "), (proc.returncode, proc.stderr)
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def test_status_shows_the_jobs_own_error_and_dependency_failed(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    profile = load_profile("local", [f"run_root={runs}", "tasks_per_node=1"])
    bad = api.cli_payload(["launch", "--config", "/nonexistent/exp.yaml", "--dry-run"])
    jobs = api.submit_chain(profile, [api.Stage("c-bad", bad, time="00:05:00"),
                                      api.Stage("c-child", ok_payload, time="00:05:00")], runs / "chain")
    parent, child = (j.job_id for j in jobs)
    assert wait_final(parent, 120).state == "FAILED"
    assert wait_final(child, 120).state == "CANCELLED"
    proc = mk("status", "--runs", runs, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["job"]: r for r in json.loads(proc.stdout)}
    assert rows[parent]["state"] == "FAILED" and rows[parent]["exit"] == "1:0"
    assert rows[parent]["diagnosis"] == "mcorekit: error: config file not found: /nonexistent/exp.yaml"
    assert rows[child]["state"] == "CANCELLED"
    assert rows[child]["diagnosis"] == f"dependency failed: job {parent} (c-bad) ended FAILED"
    assert rows[child]["dependency"] == f"afterok:{parent}"
    table = mk("status", "--runs", runs)
    assert table.returncode == 0 and "config file not found" in table.stdout and "RuntimeError" not in table.stdout
    # the child never ran: logs says so instead of "no log yet"
    one_error(mk("logs", child, "--runs", runs), f"job {child} finished (CANCELLED), no log for rank 0")


def test_smoke_shows_states_then_status_logs_cancel_from_elsewhere(tmp_path: Path) -> None:
    """Submitted from the checkout with the default run root; status, logs and cancel run from another folder."""
    env = {k: v for k, v in os.environ.items() if k != "MCOREKIT_RUN_ROOT"} | {"XDG_STATE_HOME": str(tmp_path / "state")}
    smoke = mk("launch", "smoke", env=env, timeout=300)
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    lines = smoke.stdout.splitlines()
    job = lines[0].split()[3].rstrip(";")
    states = [ln.split(": ")[1] for ln in lines if ln.startswith(f"smoke job {job}: ") and "tasks" not in ln]
    assert states[-1] == "COMPLETED" and len(states) == len(set(states)), lines  # one line per change
    assert set(states) <= {"SUBMITTED", "PENDING", "RUNNING", "COMPLETING", "COMPLETED"}, states
    assert lines[-1].endswith("-> OK")
    assert str(tmp_path / "state" / "mcorekit" / "runs") in lines[0]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    status = mk("status", "--json", cwd=elsewhere, env=env)
    assert status.returncode == 0, status.stderr
    [row] = json.loads(status.stdout)
    assert row["job"] == job and row["kind"] == "smoke" and row["state"] == "COMPLETED"

    one_error(mk("logs", job, "--rank", "5", cwd=elsewhere, env=env), f"job {job} has 2 tasks (ranks 0-1)")
    assert mk("logs", job, "--rank", "1", cwd=elsewhere, env=env).returncode == 0
    cancelled = mk("cancel", job, cwd=elsewhere, env=env)
    one_error(cancelled, f"job {job} already COMPLETED; nothing was cancelled")
    assert "cancelled" not in cancelled.stdout


def test_resume_relaunches_the_run_folder_as_its_next_job(tmp_path: Path) -> None:
    from mcorekit.errors import LaunchError
    from mcorekit.launch.smoke import CountingJob
    from mcorekit.launch.submit import REGISTRY

    from test_slurm_launch import tiny_experiment

    runs = tmp_path / "runs"
    p = api.prepare(tiny_experiment("resume-me"), load_profile("local", [f"run_root={runs}", "tasks_per_node=1"]))
    run = p.spec.run_dir
    first = api.submit_prepared(p, payload=CountingJob(str(run), total_steps=2, step_seconds=1.0), kind="train")
    again, root = api.resume(run)
    assert again.spec.run_dir == run and root == runs and again.experiment == p.experiment
    with pytest.raises(LaunchError, match=f"job {first.job_id} (PENDING|RUNNING) there has not ended"):
        api.submit_resumed(again, root, payload=CountingJob(str(run), total_steps=4, step_seconds=0.2))
    assert wait_final(first.job_id, 120).state == "COMPLETED"
    second = api.submit_resumed(again, root, payload=CountingJob(str(run), total_steps=4, step_seconds=0.2))
    assert wait_final(second.job_id, 120).state == "COMPLETED"
    assert "resuming at step 2" in (run / "logs" / f"{second.job_id}_0_log.out").read_text()
    assert [ln.split()[0] for ln in (run / "steps.log").read_text().splitlines()] == ["1", "2", "3", "4"]
    registry = [json.loads(ln) for ln in (runs / REGISTRY).read_text().splitlines()]
    assert [(e["job_id"], e["run_dir"]) for e in registry] == [(first.job_id, str(run)), (second.job_id, str(run))]

    # the CLI: a dry run shows the same folder's job; a training submission needs a GPU profile; not a run folder
    dry = mk("launch", "--resume", run, "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert f"#SBATCH --output={run}/logs/%j_0_log.out" in dry.stdout and "name: resume-me" in dry.stdout
    one_error(mk("launch", "--resume", run), "is CPU-only")
    one_error(mk("launch", "--resume", runs), f"--resume {runs}: not a run folder (no config.yaml or cluster.yaml in it)")
    one_error(mk("launch", "--resume", run, "--config", "x.yaml"), "it takes no --config")
