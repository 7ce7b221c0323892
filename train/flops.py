"""Training FLOPs per token, Megatron's way: every matmul counted (2 FLOPs per multiply-add, x3 for forward +
backward), causal attention halved, MoE counted by the experts a token is routed to (and its shared expert), GQA by its real K/V size,
SwiGLU as three projections, and the output layer."""

from __future__ import annotations

from mcorekit.models.spec import ModelSpec


def macs_per_token(spec: ModelSpec, seq_len: int, padded_vocab: int | None = None) -> float:
    """Forward multiply-adds per token."""
    H, d = spec.hidden_size, spec.kv_channels
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    attn_proj = H * q + 2 * H * kv + q * H  # Q, K, V, output projection
    attn_core = 2 * seq_len * q * 0.5  # QK^T and attention x V over the sequence, causal: half of it
    if spec.is_moe:
        f = spec.moe_ffn_hidden_size or spec.ffn_hidden_size
        mlp = spec.moe_router_topk * 3 * H * f + H * spec.num_experts  # routed experts + router
        mlp += 3 * H * (spec.moe_shared_expert_ffn_hidden_size or 0) + (H if spec.moe_shared_expert_gate else 0)
    else:
        mlp = 3 * H * spec.ffn_hidden_size
    logits = H * (padded_vocab or spec.vocab_size)
    return spec.num_layers * (attn_proj + attn_core + mlp) + logits


def train_flops_per_token(spec: ModelSpec, seq_len: int, padded_vocab: int | None = None) -> float:
    return 6.0 * macs_per_token(spec, seq_len, padded_vocab)
