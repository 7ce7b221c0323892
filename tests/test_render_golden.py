"""The sbatch scripts users will read, pinned as golden files (UPDATE_GOLDEN=1 rewrites them after a reviewed change)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mcorekit.config.cluster import load_profile
from mcorekit.launch.submit import JobSpec, cli_command, render, train_command

GOLDEN = Path(__file__).parent / "golden"


def gpu_profile(*extra: str):
    return load_profile("example-h100", ["python=/opt/venv/bin/python", *extra])


CASES = {
    "single_node_gpu": lambda: (gpu_profile("container={}", "setup=[]", "exclusive=false"),
                                JobSpec(name="llama-8b", run_dir=Path("/runs/llama-8b-1"), nodes=1, time="02:00:00",
                                        task_command=train_command(gpu_profile(), "/runs/llama-8b-1"))),
    "multi_node_gpu": lambda: (gpu_profile("container={}"),
                               JobSpec(name="llama-70b", run_dir=Path("/runs/llama-70b-1"), nodes=4)),
    "container": lambda: (gpu_profile(),
                          JobSpec(name="qwen3-moe", run_dir=Path("/runs/qwen3-moe-1"), nodes=2, time="1-00:00:00")),
    "array": lambda: (gpu_profile("container={}"),
                      JobSpec(name="lr-sweep", run_dir=Path("/runs/lr-sweep-1"), nodes=1, array_size=3, array_parallelism=2,
                              task_command=train_command(gpu_profile(), "/runs/lr-sweep-1", sweep=True))),
    "chain_child_cpu": lambda: (gpu_profile("container={}"),
                                JobSpec(name="convert", run_dir=Path("/runs/chain-1/convert"), gpus_per_node=0,
                                        dependency="afterok:1234",
                                        task_command=cli_command(gpu_profile(), ["convert", "mcore-to-hf",
                                                                                 "/runs/chain-1/checkpoints", "/out/hf"]))),
    "local_cpu": lambda: (load_profile("local", ["python=/opt/venv/bin/python"]),
                          JobSpec(name="smoke", run_dir=Path("/runs/smoke-1"), time="00:05:00")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_sbatch_matches_golden(case: str) -> None:
    profile, spec = CASES[case]()
    text = render(profile, spec)
    path = GOLDEN / f"{case}.sbatch"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"rendered script for {case} changed; review, then UPDATE_GOLDEN=1"


def test_gpu_jobs_are_srun_native_one_task_per_gpu() -> None:
    profile, spec = CASES["multi_node_gpu"]()
    text = render(profile, spec)
    assert "#SBATCH --ntasks-per-node=8" in text and "#SBATCH --gpus-per-node=8" in text and "#SBATCH --nodes=4" in text
    assert "torchrun" not in text and "\nsrun --unbuffered" in text
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text
    assert "#SBATCH --signal=USR2@180" in text


def test_chain_children_end_when_parent_fails() -> None:
    profile, spec = CASES["chain_child_cpu"]()
    text = render(profile, spec)
    assert "#SBATCH --dependency=afterok:1234" in text and "#SBATCH --kill-on-invalid-dep=yes" in text
    assert "--gpus-per-node" not in text and "CUDA_DEVICE_MAX_CONNECTIONS" not in text
