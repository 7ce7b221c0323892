"""`mcorekit status` rows for a sweep's array tasks while some still pend: sacct lists those only as one range line
(200_[1-2%1]), under the array's own id, never under the task's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcorekit.launch import accounting, jobs_cli


def test_pending_sweep_points_show_pending_not_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = {"200_0": "RUNNING", "200_[1-2%1]": "PENDING"}  # what the accounting holds for array 200

    def sacct(ids: list[str]) -> dict[str, accounting.JobRecord]:  # as sacct -j answers: a task id never finds a range
        keys = [k for k in held if k in ids or k.split("_")[0] in ids]
        return {k: accounting.JobRecord(k, "sw-sweep", held[k], "0:0", "00:00:01", 0) for k in keys}

    monkeypatch.setattr(accounting, "sacct", sacct)
    (tmp_path / "jobs.jsonl").write_text("".join(
        json.dumps({"job_id": f"200_{i}", "name": "sw", "kind": "sweep", "run_dir": str(tmp_path / "sw"),
                    "point_dir": str(tmp_path / "sw" / f"point-{i}")}) + "\n" for i in range(3)))
    rows = jobs_cli.status_rows(tmp_path, 10)
    assert [(r["job"], r["state"]) for r in rows] == [("200_0", "RUNNING"), ("200_1", "PENDING"), ("200_2", "PENDING")]
