"""The dry run says what each task runs (issue 17): the command its pickled payload amounts to, and each sweep
point's values."""

from __future__ import annotations

import io
import re
import shlex
from contextlib import redirect_stdout
from pathlib import Path

from mcorekit.cli import main
from mcorekit.launch import api
from mcorekit.train.job import TrainJob

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "examples" / "llama-tiny.yaml")


def dry_run(*args: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([*args, "--dry-run"]) == 0
    return out.getvalue()


def test_train_dry_run_shows_the_payloads_command(tmp_path: Path) -> None:
    text = dry_run("launch", "--config", TINY, "--set", f"run_root={tmp_path}", "--set", "python=/opt/venv/bin/python")
    [shown] = re.findall(r"^# each task runs: (.*)$", text, re.M)
    [in_script] = re.findall(r"^# each task runs \(as submitit's pickled payload\): (.*)$", text, re.M)
    assert shown == in_script
    argv = shlex.split(shown)
    run = Path(argv[argv.index("--run-dir") + 1])
    assert argv[:4] == ["/opt/venv/bin/python", "-m", "mcorekit.train", "--config"] and run.parent == tmp_path
    payload = api.training_payload(run)  # what submit_prepared pickles for this run folder
    assert isinstance(payload, TrainJob)
    assert argv[4] == payload.config_path and argv[6] == payload.run_dir
    assert f"#SBATCH --output={run}/logs/%j_0_log.out" in text


def test_sweep_dry_run_shows_each_points_values_and_command(tmp_path: Path) -> None:
    text = dry_run("launch", "sweep", "--config", TINY, "--set", f"run_root={tmp_path}", "--grid", "optimizer.lr=1e-4,3e-4",
                   "--grid", "schedule.micro_batch_size=1,2")
    points = re.findall(r"^# point (\d): (.*) -> (.*)$", text, re.M)
    assert [(i, values) for i, values, _ in points] == [
        ("0", "optimizer.lr=0.0001 schedule.micro_batch_size=1"), ("1", "optimizer.lr=0.0001 schedule.micro_batch_size=2"),
        ("2", "optimizer.lr=0.0003 schedule.micro_batch_size=1"), ("3", "optimizer.lr=0.0003 schedule.micro_batch_size=2")]
    sweep = Path(points[0][2]).parent
    assert [Path(p) for _, _, p in points] == [sweep / f"point-{i}" for i in range(4)]
    assert (f"-m mcorekit.train --config {sweep}/point-$SLURM_ARRAY_TASK_ID/config.yaml --run-dir "
            f"{sweep}/point-$SLURM_ARRAY_TASK_ID") in text


def test_chain_dry_run_names_each_stages_command(tmp_path: Path) -> None:
    text = dry_run("launch", "chain", "--config", TINY, "--set", f"run_root={tmp_path}", "--hf-out", str(tmp_path / "hf"))
    stages = dict(re.findall(r"^# stage (\S+): (.*)$", text, re.M))
    assert stages["llama-tiny-train"].split()[1:3] == ["-m", "mcorekit.train"]
    run = Path(shlex.split(stages["llama-tiny-train"])[-1])
    assert shlex.split(stages["llama-tiny-convert"])[1:] == ["-m", "mcorekit", "convert", "mcore-to-hf",
                                                             str(run / "checkpoints"), str(tmp_path / "hf")]
