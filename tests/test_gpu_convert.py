"""On the GPU machine: HF logits vs the Megatron model (train/'s, TE spec) loaded from our conversion."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_models import make_model
from mcorekit.convert import pipeline

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["llama", "llama3", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_megatron_logits_match_hf(tmp_path: Path, name: str, tied: bool) -> None:
    from mcorekit.convert.logits import verify_logits

    hf = make_model(name, tied, tmp_path / "hf")
    pipeline.hf_to_mcore(hf, tmp_path / "mcore", quiet=True)
    report = verify_logits(hf, tmp_path / "mcore")
    print(f"{name} tied={tied}: {report.line()}")
    assert report.top1_agreement == 1.0 and report.cosine >= 0.9999, report.line()
