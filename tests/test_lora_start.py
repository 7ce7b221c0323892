"""peft.lora.load (train/lora.adapter_start, called by train/build.py _load_lora_start and launch/plan.check): the
adapters' lora.json, written by `mcorekit convert hf-to-mcore --lora` from an adapter that `peft` itself saved, must
agree with the run's peft.lora (rank, alpha, targets), else the run would scale them by its own alpha / rank. The GPU
loads (checkpoint.load_base / load_adapters) are stubbed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mcorekit.config.experiment import load_experiment
from mcorekit.convert import lora, pipeline
from mcorekit.errors import ConfigError
from mcorekit.train import build, checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from test_lora import peft_adapter, tiny_hf  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base checkpoint, adapter checkpoint root): a PEFT adapter r=8, alpha=8 on q, k, v, o, converted."""
    d = tmp_path_factory.mktemp("start")
    hf = tiny_hf("llama", d / "hf")
    pipeline.hf_to_mcore(hf, d / "base", quiet=True)
    lora.peft_to_mcore(hf, peft_adapter(hf, d / "peft", ["q_proj", "k_proj", "v_proj", "o_proj"], r=8, alpha=8.0),
                       d / "adapter")
    return d / "base", d / "adapter"


def start(base: Path, adapters: Path, *overrides: str, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Run _load_lora_start with the loads stubbed; returns the path load_adapters was given."""
    loaded: list[Path] = []
    monkeypatch.setattr(checkpoint, "load_base", lambda path, chunks: None)
    monkeypatch.setattr(checkpoint, "load_adapters", lambda path, chunks: loaded.append(path))
    exp = load_experiment("examples/llama-tiny.yaml", [f"checkpoint.load={base}", f"peft.lora.load={adapters}",
                                                       *overrides])
    build._load_lora_start(exp, [])
    return loaded


def test_adapter_alpha_differs(converted: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit's case: rank 8 and the default alpha 32 would scale the r=8, alpha=8 adapter 4x."""
    base, adapters = converted
    with pytest.raises(ConfigError) as e:
        start(base, adapters, "peft.lora.rank=8", "peft.lora.target_modules=[qkv,proj]", monkeypatch=monkeypatch)
    msg = str(e.value)
    assert "\n" not in msg and "alpha 8.0" in msg and "peft.lora.alpha=32.0" in msg, msg
    assert "set peft.lora.alpha=8.0" in msg and "peft.lora.rank=" not in msg, msg  # the rank agrees


def test_adapter_rank_and_targets_differ(converted: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    base, adapters = converted
    with pytest.raises(ConfigError) as e:
        start(base, adapters, "peft.lora.alpha=8", monkeypatch=monkeypatch)  # rank 16, all four targets
    msg = str(e.value)
    assert "\n" not in msg and "rank 8" in msg and "peft.lora.rank=16" in msg, msg
    assert "set peft.lora.rank=8" in msg and "peft.lora.target_modules=[qkv,proj]" in msg, msg


def test_matching_adapter_loads_from_its_iteration(converted: tuple[Path, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    base, adapters = converted
    args = ("peft.lora.rank=8", "peft.lora.alpha=8", "peft.lora.target_modules=[proj,qkv]")  # order does not matter
    assert start(base, adapters, *args, monkeypatch=monkeypatch) == [adapters / "release"]
    assert start(base, adapters / "release", *args, monkeypatch=monkeypatch) == [adapters / "release"]


def test_adapter_without_lora_json(converted: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    base, _ = converted
    with pytest.raises(ConfigError) as e:  # a full checkpoint (no lora.json), not adapters
        start(base, base, "peft.lora.rank=8", "peft.lora.alpha=8", monkeypatch=monkeypatch)
    msg = str(e.value)
    assert "\n" not in msg and "lora.json" in msg and str(base / "release") in msg, msg


def test_the_launcher_refuses_such_adapters_before_queueing(converted: tuple[Path, Path], tmp_path: Path) -> None:
    """launch/plan.check: the same one line, before anything is submitted (a dry run here)."""
    from test_launch_options import run

    base, adapters = converted
    launch = ("launch", "--config", "examples/llama-tiny.yaml", "--dry-run", f"checkpoint.load={base}",
              "checkpoint.finetune=true", f"peft.lora.load={adapters}", "peft.lora.target_modules=[qkv,proj]",
              "peft.lora.rank=8")
    code, out, err = run(*launch)
    assert code == 2 and err.startswith("mcorekit: error: ") and err.count("\n") == 1, err
    assert "the adapters have alpha 8.0" in err and "set peft.lora.alpha=8.0" in err, err
    code, out, err = run(*launch, "peft.lora.alpha=8")
    assert code == 0, err
