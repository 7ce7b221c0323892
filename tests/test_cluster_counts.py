"""Counts (nodes, GPUs, tasks, CPUs, restarts, memory, seconds, the layout, batch sizes, steps, lengths) are whole
numbers, never booleans: pydantic's lax mode read `resources.nodes=true` as --nodes=1 and `gpus_per_node=false` as a
CPU-only cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcorekit.config.cluster import load_profile
from mcorekit.config.experiment import load_experiment
from mcorekit.errors import ConfigError

TINY = Path(__file__).resolve().parent.parent / "examples" / "llama-tiny.yaml"


@pytest.mark.parametrize("override", ["gpus_per_node=true", "gpus_per_node=false", "tasks_per_node=true",
                                      "cpus_per_task=true", "mem_per_gpu_gb=true", "cpu_mem_gb=true",
                                      "signal_seconds=true", "cpus_per_task=2.0"])
def test_profile_counts_refuse_booleans(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_profile("example-h100", [override])


@pytest.mark.parametrize("override", ["resources.nodes=true", "resources.max_restarts=false", "resources.nodes=1.0",
                                      "parallel.tp=true", "parallel.vpp=true", "schedule.train_iters=1e3",
                                      "schedule.micro_batch_size=true", "data.seq_length=2048.0",
                                      "checkpoint.keep_last=true", "peft.lora.rank=true"])
def test_experiment_resource_counts_refuse_booleans(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[1]):
        load_experiment(TINY, [override])


def test_whole_numbers_still_load() -> None:
    assert load_profile("example-h100", ["gpus_per_node=4", "cpus_per_task=2"]).gpus_per_node == 4
    assert load_experiment(TINY, ["resources.nodes=2", "resources.max_restarts=0"]).resources.nodes == 2
