"""Training FLOPs per token, Megatron's way: every matmul counted (2 FLOPs per multiply-add, x3 for forward +
backward), causal attention halved, MoE counted by the experts a token is routed to (and its shared expert), GQA by
its real K/V size, SwiGLU as three projections, and the output layer. Also what the newer families change: multi-latent
attention (DeepSeek-V2/V3) by its low-rank projections and head sizes, the first-k dense layers of an MoE model with
the dense MLP, sliding-window layers (GPT-OSS) by the keys a query actually sees, and multi-token prediction layers
(each a transformer layer, its 2H -> H projection and the output layer again, as Megatron-LM counts them).

Model FLOPs, not hardware FLOPs: recomputed activations are not counted (full recompute does about 4/3 of this work),
and FP8 runs are measured against the bf16 peak. With LoRA the frozen weights get no weight gradient: their matmuls
count 4x (forward, input gradient) instead of 6x, core attention (no weights) 6x, as Megatron-Bridge counts them; the
adapters themselves (under 1% at rank 16 on the 3B shape) are left out. Packed rows (SFT, DPO) count the attention
each example computes within itself (tasks/base.PackedAttention), not the row's full length. Padding counts, as the
GPU computes it (an unpacked row's padding like any position, a packed row's as its own segment): MFU is the FLOPs
spent, Megatron's convention; tokens/s counts real tokens only (tasks/base.RealTokens)."""

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
        return q_proj + kv_proj + heads * v * H + core_attention_macs(spec, keys)
    q, kv = heads * spec.kv_channels, spec.num_query_groups * spec.kv_channels
    return H * q + 2 * H * kv + q * H + core_attention_macs(spec, keys)  # Q, K, V, output projection; QK^T and AV


def mlp_macs(spec: ModelSpec, moe: bool) -> float:
    H = spec.hidden_size
    if not moe:
        return 3 * H * spec.ffn_hidden_size
    f = spec.moe_ffn_hidden_size or spec.ffn_hidden_size
    out = spec.moe_router_topk * 3 * H * f + H * spec.num_experts  # routed experts + router
    return out + 3 * H * (spec.moe_shared_expert_ffn_hidden_size or 0) + (H if spec.moe_shared_expert_gate else 0)


def core_attention_macs(spec: ModelSpec, keys: float) -> float:
    """QK^T and attention x V of one layer per token: the part of attention_macs with no weights."""
    if spec.is_mla:
        return keys * spec.num_attention_heads * ((spec.qk_head_dim or 0) + (spec.qk_pos_emb_head_dim or 0)
                                                  + (spec.v_head_dim or 0))
    return keys * 2 * spec.num_attention_heads * spec.kv_channels


def macs_per_token(spec: ModelSpec, seq_len: int, padded_vocab: int | None = None) -> tuple[float, float]:
    """Forward multiply-adds per token: (all of them, those of core attention)."""
    moe_layers, H = set(spec.moe_layers()), spec.hidden_size
    logits = H * (padded_vocab or spec.vocab_size)
    total, core = logits, 0.0
    for layer in range(spec.num_layers):
        windowed = spec.sliding_window and (spec.window_layers is None or spec.window_layers[layer])
        keys = attended_keys(seq_len, spec.sliding_window if windowed else None)
        total += attention_macs(spec, keys) + mlp_macs(spec, layer in moe_layers)
        core += core_attention_macs(spec, keys)
    keys = attended_keys(seq_len, None)  # an MTP layer: the last layer's kind, over the whole sequence
    mtp = attention_macs(spec, keys) + mlp_macs(spec, spec.num_layers - 1 in moe_layers) + 2 * H * H + logits
    return total + spec.mtp_layers * mtp, core + spec.mtp_layers * core_attention_macs(spec, keys)


def train_flops_per_token(spec: ModelSpec, seq_len: int, padded_vocab: int | None = None,
                          frozen_weights: bool = False, attended: float = 1.0) -> float:
    """x3 for forward and backward (input and weight gradients); frozen_weights (LoRA): weights x2, core attention
    x3 (see the module's docstring). `attended`: the share of full-length causal attention the rows computed (packed
    rows attend within each example: sum of len^2 over rows x seq_len^2)."""
    total, core = macs_per_token(spec, seq_len, padded_vocab)
    return (4.0 if frozen_weights else 6.0) * (total - core) + 6.0 * core * attended
