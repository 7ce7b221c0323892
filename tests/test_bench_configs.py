"""bench/post_bench.py on a CPU: every case's experiment file passes the project's loader and rules and its data
builds as planned (--dry), and the GPU path (runs, metrics, checkpoint sizes, table, results.json) works with a
stand-in for the training process, so the one GPU run cannot fail on a config key or on the bench's own code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import post_bench  # noqa: E402

from mcorekit.config.experiment import load_experiment  # noqa: E402
import megatron.core  # noqa: E402,F401  its first import runs `git rev-parse` through subprocess.run, which these tests replace

STEPS = 4


def test_dry_run_checks_every_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert post_bench.main(["--dry", "--steps", str(STEPS), "--out", str(tmp_path / "out"),
                            "--work", str(tmp_path / "work")]) == 0
    printed = capsys.readouterr().out
    for name, case in post_bench.CASES.items():
        assert f"{name}: " in printed and f"ok: {STEPS * post_bench.MICRO_BATCHES} rows, 100.0% full" in printed
        exp = load_experiment(tmp_path / "out" / name / "config.yaml")
        assert (exp.model.preset, exp.precision.dtype, exp.data.kind) == ("llama-0.9b", "bf16", case.kind)
        assert (exp.data.seq_length, exp.data.packing, exp.schedule.micro_batch_size) == (2048, True, 1)
        assert exp.dpo.reference == (case.reference or "live")
        if case.lora:
            lora = exp.peft.lora
            assert (lora.rank, lora.target_modules) == (16, ["qkv", "proj", "fc1", "fc2"])
            assert exp.checkpoint.load == str(tmp_path / "work" / "ckpt-sft-full") and exp.checkpoint.finetune
        else:
            assert exp.peft.lora is None and exp.checkpoint.load is None
    assert post_bench.trainable_params("sft-full") == 889_260_032
    assert post_bench.trainable_params("dpo-lora") == 16 * 598_016  # rank 16 on qkv, proj, fc1, fc2 of 16 layers


def test_a_config_that_breaks_a_rule_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = post_bench.write_config

    def broken(name: str, *args: Any) -> Path:
        path = real(name, *args)
        cfg = yaml.safe_load(path.read_text())
        cfg["schedule"]["micro_batch_size"] = 2  # packing needs 1
        path.write_text(yaml.safe_dump(cfg))
        return path

    monkeypatch.setattr(post_bench, "write_config", broken)
    monkeypatch.setattr(post_bench.subprocess, "run", lambda *a, **k: pytest.fail("trained despite a broken config"))
    assert post_bench.main(["--cases", "dpo-live", "--steps", str(STEPS), "--out", str(tmp_path / "out"),
                            "--work", str(tmp_path / "work")]) == 1


def fake_training(fail: set[str]) -> Any:
    """Stands in for `python -m mcorekit.train`: metrics.jsonl rows as train/loop.py's StepLog writes them and a
    checkpoint (tracker + iteration folder) where the config puts it."""
    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        assert cmd[1:3] == ["-m", "mcorekit.train"] and kwargs["cwd"] != Path.cwd()
        cfg = yaml.safe_load(Path(cmd[cmd.index("--config") + 1]).read_text())
        run_dir = Path(cmd[cmd.index("--run-dir") + 1])
        if cfg["name"].removeprefix("post-") in fail:
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nRuntimeError: CUDA out of memory\n")
        steps, lora = cfg["schedule"]["train_iters"], "peft" in cfg
        with open(run_dir / "metrics.jsonl", "w") as f:
            for step in range(2, steps + 1, 2):
                f.write(json.dumps({"step": step, "loss": 10.0 - step / 10, "tokens_per_s": 1000.0 * step,
                                    "step_s": 0.5 / step, "mem_gb": 5.0 if lora else 20.0 + step}) + "\n")
        root = Path(cfg["checkpoint"]["dir"])
        (root / f"iter_{steps:07d}").mkdir(parents=True)
        (root / f"iter_{steps:07d}" / "shard").write_bytes(b"x" * (10 if lora else 1000))
        (root / "latest_checkpointed_iteration.txt").write_text(str(steps))
        return subprocess.CompletedProcess(cmd, 0, "step 2/4 ...\n", "")
    return run


def test_the_gpu_path_with_a_stand_in_for_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(post_bench.subprocess, "run", fake_training(fail={"dpo-lora"}))
    out, work = tmp_path / "out", tmp_path / "work"
    assert post_bench.main(["--steps", str(STEPS), "--out", str(out), "--work", str(work)]) == 1  # one case failed
    results = {r["case"]: r for r in json.loads((out / "results.json").read_text())}
    assert list(results) == list(post_bench.CASES)
    full = results["sft-full"]
    assert full["tokens_per_s"] == 4000.0 and full["step_s"] == 0.5 / 4  # the interval after the first, as logged
    assert full["mem_gb"] == 24.0 and full["ckpt_bytes"] == 1000 + 1 and full["first_interval_s"] == 2 * 0.5 / 2
    assert full["sequences_per_s"] == 8 / (0.5 / 4) and full["first_interval_extra_s"] == 0.5 - 2 * 0.125
    assert results["sft-lora"]["ckpt_bytes"] == 10 + 1 and results["sft-lora"]["mem_gb"] == 5.0
    assert "pairs_per_s" in results["dpo-live"] and "CUDA out of memory" in results["dpo-lora"]["error"]
    assert not list(work.glob("ckpt-*"))  # every checkpoint deleted once measured (the LoRA base at the end)
    table = capsys.readouterr().out
    assert "| sft-lora | 4.0k | 0.125 | 5.0 | 9.6M | 0.0 MB | 1.00x | 0.21x |" in table
    assert "| dpo-lora | failed: RuntimeError: CUDA out of memory |" in table


def test_lora_cases_need_the_base_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(post_bench.subprocess, "run", fake_training(fail=set()))
    out = tmp_path / "out"
    assert post_bench.main(["--cases", "sft-lora", "--steps", str(STEPS), "--out", str(out),
                            "--work", str(tmp_path / "work")]) == 1
    (row,) = json.loads((out / "results.json").read_text())
    assert "no sft-full checkpoint" in row["error"]
