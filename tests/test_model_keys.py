"""The converter's checkpoint has exactly the tensors (keys and global shapes) of the model train/ builds,
at each layout (with virtual pipeline stages: one model chunk per stage, as train/build.py builds them). Built on CPU with Megatron-Core itself, one gloo process per rank (GPUs are not needed to
construct the model; the non-TE spec stands in for TE, which has the same tensor keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_models import make_model
from mcorekit.convert import pipeline
from mcorekit.convert.torch_dist import TorchDistReader

HERE = Path(__file__).parent
CASES = [("llama", 1, 1, 1, None), ("qwen2", 2, 1, 1, None), ("qwen3", 2, 2, 1, None), ("mixtral", 1, 2, 2, None),
         ("qwen3_moe", 2, 1, 2, None), ("qwen3_moe", 1, 1, 4, None), ("llama", 1, 2, 1, 2), ("qwen2_moe", 2, 1, 2, None)]


@pytest.mark.parametrize("name,tp,pp,ep,vpp", CASES)
def test_checkpoint_keys_equal_train_model_keys(tmp_path: Path, name: str, tp: int, pp: int, ep: int,
                                                vpp: int | None) -> None:
    hf = make_model(name, tied=False, out=tmp_path / "hf")
    pipeline.hf_to_mcore(hf, tmp_path / "m", tp=tp, pp=pp, ep=ep, vpp=vpp, quiet=True)
    ckpt = {k: list(v.size) for k, v in TorchDistReader(tmp_path / "m/release").tensor_keys().items()}
    env = {**os.environ, "KEYS_PORT": str(29600 + CASES.index((name, tp, pp, ep, vpp))), "PYTHONPATH": str(HERE)}
    proc = subprocess.run([sys.executable, str(HERE / "megatron_keys.py"), str(hf), str(tp), str(pp), str(ep),
                           *([str(vpp)] if vpp else [])],
                          capture_output=True, text=True, env=env, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("KEYS ")), None)
    assert line, proc.stderr[-3000:]
    model = json.loads(line[5:])
    assert model == ckpt
