"""`launch --resume RUN_DIR` refuses while a job of that run folder has not ended, a chain's stages included, and
reads the relative paths of a run folder an older launcher wrote against the directory it was launched from."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest
import yaml

from mcorekit.config.cluster import load_profile
from mcorekit.config.experiment import load_experiment
from mcorekit.config.loading import dump
from mcorekit.errors import ConfigError
from mcorekit.launch import accounting, api


def test_a_chains_running_training_stage_blocks_a_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "llama-tiny-20261205-000000"
    entries = [  # as submit_chain records a chain's stages, and another run's job
        {"job_id": "11", "name": "llama-tiny-train", "kind": "chain", "run_dir": str(run / "llama-tiny-train")},
        {"job_id": "12", "name": "llama-tiny-convert", "kind": "chain", "run_dir": str(run / "llama-tiny-convert"),
         "dependency": "afterok:11"},
        {"job_id": "13", "name": "other", "kind": "train", "run_dir": str(tmp_path / "other")}]
    (tmp_path / "jobs.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    states = {"11": "RUNNING", "12": "PENDING", "13": "RUNNING"}
    monkeypatch.setattr(accounting, "job_record",
                        lambda jid: accounting.JobRecord(jid, "x", states[jid], "", "", 0))
    assert api.still_running(run, tmp_path) == ["11 RUNNING", "12 PENDING"]


# ---------------------------------------------------------------- run folders written before paths were made absolute

TINY = Path(__file__).resolve().parent.parent / "examples" / "llama-tiny.yaml"
RELATIVE = ["data.kind=indexed", "data.paths=[d1]", "data.tokenizer=tok", "checkpoint.load=base",
            "model.hf_config=null", "model.preset=llama-tiny"]


def old_run_folder(root: Path) -> Path:
    """A run folder as a launcher older than absolute paths at launch left it: config.yaml with the experiment's
    relative paths as written, cluster.yaml, its job (11) in the run root's jobs.jsonl."""
    run = root / "llama-tiny-20261101-000000"
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text(dump(load_experiment(TINY, RELATIVE)))
    (run / "cluster.yaml").write_text(dump(load_profile("local", [f"run_root={root}"])))
    (root / "jobs.jsonl").write_text(json.dumps({"job_id": "11", "name": "llama-tiny", "kind": "train",
                                                 "run_dir": str(run), "submitted_at": "2026-11-01T00:00:00"}) + "\n")
    return run


def slurm_that_knows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workdir: Path | None) -> None:
    """sacct and scontrol on PATH that report job 11's working directory (`sbatch` ran it there), or know no job;
    squeue's view of job 11: it ended."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sacct = f'echo "{workdir}"' if workdir else "true"
    (bin_dir / "sacct").write_text(f'#!/bin/sh\ncase "$*" in *11*WorkDir*|*WorkDir*11*) {sacct} ;; esac\n')
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "slurm_load_jobs error: Invalid job id specified" >&2\nexit 1\n')
    for tool in ("sacct", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(accounting, "job_record",
                        lambda jid: accounting.JobRecord(jid, "llama-tiny", "TIMEOUT", "0:0", "", 0))


def test_an_old_folders_relative_paths_resolve_against_its_launch_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """They were read against the directory the job was launched from (sbatch's, Slurm's WorkDir); a --resume from
    elsewhere read them against its own, so the job trained on other data, or on none."""
    launched, elsewhere = tmp_path / "launched", tmp_path / "elsewhere"
    (launched / "tok").mkdir(parents=True)
    elsewhere.mkdir()
    run = old_run_folder(tmp_path / "runs")
    slurm_that_knows(tmp_path, monkeypatch, launched)
    monkeypatch.chdir(elsewhere)
    p, root = api.resume(run)
    assert (p.experiment.data.paths, p.experiment.data.tokenizer, p.experiment.checkpoint.load) == (
        [str(launched / "d1")], str(launched / "tok"), str(launched / "base"))
    # the job reads config.yaml: the submission writes it with those paths (the rest of it unchanged)
    submitted: list[str] = []

    def fake_submit(job: object, payload: object, kind: str, save: Callable[[], None] | None = None,
                    run_root: Path | None = None) -> object:
        if save:
            save()
        submitted.append(kind)
        return type("Job", (), {"job_id": "12"})()

    monkeypatch.setattr(api, "submit_one", fake_submit)
    api.submit_resumed(p, root, payload=lambda: None)
    saved = load_experiment(run / "config.yaml")
    assert submitted == ["train"] and saved == p.experiment
    assert saved.data.paths == [str(launched / "d1")] and saved.schedule == load_experiment(TINY).schedule
    profile = load_profile("local", [f"run_root={root}"])
    assert yaml.safe_load((run / "cluster.yaml").read_text()) == yaml.safe_load(dump(profile))  # left as it was


def test_an_old_folder_whose_launch_directory_is_unknown_is_refused_naming_the_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm no longer knows job 11 (accounting purged): which directory `d1` meant cannot be told; no guess."""
    (tmp_path / "elsewhere").mkdir()
    run = old_run_folder(tmp_path / "runs")
    slurm_that_knows(tmp_path, monkeypatch, None)
    monkeypatch.chdir(tmp_path / "elsewhere")
    before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError) as e:
        api.resume(run)
    message = str(e.value)
    assert "\n" not in message and "data.paths 'd1'" in message and "data.tokenizer 'tok'" in message
    assert str(run / "config.yaml") in message and "absolute" in message
    assert (run / "config.yaml").read_text() == before


def test_the_launch_directory_comes_from_the_controller_when_accounting_has_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No slurmdbd (sacct fails): a job the controller still holds says its WorkDir in `scontrol show job`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Problem talking to the database' >&2\nexit 1\n")
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$*" = "-o show job 11" ] && '
                                      'echo "JobId=11 JobName=llama-tiny WorkDir=/home/u/exp StdErr=/x/11.err"\n')
    for tool in ("sacct", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert (accounting.work_dir("11"), accounting.work_dir("12")) == ("/home/u/exp", None)


def test_an_old_container_folders_relative_paths_resolve_against_the_containers_workdir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An old container job ran in container.workdir (srun --container-workdir), so its relative paths were read
    there, not in Slurm's WorkDir: that is where a --resume reads them, with Slurm not asked."""
    workdir = tmp_path / "inside"
    (workdir / "tok").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    run = old_run_folder(tmp_path / "runs")
    cluster = yaml.safe_load((run / "cluster.yaml").read_text())
    cluster["container"] = {**(cluster.get("container") or {}), "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                            "workdir": str(workdir)}
    (run / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    slurm_that_knows(tmp_path, monkeypatch, tmp_path / "launched")
    monkeypatch.chdir(tmp_path / "elsewhere")
    p, _ = api.resume(run)
    assert (p.experiment.data.paths, p.experiment.data.tokenizer) == ([str(workdir / "d1")], str(workdir / "tok"))
