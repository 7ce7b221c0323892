"""Core attention for the spec without Transformer Engine: PyTorch's fused scaled_dot_product_attention
(FlashAttention / memory-efficient kernels) instead of Megatron-Core's local DotProductAttention, which
materialises the [b, heads, s, s] score matrix and trains at about half the speed of HF's SDPA path.

Same constructor, inputs and output layout as DotProductAttention, so it drops into the local layer spec:
query [sq, b, heads, d], key/value [sk, b, groups, d] -> context [sq, b, heads * d]."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any) -> None:
        """k_channels / v_channels: multi-latent attention's q/k and v head sizes (TE's attention takes them,
        Megatron-Core's local one does not); the softmax scale then comes from MLA itself."""
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Any = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences need Transformer Engine's attention (data.packing with TE)")
        if attention_bias is not None:
            raise NotImplementedError("attention bias is not supported by SDPAttention")
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None
        if attention_mask is not None:  # Megatron's masks are True where attention is *not* allowed
            mask = ~attention_mask
        # [s, b, h, d] -> [b, h, s, d]; enable_gqa lets the kernel share each KV group among its query heads
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.attention_dropout.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                             scale=self.softmax_scale, enable_gqa=k.size(1) != q.size(1))
        sq, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
