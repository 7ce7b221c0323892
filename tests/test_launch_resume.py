"""`launch --resume RUN_DIR` refuses while a job of that run folder has not ended, a chain's stages included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
