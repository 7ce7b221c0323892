"""The launcher against the real dev cluster: API submission, chains, sweeps as arrays, rejection, shell safety."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
import yaml

from mcorekit.config.cluster import load_profile
from mcorekit.config.experiment import Experiment
from mcorekit.errors import ConfigError
from mcorekit.launch import api
from mcorekit.launch.accounting import wait_final
from mcorekit.launch.smoke import allreduce_check
from mcorekit.launch.submit import JobSpec, submit

pytestmark = pytest.mark.slurm

# Payloads defined here travel by value: the job's Python need not import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

REPO = Path(__file__).resolve().parent.parent


def tiny_experiment(name: str = "test-exp", **sections: dict) -> Experiment:
    data = {"name": name, "model": {"preset": "llama-tiny"}, "data": {"seq_length": 128},
            "schedule": {"micro_batch_size": 1, "global_batch_size": 2}, "resources": {"time": "00:05:00"}}
    data.update(sections)
    return Experiment.model_validate(data)


def local_profile(tmp_path: Path, *overrides: str):
    return load_profile("local", [f"run_root={tmp_path / 'runs'}", *overrides])


def read_lr_of_my_point() -> float:
    """An array task reads the resolved config of its own point."""

    import yaml

    task = os.environ["SLURM_ARRAY_TASK_ID"]
    folder = os.environ["MCK_SWEEP_DIR"]
    return yaml.safe_load(open(f"{folder}/point-{task}/config.yaml"))["optimizer"]["lr"]


def fail_payload() -> None:
    raise RuntimeError("parent fails on purpose")


def ok_payload() -> str:
    return "ok"


def report_env() -> dict:

    return {"weird": os.environ.get("MCK_WEIRD"), "folder": os.environ.get("SUBMITIT_FOLDER")}


def test_api_submission_completes_with_resolved_config_next_to_logs(tmp_path: Path) -> None:
    p = api.prepare(tiny_experiment(), local_profile(tmp_path))
    job = api.submit_prepared(p, payload=allreduce_check, kind="test")
    assert [r["sum"] for r in job.results()] == [3.0, 3.0]
    assert wait_final(job.job_id, 120).state == "COMPLETED"
    saved = yaml.safe_load((p.spec.run_dir / "config.yaml").read_text())
    assert saved["name"] == "test-exp" and saved["model"]["preset"] == "llama-tiny"
    assert (p.spec.run_dir / "cluster.yaml").exists()
    assert any((p.spec.run_dir / "logs").glob(f"{job.job_id}_0_log.out"))


def test_chain_failed_parent_ends_children_and_good_parent_runs_them(tmp_path: Path) -> None:
    profile = local_profile(tmp_path, "tasks_per_node=1")
    bad = api.submit_chain(profile, [api.Stage("c-train", fail_payload, time="00:05:00"),
                                     api.Stage("c-convert", ok_payload, time="00:05:00"),
                                     api.Stage("c-export", ok_payload, time="00:05:00")], tmp_path / "runs" / "bad")
    good = api.submit_chain(profile, [api.Stage("c-train", ok_payload, time="00:05:00"),
                                      api.Stage("c-convert", ok_payload, time="00:05:00")], tmp_path / "runs" / "good")
    assert wait_final(bad[0].job_id, 120).state == "FAILED"
    # Children of a failed parent end (cancelled: dependency never satisfied) instead of pending forever.
    assert wait_final(bad[1].job_id, 60).state == "CANCELLED"
    assert wait_final(bad[2].job_id, 60).state == "CANCELLED"
    assert [wait_final(j.job_id, 120).state for j in good] == ["COMPLETED", "COMPLETED"]
    assert good[1].result() == "ok"

    # `mcorekit status` shows the failure with a diagnosis from the logs; `mcorekit logs` prints the rank's log.
    cli = [sys.executable, "-m", "mcorekit"]
    status = subprocess.run([*cli, "status", "--runs", str(tmp_path / "runs")], capture_output=True, text=True, check=True)
    parent_row = next(line for line in status.stdout.splitlines() if f" {bad[0].job_id} " in line)
    assert "FAILED" in parent_row and "RuntimeError: parent fails on purpose" in parent_row
    assert "CANCELLED" in next(line for line in status.stdout.splitlines() if f" {bad[1].job_id} " in line)
    logs = subprocess.run([*cli, "logs", bad[0].job_id, "--stderr", "--runs", str(tmp_path / "runs")],
                          capture_output=True, text=True, check=True)
    assert "parent fails on purpose" in logs.stdout


def test_sweep_is_one_array_with_distinct_resolved_configs(tmp_path: Path) -> None:
    cfg_path = tmp_path / "exp.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_experiment("sweep").model_dump(mode="json")))
    points, sweep_dir = api.prepare_sweep(cfg_path, "local", {"optimizer.lr": [1e-4, 2e-4, 3e-4]},
                                          profile_overrides=[f"run_root={tmp_path / 'runs'}", "tasks_per_node=1"])
    for p in points:
        p.profile.env["MCK_SWEEP_DIR"] = str(sweep_dir)
    jobs = api.submit_sweep(points, sweep_dir, payloads=[read_lr_of_my_point] * 3, max_parallel=2)
    array_ids = {j.job_id.split("_")[0] for j in jobs}
    assert len(array_ids) == 1  # one array job
    array_id = array_ids.pop()
    assert [j.job_id for j in jobs] == [f"{array_id}_{i}" for i in range(3)]
    assert [j.result() for j in jobs] == [1e-4, 2e-4, 3e-4]
    assert all(wait_final(j.job_id, 120).state == "COMPLETED" for j in jobs)
    configs = [(sweep_dir / f"point-{i}" / "config.yaml").read_text() for i in range(3)]
    assert len(set(configs)) == 3


def _queue() -> set[str]:
    return set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout.split())


@pytest.mark.parametrize("overrides", [["parallel.tp=3"], ["model.preset=mixtral-tiny", "parallel.ep=3"]])
def test_impossible_layout_is_rejected_before_submission(tmp_path: Path, overrides: list[str]) -> None:
    before = _queue()
    proc = subprocess.run([sys.executable, "-m", "mcorekit", "launch", "--config", str(REPO / "examples/llama-tiny.yaml"),
                           "--set", f"run_root={tmp_path}", *overrides], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid layout" in proc.stderr
    assert ("TP=3" in proc.stderr) if "parallel.tp=3" in overrides else ("EP=3 does not divide num_experts=4" in proc.stderr)
    assert _queue() - before == set()
    assert not (tmp_path / "jobs.jsonl").exists()


def test_shell_metacharacters_reach_the_job_unchanged_or_are_rejected(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    weird = f"a'b\"c $(touch {marker}1) `touch {marker}2`; touch {marker}3 & echo \\ * | cat"
    odd_dir = tmp_path / "runs $(touch x) ; `y` & z"
    profile = load_profile("local", [f"run_root={odd_dir}", "tasks_per_node=1"])
    profile.env = {"MCK_WEIRD": weird}
    spec = JobSpec(name="test-shell", run_dir=odd_dir / "job", time="00:05:00")
    job = submit(profile, spec, report_env, kind="test")
    result = job.result()
    assert result["weird"] == weird
    assert result["folder"] == str(odd_dir / "job" / "logs")
    assert wait_final(job.job_id, 120).state == "COMPLETED"
    assert not any(tmp_path.glob("pwned*"))

    # What cannot be quoted safely is refused before sbatch sees it.
    with pytest.raises(ConfigError, match="job name"):
        JobSpec(name="x; touch /tmp/y", run_dir=tmp_path)
    with pytest.raises(ConfigError, match="newline"):
        JobSpec(name="ok", run_dir=tmp_path / "a\nb")
    with pytest.raises(Exception, match="newline"):
        load_profile("local", ["env={X: \"a\\nb\"}"])


def test_convert_and_export_chain_runs_on_the_cluster(tmp_path: Path) -> None:
    """The demo's chain: HF -> Megatron -> HF -> TensorRT-LLM rank files as three afterok jobs, then bitwise verify."""
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "demo_chain.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.count("COMPLETED exit 0:0") == 3
    assert "47 of 47 tensors bitwise equal" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "trtllm").glob("rank*.safetensors")) == ["rank0.safetensors", "rank1.safetensors"]
