"""A dry run makes the checks a real submission makes (it creates nothing): a run root that cannot be written, a run
folder whose job still runs (--resume), a time limit the pre-timeout signal leaves no room in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_launch_options import run

from mcorekit.launch import accounting, api

TINY = Path(__file__).resolve().parent.parent / "examples" / "llama-tiny.yaml"


def run_main(*args: str | Path) -> tuple[int, str, str]:
    return run(*map(str, args))


@pytest.mark.parametrize("kind", [["launch", "--config", TINY], ["launch", "smoke"],
                                  ["launch", "sweep", "--config", TINY, "--grid", "optimizer.lr=1e-4,3e-4"],
                                  ["launch", "chain", "--config", TINY, "--hf-out", "/tmp/nowhere-hf"]])
def test_unwritable_run_root_fails_the_dry_run_too(tmp_path: Path, kind: list) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    code, out, err = run_main(*kind, "--set", f"run_root={blocker}/runs", "--dry-run")
    assert (code, out) == (2, "") and err.startswith(f"mcorekit: error: {blocker}/runs: cannot write the run root"), err
    assert "Not a directory" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing created


def test_dry_run_creates_nothing_under_a_writable_run_root(tmp_path: Path) -> None:
    code, _, err = run_main("launch", "--config", TINY, "--set", f"run_root={tmp_path}/new/runs", "--dry-run")
    assert code == 0, err
    assert list(tmp_path.iterdir()) == []


def test_resume_dry_run_refuses_while_the_runs_job_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = api.load(TINY, "local", [], [f"run_root={tmp_path}"])
    p.save()
    (tmp_path / "jobs.jsonl").write_text(json.dumps({"job_id": "31", "name": "llama-tiny", "kind": "train",
                                                     "run_dir": str(p.spec.run_dir)}) + "\n")
    monkeypatch.setattr(accounting, "job_record", lambda jid: accounting.JobRecord(jid, "x", "RUNNING", "", "", 0))
    code, out, err = run_main("launch", "--resume", p.spec.run_dir, "--dry-run")
    assert (code, out) == (2, "") and "job 31 RUNNING there has not ended" in err, err


def test_resume_dry_run_refuses_a_run_whose_inputs_changed(tmp_path: Path) -> None:
    """What the job's start would refuse (train/run_inputs.py), said before it is queued: a run folder whose
    config.yaml was edited since its first start recorded its inputs."""
    import yaml

    from mcorekit.train import run_inputs

    p = api.load(TINY, "local", [], [f"run_root={tmp_path}"])
    p.save()
    checkpoints = p.spec.run_dir / "checkpoints"
    run_inputs.record_or_check(p.experiment, checkpoints, resuming=False)  # its first start
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("10")
    assert run_main("launch", "--resume", p.spec.run_dir, "--dry-run")[0] == 0
    config = yaml.safe_load((p.spec.run_dir / "config.yaml").read_text())
    before = config["schedule"]["train_iters"]
    config["schedule"]["train_iters"] = before * 2
    (p.spec.run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    code, out, err = run_main("launch", "--resume", p.spec.run_dir, "--dry-run")
    assert (code, out) == (2, "") and len(err.splitlines()) == 1, err
    assert err.startswith(f"mcorekit: error: --resume {p.spec.run_dir}: this run's inputs changed since its first "
                          f"start: schedule.train_iters {before} -> {before * 2}. "), err


def test_smoke_time_limit_must_outlive_the_signal_lead() -> None:
    code, out, err = run_main("launch", "smoke", "--set", "signal_seconds=600", "--dry-run")
    assert (code, out) == (2, ""), out
    assert err.startswith("mcorekit: error: ") and "signal_seconds=600" in err and len(err.splitlines()) == 1, err


def test_percent_in_the_run_root_is_refused(tmp_path: Path) -> None:
    """Slurm expands %j, %A, %x... in --output/--error: the logs would land in another folder than the run's."""
    for kind in (["launch", "--config", TINY], ["launch", "smoke"]):
        code, out, err = run_main(*kind, "--set", f"run_root={tmp_path}/a%jb", "--dry-run")
        assert (code, out) == (2, "") and "'%'" in err and "run_root" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("kind,suffix", [(["launch", "sweep", "--grid", "optimizer.lr=1e-4,3e-4"], "-sweep"),
                                         (["launch", "chain", "--hf-out", "/tmp/nowhere-hf"], "-convert")])
def test_a_name_too_long_with_the_suffix_says_so(tmp_path: Path, kind: list, suffix: str) -> None:
    name = "n" * 60  # a valid name alone (at most 64), not with the suffix the sweep's or chain's jobs add
    code, out, err = run_main(*kind, "--config", TINY, f"name={name}", "--set", f"run_root={tmp_path}", "--dry-run")
    assert (code, out) == (2, ""), out
    assert "too long" in err and f"<name>{suffix}" in err and f"at most {64 - len(suffix)}" in err, err


def test_a_dollar_in_a_profile_env_value_is_a_warning(tmp_path: Path) -> None:
    """Profile env values are quoted into the script, so $HOME stays the text $HOME; setup: lines expand."""
    code, out, err = run_main("launch", "--config", TINY, "--set", f"run_root={tmp_path}", "--set",
                              "env={HF_HOME: $HOME/hf, PLAIN: x}", "--dry-run")
    assert code == 0 and "export HF_HOME='$HOME/hf'" in out
    [warning] = [line for line in err.splitlines() if "HF_HOME" in line]
    assert warning.startswith("mcorekit: warning: ") and "literally" in warning and "setup:" in warning
