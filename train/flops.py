"""Training FLOPs per token, Megatron's way: every matmul counted (2 FLOPs per multiply-add, x3 for forward +
backward), causal attention halved, MoE counted by the experts a token is routed to (and its shared expert), GQA by
its real K/V size, SwiGLU as three projections, and the output layer. Also what the newer families change: multi-latent
attention (DeepSeek-V2/V3) by its low-rank projections and head sizes, the first-k dense layers of an MoE model with
the dense MLP, and sliding-window layers (GPT-OSS) by the keys a query actually sees."""

from __future__ import annotations

from mcorekit.models.spec import ModelSpec


def attended_keys(seq_len: int, window: int | None) -> float:
    """Keys a query sees on average, counted as Megatron does for causal attention (half the sequence); a sliding
    window of w keys caps it: queries past the first w see w keys, the first w see half of w on average."""
    if not window or window >= seq_len:
        return 0.5 * seq_len
    return (0.5 * window * window + (seq_len - window) * window) / seq_len


def attention_macs(spec: ModelSpec, keys: float) -> float:
    """Projections plus QK^T and attention x V of one layer, per token, over `keys` attended keys."""
    H, heads = spec.hidden_size, spec.num_attention_heads
    if spec.is_mla:
        qk = (spec.qk_head_dim or 0) + (spec.qk_pos_emb_head_dim or 0)
        v, kv_rank, rope = spec.v_head_dim or 0, spec.kv_lora_rank or 0, spec.qk_pos_emb_head_dim or 0
        q_proj = H * spec.q_lora_rank + spec.q_lora_rank * heads * qk if spec.q_lora_rank else H * heads * qk
        kv_proj = H * (kv_rank + rope) + kv_rank * heads * ((spec.qk_head_dim or 0) + v)
        return q_proj + kv_proj + heads * v * H + keys * heads * (qk + v)
    q, kv = heads * spec.kv_channels, spec.num_query_groups * spec.kv_channels
    return H * q + 2 * H * kv + q * H + keys * 2 * q  # Q, K, V, output projection; QK^T and AV


def mlp_macs(spec: ModelSpec, moe: bool) -> float:
    H = spec.hidden_size
    if not moe:
        return 3 * H * spec.ffn_hidden_size
    f = spec.moe_ffn_hidden_size or spec.ffn_hidden_size
    out = spec.moe_router_topk * 3 * H * f + H * spec.num_experts  # routed experts + router
    return out + 3 * H * (spec.moe_shared_expert_ffn_hidden_size or 0) + (H if spec.moe_shared_expert_gate else 0)


def macs_per_token(spec: ModelSpec, seq_len: int, padded_vocab: int | None = None) -> float:
    """Forward multiply-adds per token."""
    moe_layers = set(spec.moe_layers())
    total = 0.0
    for layer in range(spec.num_layers):
        windowed = spec.sliding_window and (spec.window_layers is None or spec.window_layers[layer])
        total += attention_macs(spec, attended_keys(seq_len, spec.sliding_window if windowed else None))
        total += mlp_macs(spec, layer in moe_layers)
    return total + spec.hidden_size * (padded_vocab or spec.vocab_size)


def train_flops_per_token(spec: ModelSpec, seq_len: int, padded_vocab: int | None = None) -> float:
    return 6.0 * macs_per_token(spec, seq_len, padded_vocab)
