"""models/sdpa_attention.py on CPU: the fused-SDPA core attention used without Transformer Engine computes what
Megatron-Core's attention defines (causal softmax(QK^T * scale) V with grouped KV heads), against an explicit
fp32 reference, and drops into the local layer spec."""

from __future__ import annotations

import math

import pytest
import torch


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[s, b, heads|groups, d] inputs -> [s, b, heads * d], written out step by step."""
    s, b, h, d = q.shape
    rep = h // k.size(2)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v).reshape(s, b, h * d)


@pytest.mark.parametrize("heads,groups", [(8, 8), (8, 2), (4, 1)])
def test_sdpa_matches_causal_attention(model_parallel: None, heads: int, groups: int) -> None:
    from megatron.core.transformer.enums import AttnMaskType

    from mcorekit.models.megatron import transformer_config
    from mcorekit.models.sdpa_attention import SDPAttention
    from mcorekit.models.spec import resolve

    spec = resolve("llama-tiny", None, {"num_attention_heads": heads, "num_query_groups": groups, "kv_channels": 16,
                                        "hidden_size": heads * 16})
    attn = SDPAttention(transformer_config(spec, cpu_init=True), layer_number=1, attn_mask_type=AttnMaskType.causal,
                        attention_type="self").eval()
    g = torch.Generator().manual_seed(heads + groups)
    q = torch.randn(24, 3, heads, 16, generator=g)
    k, v = (torch.randn(24, 3, groups, 16, generator=g) for _ in range(2))
    out = attn(q, k, v, attention_mask=None)
    assert out.shape == (24, 3, heads * 16)
    torch.testing.assert_close(out, reference(q, k, v), rtol=1e-5, atol=1e-5)
    # a change in a later token must not reach an earlier position (causal)
    k2 = k.clone()
    k2[-1] += 1
    torch.testing.assert_close(attn(q, k2, v, attention_mask=None)[:-1], out[:-1])


def test_local_spec_uses_sdpa() -> None:
    from mcorekit.models.megatron import layer_spec
    from mcorekit.models.sdpa_attention import SDPAttention
    from mcorekit.models.spec import resolve

    for preset in ("llama-tiny", "mixtral-tiny"):
        spec = layer_spec(resolve(preset, None, {}), use_te=False)
        assert spec.submodules.self_attention.submodules.core_attention is SDPAttention
