"""On the GPU machine: DeepSeek-V3-tiny and GPT-OSS-tiny (tests/hf_models.py shapes, vocabulary 512 for the mock
data) converted from HF, trained by train/ with `model.hf_config` and the TE layer spec: the first step's loss is
transformers' loss on the same batch (fp32), and a few bf16 steps from the converted weights train (finite,
falling loss). Same subprocess driver as tests/test_gpu_train.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from hf_models import DEEPSEEK_V3, GPT_OSS
from mcorekit.convert import pipeline
from test_gpu_train import BASE, hf_step_losses, run

pytestmark = pytest.mark.gpu

CONFIGS = {
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**{**DEEPSEEK_V3, "vocab_size": 512, "max_position_embeddings": 512}),
    "gpt_oss": lambda: transformers.GptOssConfig(**{**GPT_OSS, "vocab_size": 512, "max_position_embeddings": 512,
                                                    "sliding_window": 64, "swiglu_limit": 7.0}),
}


def converted(tmp: Path, name: str) -> torch.nn.Module:
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
