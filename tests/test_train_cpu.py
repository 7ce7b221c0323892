"""train/ on CPU: the FLOP formula against hand-computed values (dense and MoE), and refusal of unbuilt options."""

from __future__ import annotations

import pytest

from mcorekit.models.spec import ModelSpec
from mcorekit.train.flops import train_flops_per_token


def test_dense_by_hand() -> None:
    # 1 layer, hidden 4, 2 heads of 2 (q = 4), 1 KV group (kv = 2), ffn 8, vocab 10, seq 6
    spec = ModelSpec("llama", 1, 4, 2, 1, 2, 8, 10)
    attn_proj = 4 * 4 + 2 * 4 * 2 + 4 * 4  # Q + K,V (GQA) + O = 48
    attn_core = 2 * 6 * 4 * 0.5  # QK^T + AV, causal half = 24
    mlp = 3 * 4 * 8  # SwiGLU: gate, up, down = 96
    logits = 4 * 10  # 40
    assert train_flops_per_token(spec, 6) == 6 * (attn_proj + attn_core + mlp + logits)


def test_moe_counts_active_experts() -> None:
    spec = ModelSpec("mixtral", 2, 4, 2, 2, 2, 8, 10, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=6)
    per_layer = (4 * 4 + 2 * 4 * 4 + 4 * 4) + 2 * 6 * 4 * 0.5 + (2 * 3 * 4 * 6 + 4 * 8)
    assert train_flops_per_token(spec, 6) == pytest.approx(6 * (2 * per_layer + 4 * 10))


def test_benchmark_shape_matches_the_6n_rule_of_thumb() -> None:
    from mcorekit.models.spec import PRESETS

    spec = PRESETS["llama-0.9b"]
    f = train_flops_per_token(spec, 2048)
    n = spec.num_parameters() - spec.vocab_size * spec.hidden_size  # the input embedding does no matmul
    assert 6 * n < f < 6 * n * 1.2  # attention over 2048 tokens adds ~10%


def test_train_refuses_options_it_does_not_implement() -> None:
    from mcorekit.errors import NotBuiltError
    from mcorekit.launch.config import load_experiment
    from mcorekit.train.build import refuse_unbuilt

    refuse_unbuilt(load_experiment("examples/llama-tiny.yaml"))  # the defaults are all built
    with pytest.raises(NotBuiltError, match="data.kind=indexed.*checkpoint.async_save=true"):
        refuse_unbuilt(load_experiment("examples/llama-tiny.yaml", ["data.kind=indexed", "checkpoint.async_save=true"]))
