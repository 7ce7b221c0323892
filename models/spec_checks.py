"""Whether a ModelSpec's fields are sound: a wrong value is a message naming it, not a TypeError deep in the layout
arithmetic or a NaN written into a converted checkpoint's mcorekit.json. ModelSpec is a plain dataclass filled from
presets, HF configs and model.overrides, so its types are checked here, for training (config/rules.py) and for
conversion and export (convert/pipeline.spec_for) alike."""

from __future__ import annotations

from mcorekit.models.registry import families
from mcorekit.models.spec import ModelSpec

_MODEL_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                "ffn_hidden_size", "vocab_size", "max_position_embeddings", "moe_router_topk")
_MODEL_OPTIONAL_SIZES = ("num_experts", "moe_ffn_hidden_size", "moe_shared_expert_ffn_hidden_size", "q_lora_rank",
                         "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "sliding_window",
                         "moe_router_num_groups", "moe_router_group_topk")
_MODEL_COUNTS = ("moe_first_k_dense", "mtp_layers")  # 0 allowed
_MODEL_POSITIVE_FLOATS = ("rope_theta", "norm_epsilon")
_MODEL_OPTIONAL_POSITIVE_FLOATS = ("moe_router_topk_scaling_factor", "glu_clamp")
_MODEL_FLAGS = ("tie_word_embeddings", "qkv_bias", "qk_layernorm", "moe_norm_topk_prob", "moe_shared_expert_gate",
                "moe_router_expert_bias", "linear_bias", "attention_sinks")
_MODEL_CHOICES = {"activation": ("silu", "gpt_oss"), "moe_router_score_function": ("softmax", "sigmoid")}
MAX_MODEL_SIZE = 2**31 - 1  # no size of a real model comes near; larger ones overflow what follows (int32 included)


def shown_value(v: object) -> str:
    """A field's value in a message, cut to a readable length (a 4,000-digit number is possible)."""
    text = repr(v)
    return text if len(text) <= 40 else text[:40] + "..."


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def model_problems(model: ModelSpec) -> list[str]:
    """Each model field of the wrong type or out of range, named with its value (empty when all are sound)."""
    out = []
    for name in _MODEL_SIZES + _MODEL_OPTIONAL_SIZES + _MODEL_COUNTS:
        v, low = getattr(model, name), 0 if name in _MODEL_COUNTS else 1
        if v is None and name in _MODEL_OPTIONAL_SIZES:
            continue
        if not _is_int(v) or not low <= v <= MAX_MODEL_SIZE:
            out.append(f"model {name}={shown_value(v)} must be a whole number from {low} to {MAX_MODEL_SIZE:,}")
    for name in _MODEL_POSITIVE_FLOATS + _MODEL_OPTIONAL_POSITIVE_FLOATS:
        v = getattr(model, name)
        if v is None and name in _MODEL_OPTIONAL_POSITIVE_FLOATS:
            continue
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
            out.append(f"model {name}={v!r} must be a positive number")
    for name in _MODEL_FLAGS:
        if not isinstance(getattr(model, name), bool):
            out.append(f"model {name}={getattr(model, name)!r} must be true or false")
    for name, choices in {**_MODEL_CHOICES, "architecture": tuple(families())}.items():
        if getattr(model, name) not in choices:
            out.append(f"model {name}={getattr(model, name)!r} must be one of {', '.join(choices)}")
    if not (isinstance(model.mtp_loss_scale, (int, float)) and not isinstance(model.mtp_loss_scale, bool)
            and 0 <= model.mtp_loss_scale < float("inf")):
        out.append(f"model mtp_loss_scale={model.mtp_loss_scale!r} must be a number >= 0")
    window = model.window_layers  # Megatron-Core reads entry i for layer i: a longer list (fewer layers) is fine
    if window is not None and not (isinstance(window, (list, tuple)) and all(w in (0, 1) for w in window)
                                   and len(window) >= model.num_layers):
        out.append(f"model window_layers={shown_value(window)} must be null or a 0 or 1 for each layer (1: sliding "
                   f"window)")
    if model.rope_scaling is not None and not isinstance(model.rope_scaling, dict):
        out.append(f"model rope_scaling={model.rope_scaling!r} must be a mapping or null")
    if not isinstance(model.extra, dict):
        out.append(f"model extra={model.extra!r} must be a mapping")
    return out
