"""One description of a model, read from an HF config or a named preset; train/, convert/ and launch/ all use it.

Which HF model types exist and which config fields each reads is said by its family (models/families/, one file
each); this file holds the description itself and the fields every decoder family reads the same way."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mcorekit.errors import ModelError
from mcorekit.options import MAX_INT


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # the family (models/families/<architecture>.py)
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
    moe_shared_expert_ffn_hidden_size: int | None = None  # a shared expert every token passes through (Qwen2-MoE)
    moe_shared_expert_gate: bool = False  # its output scaled by sigmoid(x @ gate), a [1, hidden] weight
    # DeepSeek-V3 routing: sigmoid scores, a per-expert bias that only picks the experts (e_score_correction_bias,
    # Megatron's expert_bias), group-limited top-k, and the routed weights scaled by a factor
    moe_router_score_function: str = "softmax"
    moe_router_expert_bias: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_first_k_dense: int = 0  # the first k layers have a dense MLP (ffn_hidden_size), the rest experts
    # Multi-latent attention (DeepSeek-V2/V3), set when kv_lora_rank is: q_lora_rank None means q is one projection
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None  # per-head q/k size without rope (HF qk_nope_head_dim)
    qk_pos_emb_head_dim: int | None = None  # per-head q/k size with rope (HF qk_rope_head_dim)
    v_head_dim: int | None = None
    # GPT-OSS: biases on every linear (o_proj, router, experts; q/k/v by qkv_bias), a learned softmax sink per head,
    # sliding-window attention on the layers window_layers marks 1, and the clamped SwiGLU
    # (up + 1) * g * sigmoid(1.702 g) with g = min(gate, limit), up clamped to +-limit (activation "gpt_oss")
    linear_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int | None = None
    window_layers: tuple[int, ...] | None = None
    activation: str = "silu"
    glu_clamp: float | None = None
    # Multi-token prediction (DeepSeek-V3): Megatron-Core's MTP block of this many layers after the decoder, its
    # loss scaled by mtp_loss_scale (mtp_loss_scaling_factor). 0: not built (training's default: set
    # model.overrides.mtp_layers); a conversion sets it to the MTP layers the checkpoint holds.
    mtp_layers: int = 0
    mtp_loss_scale: float = 0.1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def is_mla(self) -> bool:
        return bool(self.kv_lora_rank)

    def moe_layers(self) -> range:
        """The layers with experts (every layer of an MoE model but the first moe_first_k_dense). Ranges, not lists:
        a config may claim a billion layers, which is found out by comparing it with the weights."""
        return range(self.moe_first_k_dense, self.num_layers) if self.is_moe else range(0)

    def dense_layers(self) -> range:
        return range(self.moe_first_k_dense if self.is_moe else self.num_layers)

    @property
    def per_layer_keys(self) -> bool:
        """Megatron-Core stores a model whose layers differ (dense and MoE layers) with one key per layer,
        `decoder.layers.<global layer>.<name>`, instead of layer-stacked keys (TransformerBlock's
        non_homogeneous_layers, set by a list moe_layer_freq)."""
        return self.is_moe and self.moe_first_k_dense > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def num_parameters(self) -> int:
        """Parameter count (embeddings and output layer included, untied counted once)."""
        h, kv = self.hidden_size, self.kv_channels
        heads = self.num_attention_heads
        if self.is_mla:
            qk = (self.qk_head_dim or 0) + (self.qk_pos_emb_head_dim or 0)
            q = h * heads * qk if not self.q_lora_rank else self.q_lora_rank * (h + 1 + heads * qk)
            attn = q + h * (self.kv_lora_rank + (self.qk_pos_emb_head_dim or 0)) + self.kv_lora_rank
            attn += self.kv_lora_rank * heads * ((self.qk_head_dim or 0) + (self.v_head_dim or 0))
            attn += heads * (self.v_head_dim or 0) * h
        else:
            attn = h * (heads + 2 * self.num_query_groups) * kv + heads * kv * h
            if self.qkv_bias:
                attn += (heads + 2 * self.num_query_groups) * kv
        dense = 3 * h * self.ffn_hidden_size
        moe = 0
        if self.is_moe:
            moe = self.num_experts * 3 * h * (self.moe_ffn_hidden_size or self.ffn_hidden_size) + h * self.num_experts
            moe += 3 * h * (self.moe_shared_expert_ffn_hidden_size or 0) + (h if self.moe_shared_expert_gate else 0)
        layers = self.num_layers * (attn + 2 * h) + len(self.moe_layers()) * moe + len(self.dense_layers()) * dense
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + emb + h


def from_hf_config(config: dict[str, Any]) -> ModelSpec:
    """Build a spec from an HF config.json dict with the family of its model_type; unknown model types fail with
    the supported list."""
    from mcorekit.models import registry

    return registry.for_config(config).read(config)


def decoder_fields(config: dict[str, Any], rope_types: tuple[str, ...] = ("llama3",)) -> dict[str, Any]:
    """The ModelSpec fields every decoder family reads from the same HF config fields (a family adds its own);
    `rope_types`: the rope scalings the family's Megatron model implements."""
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    rope = config.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_scaling = config.get("rope_scaling")
    if rope.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (*rope_types, "default", None):
        raise ModelError(f"unsupported rope scaling {rope_scaling!r}; supported: {', '.join(rope_types)}")
    return dict(
        num_layers=config["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or hidden // heads,
        ffn_hidden_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_position_embeddings=config.get("max_position_embeddings") or 4096,  # null: as absent
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        norm_epsilon=config.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


MAX_ELEMENTS = 2**60  # in one tensor: its bytes stay within int64 (torch's sizes) at up to 8 bytes an element
DECODER_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")
# Switches the families read: a JSON string would read as true in Python ("false" included), so only true/false
FLAGS = ("tie_word_embeddings", "attention_bias", "qkv_bias", "mlp_bias", "norm_topk_prob", "use_sliding_window",
         "rope_interleave")


def _positive(v: object) -> bool:
    return type(v) is int and 0 < v <= MAX_INT


def _size_problem(key: str, v: object, need: str) -> str:
    if type(v) is int and v > MAX_INT:  # beyond any model; torch's int64 sizes overflow on products of such
        return f"{key}={str(v)[:24]}{'...' if len(str(v)) > 24 else ''} (larger than {MAX_INT}, the largest size read)"
    return f"{key}={v!r} ({need})"


def number_or(value: Any, default: float) -> Any:
    """An HF config's optional number: the default where it is absent or null, a float where it is a number, else
    the value as given, which models/spec_checks.model_problems names (a list read as 1.0 would go unseen)."""
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return value
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float: infinite, which model_problems refuses
        return float("inf")


def size_problems(config: dict[str, Any], required: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> list[str]:
    """HF config sizes that are not integers from 1 to MAX_INT (`optional` ones may also be missing or null)."""
    out = [_size_problem(k, config.get(k), "needs a positive integer") for k in required
           if not _positive(config.get(k))]
    return out + [_size_problem(k, config[k], "needs a positive integer or null") for k in optional
                  if config.get(k) is not None and not _positive(config[k])]


def topk_problems(topk: object, experts: object) -> list[str]:
    """num_experts_per_tok must pick from 1 to all of the experts (an expert count that is bad is reported as such)."""
    if not _positive(experts) or (type(topk) is int and 1 <= topk <= experts):
        return []
    return [f"num_experts_per_tok={topk!r} (needs an integer from 1 to the number of experts, {experts})"]


def decoder_field_problems(config: dict[str, Any]) -> list[str]:
    """What makes the fields decoder_fields reads unusable (types, sizes, divisibility), before any is used."""
    out = size_problems(config, DECODER_SIZES, OPTIONAL_SIZES)
    out += [f"{k}={config[k]!r} (needs true or false, a JSON boolean)" for k in FLAGS
            if k in config and type(config[k]) is not bool]
    rope = config.get("rope_parameters")
    numbers = {k: config[k] for k in ("rms_norm_eps", "rope_theta") if config.get(k) is not None}
    if isinstance(rope, dict) and rope.get("rope_theta") is not None:
        numbers["rope_parameters.rope_theta"] = rope["rope_theta"]
    out += [f"{k}={v!r} (needs a positive number)" for k, v in numbers.items()
            if type(v) not in (int, float) or not 0 < v < math.inf]  # NaN fails too
    if out:
        return out
    heads, groups = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % groups:
        out.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    if not config.get("head_dim") and config["hidden_size"] % heads:
        out.append(f"hidden_size={config['hidden_size']} is not a multiple of num_attention_heads={heads} (and no head_dim)")
    hidden = config["hidden_size"]
    qkv = (heads + 2 * groups) * (config.get("head_dim") or hidden // heads)
    largest = {"vocab_size * hidden_size": config["vocab_size"] * hidden,
               "2 * intermediate_size * hidden_size": 2 * config["intermediate_size"] * hidden,
               "(num_attention_heads + 2 * num_key_value_heads) * head_dim * hidden_size": qkv * hidden}
    return out + [f"{k} = {v} (more than {MAX_ELEMENTS} elements in one tensor)" for k, v in largest.items()
                  if v > MAX_ELEMENTS]


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


def resolve(preset: str | None = None, hf_config: str | None = None, overrides: dict[str, Any] | None = None,
            config: Any = None) -> ModelSpec:
    """The model of an experiment: a preset or an HF config, then field overrides (e.g. num_layers). `config`:
    hf_config's config.json when the caller has parsed it already."""
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
        spec = from_hf_config(config if config is not None else load_hf_config(hf_config))
    if overrides:
        fields = spec.to_dict()
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ModelError(f"unknown model fields {unknown}; known: {', '.join(sorted(fields))}")
        fields.update(overrides)
        spec = ModelSpec(**fields)
    return spec
