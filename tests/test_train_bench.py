"""bench/train_bench.py on a CPU: every shape's experiment file passes the project's loader and rules for one GPU,
with the shape's sequence length and micro-batch, so a GPU run cannot fail on a config key. In bf16: Megatron-Core
checks MoE FP8 against the installed Transformer Engine, which this machine has not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import train_bench  # noqa: E402

from mcorekit.config.experiment import load_experiment  # noqa: E402
from mcorekit.config.rules import Nodes, problems  # noqa: E402


@pytest.mark.parametrize("shape, preset, seq, mbs", [("dense", "llama-0.9b", 2048, 8), ("moe", "moe-8x-1.4b", 2048, 4),
                                                     ("dense-3b", "llama-3b", 4096, 2)])
def test_each_shape_writes_a_valid_experiment(tmp_path: Path, shape: str, preset: str, seq: int, mbs: int) -> None:
    exp = load_experiment(train_bench.write_config(shape, "bf16", 12, tmp_path / shape))
    assert problems(exp, 1, Nodes(transformer_engine=True, gpus=True, capability=(9, 0))) == []  # an H200
    assert (exp.model.preset, exp.data.seq_length, exp.schedule.micro_batch_size) == (preset, seq, mbs)
    assert exp.schedule.global_batch_size == mbs * train_bench.MICRO_BATCHES and exp.precision.fp8 is None
