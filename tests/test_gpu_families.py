"""On the GPU machine: DeepSeek-V3-tiny and GPT-OSS-tiny (tests/hf_models.py shapes, vocabulary 512 for the mock
data) converted from HF, trained by train/ with `model.hf_config` and the TE layer spec: the first step's loss is
transformers' loss on the same batch (fp32), the converted checkpoint loaded by train/'s build gives transformers'
logits (tests/gpu_logits_driver.py), a few bf16 steps from the converted weights train (finite, falling loss), and
DeepSeek-V3 with its MTP layer trains Megatron-Core's MTP block (model.overrides.mtp_layers). Same subprocess
driver as tests/test_gpu_train.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from hf_models import DEEPSEEK_V3, GPT_OSS, add_mtp_layer
from mcorekit.convert import pipeline
from test_gpu_train import BASE, hf_step_losses, run

pytestmark = pytest.mark.gpu

CONFIGS = {
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**{**DEEPSEEK_V3, "vocab_size": 512, "max_position_embeddings": 512}),
    "gpt_oss": lambda: transformers.GptOssConfig(**{**GPT_OSS, "vocab_size": 512, "max_position_embeddings": 512,
                                                    "sliding_window": 64, "swiglu_limit": 7.0}),
}


HERE = Path(__file__).parent


def converted(tmp: Path, name: str, mtp: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("bias", "sinks")):
                p.copy_(0.1 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(tmp / "hf")
    (tmp / "hf" / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    if mtp:  # DeepSeek's MTP layer, which transformers does not save
        add_mtp_layer(tmp / "hf")
    pipeline.hf_to_mcore(tmp / "hf", tmp / "mcore", quiet=True)
    return model.eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_converted_family_starts_at_the_hf_loss(tmp_path: Path, name: str) -> None:
    hf_model = converted(tmp_path, name)
    cfg = {**BASE, "model": {"hf_config": str(tmp_path / "hf")}, "precision": {"dtype": "fp32"},
           "schedule": {**BASE["schedule"], "train_iters": 1, "warmup_iters": 0},
           "checkpoint": {"load": str(tmp_path / "mcore"), "finetune": True}}
    m = run(tmp_path, f"{name}-ft", cfg)
    hf_loss = hf_step_losses(hf_model.cuda(), 1)[0]
    print(f"{name}: megatron first-step loss {m[0]['loss']:.6f}, HF loss on the same batch {hf_loss:.6f}")
    assert abs(m[0]["loss"] - hf_loss) < 1e-3 * hf_loss


@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_trains_from_the_converted_checkpoint(tmp_path: Path, name: str) -> None:
    converted(tmp_path, name)
    cfg = {**BASE, "model": {"hf_config": str(tmp_path / "hf")}, "precision": {"dtype": "bf16"},
           "schedule": {**BASE["schedule"], "train_iters": 10, "warmup_iters": 2},
           "checkpoint": {"load": str(tmp_path / "mcore"), "finetune": True}, "moe": {"dispatcher": "alltoall"}}
    m = run(tmp_path, f"{name}-train", cfg)
    losses = [x["loss"] for x in m]
    print(name, "bf16 losses", [round(x, 4) for x in losses])
    assert len(losses) == 10 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_converted_family_gives_the_hf_logits(tmp_path: Path, name: str) -> None:
    """The converted checkpoint loaded by train/'s build (TE layers, one GPU, fp32) gives transformers' logits on
    2 x 256 mock tokens: cosine >= 0.9999, the same top-1 token at >= 99% of the positions (near-ties aside)."""
    converted(tmp_path, name)
    out = tmp_path / "logits"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(29700 + list(CONFIGS).index(name)),
                           str(HERE / "gpu_logits_driver.py"), str(tmp_path / "hf"), str(tmp_path / "mcore"), str(out),
                           "one:", "fp32"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and (out / "one.json").is_file(), proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((out / "one.json").read_text())
    print(name, result)
    assert result["cosine"] >= 0.9999 and result["top1"] >= 0.99, result


def test_deepseek_v3_trains_its_mtp_layer(tmp_path: Path) -> None:
    """DeepSeek-V3-tiny with one MTP layer, converted into Megatron-Core's MTP block and trained 10 bf16 steps with
    model.overrides.mtp_layers=1: the LM loss and the logged mtp_loss are finite and fall, and the checkpoint the
    run writes converts back to HF with the MTP tensors (trained: eh_proj moved) and DeepSeek's names."""
    from mcorekit.convert.hf_io import HFReader

    converted(tmp_path, "deepseek_v3", mtp=True)
    cfg = {**BASE, "model": {"hf_config": str(tmp_path / "hf"), "overrides": {"mtp_layers": 1}},
           "precision": {"dtype": "bf16"}, "schedule": {**BASE["schedule"], "train_iters": 10, "warmup_iters": 2},
           "checkpoint": {"load": str(tmp_path / "mcore"), "finetune": True}, "moe": {"dispatcher": "alltoall"}}
    m = run(tmp_path, "mtp", cfg)
    losses, mtp = [x["loss"] for x in m], [x["mtp_loss"] for x in m]
    print("bf16 losses", [round(x, 4) for x in losses], "mtp losses", [round(x, 4) for x in mtp])
    assert len(losses) == 10 and all(torch.isfinite(torch.tensor(losses + mtp)))
    assert losses[-1] < losses[0] and mtp[-1] < mtp[0]
    pipeline.mcore_to_hf(tmp_path / "mtp/checkpoints", tmp_path / "back", hf_config=str(tmp_path / "hf"), quiet=True)
    before, after = HFReader(tmp_path / "hf"), HFReader(tmp_path / "back")
    mtp_names = {n for n in before.names() if n.startswith("model.layers.4.")}
    assert mtp_names and mtp_names <= set(after.names()) and set(after.names()) == set(before.names())
    assert not torch.equal(after.get("model.layers.4.eh_proj.weight").float(), before.get("model.layers.4.eh_proj.weight").float())
