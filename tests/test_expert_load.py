"""train/metrics.ExpertLoad on Megatron-Core's own MoE model (CPU, one gloo rank): tokens routed per expert and
layer, named as the metrics name them, and the share of routed token-slots a capacity factor dropped."""

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
    assert not {"expert_dropped", "expert_dropped_max", "expert_dropped_per_layer"} & set(out)  # nothing is dropped


def test_tokens_dropped_by_the_capacity_factor_are_reported_per_layer_and_in_all(
        deepseek: Path, model_parallel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With moe.capacity_factor (Megatron-Core's token dropping, as config/megatron.py sets it), the share of routed
    token-slots (tokens x top-k) that the capacity dropped, against Megatron-Core's own routing map before and after
    it applied the capacity (recorded at its apply_router_token_dropping), over two forward passes."""
    from megatron.core.transformer.moe import router

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    seen: list[tuple[int, int]] = []  # (slots routed, slots kept) per router call, in call order
    drop = router.apply_router_token_dropping

    def recorded(probs: torch.Tensor, routing_map: torch.Tensor, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        probs, kept = drop(probs, routing_map, **kw)
        seen.append((int(routing_map.sum()), int(kept.sum())))
        return probs, kept

    monkeypatch.setattr(router, "apply_router_token_dropping", recorded)
    spec, model, load, out, tokens = _two_micro_batches_counted(deepseek, moe_token_dispatcher_type="allgather",
                                                                moe_expert_capacity_factor=0.5,
                                                                moe_pad_expert_input_to_capacity=False)
    layers = ["2", "3", "mtp_1"]  # the routers' call order in a forward pass
    routed = {layer: sum(r for r, _ in seen[i::3]) for i, layer in enumerate(layers)}
    kept = {layer: sum(k for _, k in seen[i::3]) for i, layer in enumerate(layers)}
    assert len(seen) == 6 and all(v == 2 * 16 * spec.moe_router_topk for v in routed.values())
    assert {layer: sum(row) for layer, row in out["expert_tokens"].items()} == kept  # counted after the drop
    want = {layer: 1 - kept[layer] / routed[layer] for layer in layers}
    assert min(want.values()) > 0.2  # half the even share per expert: many slots dropped
    assert out["expert_dropped_per_layer"] == pytest.approx(want, abs=1e-4)
    assert out["expert_dropped_max"] == pytest.approx(max(want.values()))
    assert out["expert_dropped"] == pytest.approx(1 - sum(kept.values()) / sum(routed.values()))
    model(tokens, torch.arange(8).expand(2, 8), attention_mask=None, labels=tokens, loss_mask=torch.ones(2, 8))
    again = load.read_and_reset()  # the counts start again after a read
    assert again["expert_dropped"] == pytest.approx(1 - sum(k for _, k in seen[6:]) / sum(r for r, _ in seen[6:]))


def test_tokens_dropped_with_padding_to_capacity_are_reported(deepseek: Path, model_parallel: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With moe.pad_to_capacity too (moe_pad_expert_input_to_capacity, the alltoall dispatcher's drop-and-pad path):
    the router's map is then the capacity's mask, each expert's column holding exactly its capacity, padding slots
    included; the counts and the dropped share are still the routed slots kept, against Megatron-Core's routing map
    before its apply_router_token_dropping and the one it returns (kept = routed and within the returned map)."""
    from megatron.core.transformer.moe import router, token_dispatcher
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import get_capacity

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per router call: routed, kept, padded map
    drop = router.apply_router_token_dropping

    def recorded(probs: torch.Tensor, routing_map: torch.Tensor, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        probs, out = drop(probs, routing_map, **kw)
        seen.append((routing_map.clone(), routing_map & out, out.clone()))
        return probs, out

    monkeypatch.setattr(router, "apply_router_token_dropping", recorded)
    # the alltoall dispatcher makes a CUDA stream for its device-to-host copies, which drop-and-pad never makes
    monkeypatch.setattr(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())
    # as config/megatron.py sets moe.capacity_factor 1.0 with moe.pad_to_capacity, and the default dispatcher
    spec, model, _, out, _ = _two_micro_batches_counted(deepseek, moe_token_dispatcher_type="alltoall",
                                                        moe_expert_capacity_factor=1.0,
                                                        moe_pad_expert_input_to_capacity=True)
    layers = ["2", "3", "mtp_1"]  # the routers' call order in a forward pass
    topk, experts = spec.moe_router_topk, seen[0][0].shape[1]
    capacity = get_capacity(16 * topk, experts, 1.0)
    assert len(seen) == 6 and capacity < 16  # the capacity binds: padding and dropping both happen
    dispatchers = [m.token_dispatcher for m in model.modules() if isinstance(m, MoELayer)]
    assert len(dispatchers) == 3 and all(d.drop_and_pad and d.capacity == capacity for d in dispatchers)  # ran padded
    assert all(m.sum(dim=0).tolist() == [capacity] * experts for _, _, m in seen)  # every column padded to it
    routed = {layer: sum(int(r.sum()) for r, _, _ in seen[i::3]) for i, layer in enumerate(layers)}
    kept = {layer: sum(k.sum(dim=0) for _, k, _ in seen[i::3]).tolist() for i, layer in enumerate(layers)}
    padding = sum(int(m.sum() - k.sum()) for _, k, m in seen)
    assert all(v == 2 * 16 * topk for v in routed.values()) and padding > 0
    assert out["expert_tokens"] == kept  # per expert: the routed slots kept, not the padded capacity
    want = {layer: 1 - sum(kept[layer]) / routed[layer] for layer in layers}
    assert min(want.values()) > 0  # a capacity factor of 1.0 on random routing drops some slots in every layer
    assert out["expert_dropped_per_layer"] == pytest.approx(want, abs=1e-4)
    assert out["expert_dropped_max"] == pytest.approx(max(want.values()))
    assert out["expert_dropped"] == pytest.approx(1 - sum(map(sum, kept.values())) / sum(routed.values()))


def _two_micro_batches_counted(deepseek: Path, **moe: object) -> tuple:
    """The tiny DeepSeek-V3 (one MTP layer) with Megatron-Core's token dropping as `moe` sets it, counted by
    ExpertLoad over two micro-batches (a log line): (spec, model, the ExpertLoad, its reading, the last tokens)."""
    import dataclasses

    from mcorekit.models.megatron import build_gpt, padded_vocab_size, transformer_config
    from mcorekit.models.spec import from_hf_config, load_hf_config
    from mcorekit.train.metrics import ExpertLoad

    spec = dataclasses.replace(from_hf_config(load_hf_config(deepseek)), mtp_layers=1)
    cfg = transformer_config(spec, cpu_init=True, moe_token_drop_policy="probs", **moe)
    model = build_gpt(spec, cfg, padded_vocab_size(spec.vocab_size, 128), use_te=False).train()
    load = ExpertLoad([model], sequence_parallel=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens = torch.randint(0, spec.vocab_size, (2, 8), generator=g)
        model(tokens, torch.arange(8).expand(2, 8), attention_mask=None, labels=tokens, loss_mask=torch.ones(2, 8))
    return spec, model, load, load.read_and_reset(), tokens
