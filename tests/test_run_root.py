"""Where runs and the job registry go (issue 17): an absolute run root, whatever the current directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcorekit.config.cluster import load_profile
from mcorekit.launch.submit import record

REPO = Path(__file__).resolve().parent.parent


def test_default_run_root_is_the_users_state_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MCOREKIT_RUN_ROOT")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert load_profile("local").run_root == str(tmp_path / "state" / "mcorekit" / "runs")
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load_profile("local").run_root == str(tmp_path / "home" / ".local" / "state" / "mcorekit" / "runs")


def test_env_then_profile_then_set_each_win(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MCOREKIT_RUN_ROOT", str(tmp_path / "env-root"))
    assert load_profile("local").run_root == str(tmp_path / "env-root")
    # a relative MCOREKIT_RUN_ROOT is taken from where it was set (the current directory), then fixed
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MCOREKIT_RUN_ROOT", "rel-env")
    assert load_profile("local").run_root == str(tmp_path / "rel-env")
    # a profile file's run_root wins over the environment; a relative one is read from the file's folder
    (tmp_path / "profiles").mkdir()
    prof = tmp_path / "profiles" / "p.yaml"
    prof.write_text("name: p\ngpus_per_node: 0\nrun_root: ../shared-runs\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_profile(prof).run_root == str(tmp_path / "shared-runs")
    # --set run_root=rel is relative to where the command runs
    assert load_profile(prof, ["run_root=mine"]).run_root == str(elsewhere / "mine")
    assert load_profile("example-h100").run_root == "/lustre/project/runs"


@pytest.mark.slurm
def test_status_from_another_directory_reads_the_same_registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The registry lives under the absolute default root: status run from two directories reads the same file
    (a job id Slurm does not know: UNKNOWN)."""
    root = tmp_path / "state" / "mcorekit" / "runs"
    env = {k: v for k, v in os.environ.items() if k != "MCOREKIT_RUN_ROOT"} | {"XDG_STATE_HOME": str(tmp_path / "state")}
    record(root, job_id="987654", name="far-away", kind="train", run_dir=str(root / "far-away-1"))
    outs = []
    for cwd in (REPO, tmp_path):
        proc = subprocess.run([sys.executable, "-m", "mcorekit", "status", "--json"], capture_output=True, text=True,
                              cwd=cwd, env=env, timeout=60)
        outs.append(proc)
    for proc in outs:
        assert proc.returncode == 0, proc.stderr
        [job] = json.loads(proc.stdout)
        assert job["job"] == "987654" and job["name"] == "far-away" and job["state"] == "UNKNOWN"
