"""train/metrics.ExpertLoad on Megatron-Core's own MoE model (CPU, one gloo rank): tokens routed per expert and
layer, named as the metrics name them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_lora_moe import deepseek  # noqa: F401  # a fixture: a tiny DeepSeek-V3 in HF format


def test_expert_load_names_multi_token_prediction_routers_apart(deepseek: Path, model_parallel: None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """train/metrics.ExpertLoad on Megatron-Core's DeepSeek-V3 with one MTP layer (CPU, one gloo rank): the MTP
    layer's router numbers its layer 1 again; its tokens are `mtp_1`, not added to decoder layer 1."""
    import dataclasses

    from mcorekit.models.megatron import build_gpt, padded_vocab_size, transformer_config
    from mcorekit.models.spec import from_hf_config, load_hf_config
    from mcorekit.train.metrics import ExpertLoad

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # the router's expert-bias buffer
    spec = dataclasses.replace(from_hf_config(load_hf_config(deepseek)), mtp_layers=1)
    cfg = transformer_config(spec, cpu_init=True, moe_token_dispatcher_type="allgather")
    model = build_gpt(spec, cfg, padded_vocab_size(spec.vocab_size, 128), use_te=False).train()
    wrapped = torch.nn.Module()  # the loop's chunks are wrapped (DDP, Float16Module): module.mtp.layers.0...
    wrapped.module = model
    load = ExpertLoad([wrapped], sequence_parallel=False)
    tokens = torch.randint(0, spec.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens, torch.arange(8).expand(2, 8), attention_mask=None, labels=tokens, loss_mask=torch.ones(2, 8))
    out = load.read_and_reset()
    assert list(out["expert_tokens"]) == ["2", "3", "mtp_1"]  # layer 1 is dense
    assert all(sum(row) == 16 * spec.moe_router_topk for row in out["expert_tokens"].values())
