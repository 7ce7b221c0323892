"""On the GPU machine: the training loop learns, FP8 and MoE run, save -> signal -> resume reproduces the
uninterrupted losses, and an HF-converted checkpoint starts at the HF model's loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent

BASE = {
    "name": "gpu-test",
    "model": {"preset": "llama-tiny", "overrides": {"hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
                                                    "kv_channels": 32, "ffn_hidden_size": 704, "vocab_size": 512}},
    "data": {"seq_length": 256, "seed": 7},
    "schedule": {"train_iters": 40, "warmup_iters": 4, "micro_batch_size": 4, "global_batch_size": 8},
    "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
    "checkpoint": {"save_interval": 1000, "keep_last": 2},
    "logging": {"log_interval": 1},
}


def run(tmp: Path, name: str, cfg: dict, *extra: str, stop_at: int = 0, expect: int = 0) -> list[dict]:
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, str(HERE / "gpu_train_driver.py"), str(run_dir / "config.yaml"), str(run_dir),
                           str(stop_at), *extra], capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-5000:]
    print(proc.stdout[-1500:])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_bf16(tmp_path: Path) -> None:
    m = run(tmp_path, "bf16", BASE)
    assert len(m) == 40 and m[-1]["loss"] < m[0]["loss"] - 0.5
    assert all(x["tokens_per_s"] > 0 and 0 < x["mfu"] < 1 for x in m)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_trains(tmp_path: Path, recipe: str) -> None:
    m = run(tmp_path, recipe, {**BASE, "precision": {"dtype": "bf16", "fp8": recipe}})
    assert m[-1]["loss"] < m[0]["loss"] - 0.5


def test_moe_grouped_gemm_trains(tmp_path: Path) -> None:
    cfg = {**BASE, "model": {"preset": "mixtral-tiny", "overrides": {"hidden_size": 256, "num_attention_heads": 8,
           "num_query_groups": 4, "kv_channels": 32, "num_experts": 8, "moe_ffn_hidden_size": 256, "vocab_size": 512}},
           "moe": {"grouped_gemm": True, "dispatcher": "alltoall"}}
    m = run(tmp_path, "moe", cfg)
    assert m[-1]["loss"] < m[0]["loss"] - 0.5


def test_signal_save_resume_reproduces_losses(tmp_path: Path) -> None:
    cfg = {**BASE, "schedule": {**BASE["schedule"], "train_iters": 20}}
    full = run(tmp_path, "full", cfg)
    first = run(tmp_path, "interrupted", cfg, stop_at=10, expect=3)  # USR2 after step 10: save at 10, exit
    assert [x["step"] for x in first] == list(range(1, 11))
    ckpts = tmp_path / "interrupted" / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "10"
    resumed = run(tmp_path, "interrupted", cfg)  # same run folder: finds its checkpoint by itself
    after = [x for x in resumed if x["step"] > 10]
    assert [x["step"] for x in after] == list(range(11, 21))
    print("resume losses:", [round(x["loss"], 5) for x in after], "uninterrupted:", [round(x["loss"], 5) for x in full[10:]])
    for a, b in zip(after, full[10:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"]), (a, b)


def test_hf_converted_checkpoint_starts_at_hf_loss(tmp_path: Path) -> None:
    import torch
    import transformers

    from mcorekit.convert import pipeline

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    hf_model.save_pretrained(tmp_path / "hf")
    pipeline.hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", quiet=True)
    cfg = {**BASE, "model": {"hf_config": str(tmp_path / "hf")}, "precision": {"dtype": "fp32"},
           "schedule": {**BASE["schedule"], "train_iters": 1, "warmup_iters": 0}, "checkpoint": {"load": str(tmp_path / "mcore"), "finetune": True}}
    m = run(tmp_path, "ft", cfg)
    from mcorekit.train.data import batches
    from mcorekit.train.data.mock import MockDataset

    batch_iter = batches(MockDataset(7, 512, 256), 4, 0, 0, 1)
    losses = []
    hf_model = hf_model.cuda()
    with torch.no_grad():
        for _ in range(2):  # the step's two micro-batches
            b = next(batch_iter)
            losses.append(hf_model(b["tokens"], labels=None).logits.float().log_softmax(-1).gather(
                -1, b["labels"].unsqueeze(-1)).neg().mean().item())
    hf_loss = sum(losses) / 2
    print(f"megatron first-step loss {m[0]['loss']:.6f}, HF loss on the same batch {hf_loss:.6f}")
    assert abs(m[0]["loss"] - hf_loss) < 1e-3 * hf_loss
