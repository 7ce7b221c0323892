"""bench/start_save.py on a CPU: its experiment files pass the project's loader and rules (--dry), and its GPU path
(dd, the save run, the resumed async run, the parsing of their lines, the table and results.json) works with a
stand-in for the training process, so the one GPU run cannot fail on a config key or on the bench's own code. Also
train/metrics.py's start-up phases (what the bench reads)."""

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
import results  # noqa: E402
import start_save  # noqa: E402

from mcorekit.config.experiment import load_experiment  # noqa: E402


def test_dry_run_writes_valid_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert start_save.main(["--dry", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count(" ok (llama-3b") == 2
    save, run = (load_experiment(tmp_path / f"3b-{r}" / "config.yaml") for r in ("save", "async"))
    assert (save.schedule.train_iters, save.checkpoint.async_save, save.logging.log_interval) == (6, False, 1)
    assert (run.schedule.train_iters, run.checkpoint.async_save, run.checkpoint.save_interval) == (24, True, 12)
    # the async run continues from the save run's checkpoint as a run of its own: the save run resumed with another
    # schedule.train_iters would be refused (train/run_inputs.py)
    assert save.checkpoint.dir == run.checkpoint.load == str(tmp_path / "3b-ckpt") and not run.checkpoint.finetune
    assert run.checkpoint.dir == str(tmp_path / "3b-ckpt-async")
    assert save.checkpoint.keep_last == 1 and save.schedule.global_batch_size == 32


def fake_training(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """Stands in for dd and for `python -m mcorekit.train` / the async worker: the lines and files they write."""
    if cmd[0] == "dd":
        if (out := next((a[3:] for a in cmd if a.startswith("of=")), None)) not in (None, "/dev/null"):
            Path(out).write_bytes(b"0" * 1024)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    if cmd[1].endswith("load_probe.py"):  # its real run: tests/test_checkpoint_reader.py
        assert (Path(cmd[2]).name, cmd[3:]) == ("iter_0000006", ["--device", "cuda"])
        got = {"records": 9, "gb": 35.0, **{f"{k}_gb_per_s": v for k, v in
                                            (("pread", 1.5), ("view", 900.0), ("copy", 6.0), ("torch_load", 2.2))}}
        return subprocess.CompletedProcess(cmd, 0, "35 GB ...\nRESULT " + json.dumps(got) + "\n", "")
    config = Path(cmd[cmd.index("--config") + 1])
    run_dir = Path(cmd[cmd.index("--run-dir") + 1])
    cfg = yaml.safe_load(config.read_text())
    ckpt, steps = Path(cfg["checkpoint"]["dir"]), cfg["schedule"]["train_iters"]
    tokens = cfg["schedule"]["global_batch_size"] * 2048
    lines, rows = [], []

    def saved(step: int, seconds: float, asynchronous: bool) -> str:
        (ckpt / f"iter_{step:07d}").mkdir(parents=True, exist_ok=True)
        (ckpt / f"iter_{step:07d}" / "__0_0.distcp").write_bytes(b"0" * 4096)
        return "mcorekit.train: checkpoint " + json.dumps(
            {"event": "saved", "step": step, "async": asynchronous, "seconds": seconds, "gb": 35.0,
             "gb_per_s": 35.0 / seconds, "end": time.time() - 1.0})

    def step(n: int, seconds: float) -> str:
        rows.append({"step": n, "loss": 10.0, "tokens_per_s": tokens / seconds})
        return f"step {n}/{steps} loss 10 tokens_per_s {tokens / seconds:.4g}"

    if not cfg["checkpoint"]["async_save"]:
        lines += ["mcorekit.train: startup " + json.dumps({"imports": 5.0, "dist_init": 7.0, "model": 12.0,
                                                           "optimizer": 13.0, "resume": 13.1, "step1": 20.0}),
                  "[rank0]:I1202 10:00:01.250000 7 torch/_dynamo/symbolic_convert.py:5320] [0/0] Step 1: "
                  "torchdynamo start tracing swiglu /site/megatron/core/fusions/fused_bias_swiglu.py:15",
                  "[rank0]:I1202 10:00:03.000000 7 torch/_dynamo/output_graph.py:2665] [0/0] Step 2: "
                  "done compiler function inductor",
                  step(1, 7.0), step(2, 3.0), step(3, 4.0), step(4, 2.0), step(5, 2.0), step(6, 2.0),
                  saved(6, 20.0, False)]  # steps 1-3: the step graph's warm-up and capture
        end = json.loads(lines[-1].split(" ", 2)[2])["end"]  # then the exit path's marks, as train/shutdown.shut_down
        lines.append("mcorekit.train: shutdown " + json.dumps({"trained": end + 0.2, "host_cache_released": end + 0.7,
                                                               "ranks_through": end + 0.8,
                                                               "exit_handlers": end + 0.85}))
    else:
        assert "-c" in cmd and "load_then_delete" in cmd[cmd.index("-c") + 1]  # the worker keeps one checkpoint
        import shutil

        shutil.rmtree(cfg["checkpoint"]["load"])
        lines += ["bench: deleted the loaded checkpoint in 0.50 s",
                  "mcorekit.train: startup " + json.dumps({"imports": 5.0, "dist_init": 7.0, "model": 12.0,
                                                           "optimizer": 13.0, "resume": 30.5, "step1": 35.0}),
                  step(7, 6.0), step(8, 3.0), step(9, 4.0), step(10, 2.0), step(11, 2.0), step(12, 2.0),
                  "mcorekit.train: checkpoint " + json.dumps({"event": "scheduled", "step": 12, "blocking_s": 1.5}),
                  step(13, 2.1), step(14, 2.3), saved(12, 9.0, True),  # the steps' times leave the 1.5 s out
                  "bench: deleted the saved checkpoint of step 12 in 1.00 s",  # in the finalize, at step 15's start
                  step(15, 3.0), *(step(n, 2.0) for n in range(16, 25)),
                  "mcorekit.train: checkpoint " + json.dumps({"event": "scheduled", "step": 24, "blocking_s": 1.5}),
                  saved(24, 18.0, True), "bench: deleted the saved checkpoint of step 24 in 0.40 s"]
        end = json.loads(lines[-2].split(" ", 2)[2])["end"]  # the bench's deletion ran after the report, then shut_down
        lines.append("mcorekit.train: shutdown " + json.dumps({"trained": end + 0.6, "host_cache_released": end + 0.9,
                                                               "ranks_through": end + 0.9,
                                                               "exit_handlers": end + 0.95}))
        shutil.rmtree(ckpt)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return subprocess.CompletedProcess(cmd, 0, "\n".join(lines) + "\n", "")


def test_gpu_path_with_a_stand_in_for_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(start_save.subprocess, "run", fake_training)
    assert start_save.main(["--out", str(tmp_path)]) == 0
    [r] = json.loads((tmp_path / "results.json").read_text())
    assert r["save"]["phases"] == {"imports": 5.0, "dist_init": 2.0, "model": 5.0, "optimizer": 1.0, "resume": 0.1,
                                   "step1": 6.9}
    assert (r["save"]["save_s"], r["save"]["ckpt_gb"], r["save"]["step_s"]) == (20.0, 35.0, 2.0)
    assert r["save"]["compile_s"] == {"swiglu": 1.75} and r["async"]["compile_total_s"] == 0.0
    assert r["save"]["exit_after_save_s"] >= 1.0
    ex = r["save"]["exit_phases"]
    assert (ex["close"], ex["host_cache"], ex["barrier"], ex["exit_handlers"]) == (0.2, 0.5, 0.1, 0.05)
    assert ex["exit"] >= 0.1
    ax = r["async"]["exit_phases"]  # less the bench's own 0.4 s deletion of the final checkpoint
    assert r["async"]["bench_delete_final_s"] == 0.4
    assert (ax["close"], ax["host_cache"], ax["barrier"], ax["exit_handlers"]) == (0.2, 0.3, 0.0, 0.05)
    assert r["async"]["exit_after_final_save_s"] == pytest.approx(1.0 - 0.4, abs=0.3)
    a = r["async"]
    assert a["load_s"] == 17.0 and r["load_gb_per_s"] == round(35.0 / 17.0, 3)  # resume minus the bench's delete
    assert a["steps_in_flight"] == [13, 14] and a["step_s_in_flight"] == pytest.approx(2.2, abs=1e-3)
    # step 15 less the bench's 1.0 s deletion of the step-12 checkpoint
    assert a["step_s_free"] == pytest.approx(2.0) and a["async_blocking_s"] == 1.5 and a["final_save_s"] == 18.0
    assert not (tmp_path / "3b-ckpt").exists() and not (tmp_path / "3b-ckpt-async").exists()
    assert not (tmp_path / "dd.bin").exists()
    table = capsys.readouterr().out
    assert "| save (sync, end of run), s | 20.0 |" in table and "(steps [13, 14])" in table
    assert "| step s without a save in flight (async run) | 2.00 |" in table
    assert "| step s without a save (save run, steps 4-6) | 2.00 |" in table


def test_a_failed_save_run_stops_before_the_async_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        if cmd[0] == "dd":
            return fake_training(cmd)
        assert "-c" not in cmd, "the async run started after the save run failed"
        dynamo = "".join(f"[rank0]:I1205 15:04:11.699000 1371 torch/_dynamo/utils.py:910] timer {i} 0.0839\n"
                         for i in range(100))  # TORCH_LOGS lines, printed at exit, after the error
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nRuntimeError: CUDA out of memory\n" + dynamo)

    monkeypatch.setattr(start_save.subprocess, "run", failing)
    assert start_save.main(["--out", str(tmp_path)]) == 1
    [r] = json.loads((tmp_path / "results.json").read_text())
    assert "CUDA out of memory" in r["save"]["error"] and "async" not in r
    assert "_dynamo" not in r["save"]["error"]


def test_startup_phases_are_seconds_since_the_process_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from mcorekit.train import metrics

    now = time.time()
    assert now - 3600 < metrics.process_start() <= now  # this pytest process began before this test
    s = metrics.Startup()
    for phase in ("imports", "dist_init", "model", "optimizer", "resume"):
        s.mark(phase)
    monkeypatch.setattr(metrics.dist, "get_rank", lambda: 0)
    s.report(tmp_path)
    written = json.loads((tmp_path / metrics.Startup.FILE).read_text())
    assert list(written) == ["imports", "dist_init", "model", "optimizer", "resume", "step1"]
    assert written["step1"] >= written["imports"] > 0
    assert capsys.readouterr().out.startswith("mcorekit.train: startup {")


def test_compile_seconds_from_torchs_dynamo_lines() -> None:
    """The dynamo lines of a real run (the dense 3B bf16 process of 2026-12-02, TORCH_LOGS=dynamo, its compile cache
    cold; docs/results/dense-3b-1gpu-2026-12-02): each function's start-tracing to done-compiling seconds."""
    log = (Path(__file__).parent.parent / "docs" / "results" / "dense-3b-1gpu-2026-12-02" / "dense-3b-bf16-1gpu.log")
    got = results.compile_seconds(log.read_text())
    assert got == {"swiglu": 2.84, "calculate_logits_max": 0.45, "calculate_predicted_logits": 1.77,
                   "calculate_cross_entropy_loss": 0.57, "calculate_gradients": 0.88, "swiglu_back": 0.49}
    assert results.compile_seconds("step 1/10 loss 11.0\n") == {}
    recompiled = ("I1202 23:59:00.000000 1 a.py:1] [0/0] Step 1: torchdynamo start tracing f x.py:1\n"
                  "I1202 23:59:01.500000 1 b.py:2] [0/0] Step 2: done compiler function inductor\n"
                  "I1202 23:59:02.000000 1 a.py:1] [0/1] Step 1: torchdynamo start tracing f x.py:1\n"
                  "I1202 23:59:02.250000 1 b.py:2] [0/1] Step 2: done compiler function inductor\n")
    assert results.compile_seconds(recompiled) == {"f": 0.25}


def test_compile_env_keeps_every_kernel_cache_in_the_runs_folder(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A bench's training process finds the torch.compile, CUDA driver and Triton caches in the folder it is given
    (empty: a cold start), not in the user's home, whatever the environment says."""
    monkeypatch.setenv("CUDA_CACHE_PATH", "/users/own/nv")
    monkeypatch.setenv("CUDA_CACHE_DISABLE", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own/triton")
    env = results.compile_env(29000, tmp_path / "cache")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")
    assert env["CUDA_CACHE_PATH"] == str(tmp_path / "cache" / "cuda") and "CUDA_CACHE_DISABLE" not in env
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    assert env["MASTER_PORT"] == "29000" and env["TORCH_LOGS"] == "dynamo"


def test_the_load_probe_part_runs_between_the_save_and_the_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(start_save.subprocess, "run", fake_training)
    assert start_save.main(["--out", str(tmp_path), "--load-probe"]) == 0
    [r] = json.loads((tmp_path / "results.json").read_text())
    assert list(r)[:6] == ["shape", "preset", "dd", "save", "probe", "async"]
    assert r["probe"]["pread_gb_per_s"] == 1.5 and r["probe"]["records"] == 9
    assert "| 1.50 / 900.00 / 6.00 / 2.20 |" in capsys.readouterr().out


def test_a_failed_load_probe_fails_the_bench_and_the_resume_still_runs(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def probe_fails(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        if cmd[1].endswith("load_probe.py"):
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nOSError: the disk went away")
        return fake_training(cmd)

    monkeypatch.setattr(start_save.subprocess, "run", probe_fails)
    assert start_save.main(["--out", str(tmp_path), "--load-probe"]) == 1
    [r] = json.loads((tmp_path / "results.json").read_text())
    assert "the disk went away" in r["probe"]["error"] and r["async"]["load_s"] == 17.0



def test_a_deletion_is_taken_from_the_step_that_finalized_the_save() -> None:
    """The loop finalizes an async save in its poll before a step: that step carries the bench's deletion of the
    checkpoint, with steps in flight or none (a save finalized at once)."""
    def saved(n: int) -> tuple[str, dict]:
        return "checkpoint", {"event": "saved", "step": n}

    scheduled = ("checkpoint", {"event": "scheduled", "step": 12})
    assert start_save.deletions([("step", 12), scheduled, ("step", 13), saved(12), ("step", 14)], {12: 8.0}, 24) == {
        ("step", 14): 8.0}
    assert start_save.deletions([("step", 12), scheduled, saved(12), ("step", 13)], {12: 8.0}, 24) == {
        ("step", 13): 8.0}
    assert start_save.in_flight_steps([("step", 12), scheduled, saved(12), ("step", 13)], 12) == set()
    # the end-of-run save's deletion comes after the run's last step: in no step
    assert start_save.deletions([("step", 24), saved(24)], {24: 8.0}, 24) == {}
