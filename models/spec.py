"""One description of a model, read from an HF config or a named preset; train/, convert/ and launch/ all use it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mcorekit.errors import ModelError

# HF model_type -> our architecture name. Each has one mapping in convert/.
SUPPORTED_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int  # head dim; not always hidden / heads (Qwen3)
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_layernorm: bool = False
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_norm_topk_prob: bool = True  # Mixtral always renormalises the top-k; Qwen3-MoE says in its config
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def num_parameters(self) -> int:
        """Parameter count (embeddings and output layer included, untied counted once)."""
        h, kv = self.hidden_size, self.kv_channels
        attn = h * (self.num_attention_heads + 2 * self.num_query_groups) * kv + self.num_attention_heads * kv * h
        if self.qkv_bias:
            attn += (self.num_attention_heads + 2 * self.num_query_groups) * kv
        if self.is_moe:
            ffn = self.num_experts * 3 * h * (self.moe_ffn_hidden_size or self.ffn_hidden_size) + h * self.num_experts
        else:
            ffn = 3 * h * self.ffn_hidden_size
        per_layer = attn + ffn + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h


def from_hf_config(config: dict[str, Any]) -> ModelSpec:
    """Build a spec from an HF config.json dict; unknown architectures fail with the supported list."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"unsupported architecture model_type={model_type!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    rope = config.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_scaling = config.get("rope_scaling")
    if rope.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in ("llama3", "default", None):
        raise ModelError(f"unsupported rope scaling {rope_scaling!r}; supported: llama3")
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    moe_ffn = config.get("moe_intermediate_size") if model_type == "qwen3_moe" else config.get("intermediate_size")
    return ModelSpec(
        architecture=SUPPORTED_ARCHITECTURES[model_type],
        num_layers=config["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or hidden // heads,
        ffn_hidden_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        norm_epsilon=config.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        num_experts=num_experts if model_type in ("mixtral", "qwen3_moe") else None,
        moe_router_topk=config.get("num_experts_per_tok", 2),
        moe_ffn_hidden_size=moe_ffn if model_type in ("mixtral", "qwen3_moe") else None,
        moe_norm_topk_prob=True if model_type == "mixtral" else bool(config.get("norm_topk_prob", True)),
    )


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Read config.json from an HF directory or a file."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ModelError(f"no HF config at {p}; pass an HF model directory or its config.json")
    return json.loads(p.read_text())


# Named presets: the benchmark shapes of docs/ and tiny shapes for tests and the demo.
PRESETS: dict[str, ModelSpec] = {
    "llama-tiny": ModelSpec("llama", 4, 64, 4, 2, 16, 176, 256),
    "llama-0.9b": ModelSpec("llama", 16, 2048, 16, 8, 128, 5632, 32768, max_position_embeddings=4096),
    "llama-3b": ModelSpec("llama", 24, 3072, 24, 8, 128, 8192, 32768, max_position_embeddings=4096),
    "mixtral-tiny": ModelSpec("mixtral", 4, 64, 4, 2, 16, 128, 256, num_experts=4, moe_ffn_hidden_size=128),
    "moe-8x-1.4b": ModelSpec(
        "mixtral", 16, 2048, 16, 8, 128, 1408, 32768, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1408
    ),
}


def resolve(preset: str | None = None, hf_config: str | None = None, overrides: dict[str, Any] | None = None) -> ModelSpec:
    """The model of an experiment: a preset or an HF config, then field overrides (e.g. num_layers)."""
    if (preset is None) == (hf_config is None):
        raise ModelError("give exactly one of model.preset or model.hf_config")
    if preset is not None:
        if preset not in PRESETS:
            import difflib

            hint = difflib.get_close_matches(preset, PRESETS, n=1)
            raise ModelError(
                f"unknown model preset {preset!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
                + f" (presets: {', '.join(PRESETS)})"
            )
        spec = PRESETS[preset]
    else:
        spec = from_hf_config(load_hf_config(hf_config))
    if overrides:
        fields = spec.to_dict()
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ModelError(f"unknown model fields {unknown}; known: {', '.join(sorted(fields))}")
        fields.update(overrides)
        spec = ModelSpec(**fields)
    return spec
