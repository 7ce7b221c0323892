"""Tiny random HF models built from transformers configs (no downloads), saved as sharded safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

CONFIGS = {
    "llama": lambda tied: transformers.LlamaConfig(**COMMON, tie_word_embeddings=tied),
    "llama3": lambda tied: transformers.LlamaConfig(**COMMON, tie_word_embeddings=tied, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "qwen2": lambda tied: transformers.Qwen2Config(**COMMON, tie_word_embeddings=tied),
    "qwen3": lambda tied: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=tied),
    "mixtral": lambda tied: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=tied),
    "qwen3_moe": lambda tied: transformers.Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                                          num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=tied),
}
MOE = ("mixtral", "qwen3_moe")


def make_model(name: str, tied: bool, out: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](tied), dtype=torch.bfloat16)
    with torch.no_grad():  # random norms too, so a swapped norm cannot pass as "equal"
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out, max_shard_size="40KB")
    (out / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    return out
