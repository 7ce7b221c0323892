"""bench/async_save.py on a CPU: its experiment file passes the project's loader and rules (--dry), and its GPU path
(two training processes, the host one with the bench's staging patch, the parsing of their lines, the table and
results.json) works with a stand-in for the training process, so the one GPU run cannot fail on the bench's code."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import async_save  # noqa: E402
import start_save  # noqa: E402

from mcorekit.config.experiment import load_experiment  # noqa: E402


def test_dry_run_writes_a_valid_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert async_save.main(["--dry", "--out", str(tmp_path), "--steps", "25", "--every", "10"]) == 0
    assert " ok (llama-3b, 25 steps, async_save=True, save_interval=10)" in capsys.readouterr().out
    exp = load_experiment(tmp_path / "3b-dry" / "config.yaml")
    assert exp.checkpoint.dir == str(tmp_path / "3b-dry-ckpt") and exp.logging.log_interval == 1
    with pytest.raises(SystemExit):
        async_save.main(["--dry", "--out", str(tmp_path), "--every", "3"])


WORKERS: list[str] = []


def fake_training(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """Stands in for the bench's worker (--steps 25 --every 8): async saves at steps 8, 16 and 24, the end-of-run
    save at 25; staged on the GPU unless the worker carries the bench's host-staging patch. The save of step 8 is
    finalized in the poll before step 11 (its deletion, 9 s, in that step), the save of 16 while the save of 24
    waits for it (the deletion in that wait), the save of 24 while the end-of-run save waits for it (likewise)."""
    worker = cmd[cmd.index("-c") + 1]
    WORKERS.append(worker)
    host = worker.startswith(async_save.HOST_STAGING) and "finalize_then_delete" in worker
    run_dir = Path(cmd[cmd.index("--run-dir") + 1])
    cfg = yaml.safe_load(Path(cmd[cmd.index("--config") + 1]).read_text())
    assert not Path(cfg["checkpoint"]["dir"]).exists()  # a fresh start
    assert (cfg["schedule"]["train_iters"], cfg["checkpoint"]["save_interval"]) == (25, 8)
    tokens, staged = cfg["schedule"]["global_batch_size"] * 2048, "host" if host else "gpu"
    blocking = 14.0 if host else 0.3
    lines, rows = [], []

    def step(n: int, seconds: float) -> None:
        rows.append({"step": n, "loss": 10.0, "tokens_per_s": tokens / seconds, "mem_gb": 70.0 if host else 107.0})
        lines.append(f"step {n}/25 loss 10")

    def checkpoint(**e: Any) -> None:
        lines.append("mcorekit.train: checkpoint " + json.dumps({"gb": 36.6, "gb_per_s": 1.5, **e}))

    def saved(n: int, **e: Any) -> None:
        checkpoint(event="saved", step=n, seconds=20.0, **e)
        lines.append(f"bench: deleted the saved checkpoint of step {n} in 9.00 s")

    # the loop's step times leave each save out, its blocking part and its wait for the previous write (the save of
    # 24 waited 4 s for the write of 16, and 9 s for the deletion of its checkpoint) included: train/loop.py
    step_s = {1: 8.0, 2: 3.0, 3: 4.0, 11: 2.0 + 9.0}
    for n in range(1, 26):
        if n == 11:
            saved(8, waited_for_previous_s=0.0)
        step(n, step_s.get(n, 2.0))
        if n in (8, 16, 24):
            if n == 24:
                saved(16, waited_for_previous_s=0.0)
            checkpoint(event="scheduled", step=n, blocking_s=blocking, staged_on=staged,
                       waited_for_previous_s=9.0 + 4.0 if n == 24 else 0.0)
    saved(24, waited_for_previous_s=13.0)
    end = time.time() - 3.0
    lines.pop()  # the end-of-run save's line comes first, then the bench deletes that checkpoint
    checkpoint(event="saved", step=25, seconds=18.0, waited_for_previous_s=9.0 + 5.5, end=end)
    lines.append("bench: deleted the saved checkpoint of step 24 in 9.00 s")
    lines.append("bench: deleted the saved checkpoint of step 25 in 0.40 s")
    lines.append("mcorekit.train: shutdown " + json.dumps({"trained": end + 0.6, "host_cache_released": end + 0.9,
                                                           "ranks_through": end + 0.9, "exit_handlers": end + 0.95}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return subprocess.CompletedProcess(cmd, 0, "\n".join(lines) + "\n", "")


def test_gpu_path_with_a_stand_in_for_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(start_save.subprocess, "run", fake_training)
    WORKERS.clear()
    assert async_save.main(["--out", str(tmp_path), "--every", "8", "--staging", "gpu,host,gpu-nohint"]) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert list(r) == ["gpu", "host", "gpu-nohint"] and r["gpu-nohint"]["saves"][0]["staged_on"] == "gpu"
    assert [w.removesuffix(start_save.WORKER) for w in WORKERS] == ["", async_save.HOST_STAGING,
                                                                    async_save.STAGINGS["gpu-nohint"]]
    for name, blocking in (("gpu", 0.3), ("host", 14.0)):
        got = r[name]
        assert [(s["step"], s["staged_on"], s["blocking_s"], s["waited_for_previous_s"]) for s in got["saves"]] == [
            (8, name, blocking, 0.0), (16, name, blocking, 0.0), (24, name, blocking, 4.0)]  # less the deletion
        assert got["step_s_free"] == pytest.approx(2.0)  # step 11 less the deletion of 8's checkpoint
        assert got["step_s_in_flight"] == pytest.approx(2.0)  # 9-10, 17-24, 25
        assert (got["final_save_s"], got["final_waited_for_previous_s"]) == (18.0, 5.5)
        assert got["exit_after_final_save_s"] == pytest.approx(3.0 - 0.4, abs=0.3)  # less the bench's deletion
        assert got["peak_mem_gb"] == (107.0 if name == "gpu" else 70.0)
    table = capsys.readouterr().out
    assert "| | gpu run | host run | gpu-nohint run |" in table and "|   loop blocked, s | 0.3 | 14.0 | 0.3 |" in table
    assert "|   staged on | gpu | host | gpu |" in table
    assert not list(tmp_path.glob("*-ckpt"))


def test_the_8conn_staging_gives_the_training_process_eight_cuda_connections() -> None:
    """The gpu-8conn patch runs in the training process before CUDA starts, in an environment that says 1."""
    import os
    import subprocess
    import sys

    code = async_save.STAGINGS["gpu-8conn"] + "import os; print(os.environ['CUDA_DEVICE_MAX_CONNECTIONS'])"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "8"
