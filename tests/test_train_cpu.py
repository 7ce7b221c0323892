"""train/ on CPU: the FLOP formula against hand-computed values (dense and MoE), the mapping of every experiment
option onto Megatron-Core's own config objects (constructed for real, so their checks run), the schedules, and
the launcher asking Megatron-Core before it queues."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

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


def test_moe_counts_the_shared_expert_and_its_gate() -> None:
    spec = ModelSpec("qwen2_moe", 2, 4, 2, 2, 2, 8, 10, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=6,
                     moe_shared_expert_ffn_hidden_size=5, moe_shared_expert_gate=True)
    per_layer = (4 * 4 + 2 * 4 * 4 + 4 * 4) + 2 * 6 * 4 * 0.5 + (2 * 3 * 4 * 6 + 4 * 8) + (3 * 4 * 5 + 4)
    assert train_flops_per_token(spec, 6) == pytest.approx(6 * (2 * per_layer + 4 * 10))


def test_mla_counts_its_low_rank_projections_and_head_sizes() -> None:
    # DeepSeek-V3 shape in miniature: 2 layers (1 dense, 1 MoE), hidden 8, 2 heads, q LoRA 4, kv LoRA 3,
    # q/k 5 without rope + 2 with rope, v 6; dense ffn 10; 4 experts of 3, top-2; vocab 10; seq 6
    spec = ModelSpec("deepseek_v3", 2, 8, 2, 2, 7, 10, 10, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=3,
                     moe_first_k_dense=1, q_lora_rank=4, kv_lora_rank=3, qk_head_dim=5, qk_pos_emb_head_dim=2,
                     v_head_dim=6)
    q = 8 * 4 + 4 * 2 * 7  # down to the q LoRA rank, up to 2 heads of 5 + 2
    kv = 8 * (3 + 2) + 3 * 2 * (5 + 6)  # down to the kv rank plus the shared rope key, up to k (5) and v (6) per head
    attn = q + kv + 2 * 6 * 8 + 0.5 * 6 * 2 * (7 + 6)  # + output projection + QK^T (7 per head) and AV (6 per head)
    dense, moe = 3 * 8 * 10, 2 * 3 * 8 * 3 + 8 * 4
    assert train_flops_per_token(spec, 6) == pytest.approx(6 * (2 * attn + dense + moe + 8 * 10))


def test_sliding_window_layers_count_the_keys_they_see() -> None:
    # GPT-OSS style: layer 0 windowed (4 keys), layer 1 full; hidden 4, 2 heads of 2, 1 KV group, ffn 8, seq 8
    spec = ModelSpec("gpt_oss", 2, 4, 2, 1, 2, 8, 10, sliding_window=4, window_layers=(1, 0))
    keys_windowed = (1 + 2 + 3 + 4 + 4 + 4 + 4 + 4) / 8 - 0.5 * 4 / 8  # causal counted as half: w/2 for the first w
    proj, mlp = 4 * 4 + 2 * 4 * 2 + 4 * 4, 3 * 4 * 8
    windowed, full = proj + keys_windowed * 2 * 4 + mlp, proj + 0.5 * 8 * 2 * 4 + mlp
    assert train_flops_per_token(spec, 8) == pytest.approx(6 * (windowed + full + 4 * 10))


def test_multi_token_prediction_layers_and_frozen_weights() -> None:
    # the dense case by hand (1 layer, hidden 4, GQA 2/1 of 2, ffn 8, vocab 10, seq 6) with one MTP layer: a layer,
    # its 2H -> H projection and the logits again; LoRA's frozen weights count x4, core attention x6
    spec = ModelSpec("llama", 1, 4, 2, 1, 2, 8, 10)
    weights, core, logits = 48 + 96, 24, 40
    assert train_flops_per_token(spec, 6, frozen_weights=True) == 4 * (weights + logits) + 6 * core
    mtp = ModelSpec("llama", 1, 4, 2, 1, 2, 8, 10, mtp_layers=1)
    assert train_flops_per_token(mtp, 6) == 6 * 2 * (weights + core + logits) + 6 * 2 * 4 * 4


def test_benchmark_shape_matches_the_6n_rule_of_thumb() -> None:
    from mcorekit.models.spec import PRESETS

    spec = PRESETS["llama-0.9b"]
    f = train_flops_per_token(spec, 2048)
    n = spec.num_parameters() - spec.vocab_size * spec.hidden_size  # the input embedding does no matmul
    assert 6 * n < f < 6 * n * 1.2  # attention over 2048 tokens adds ~10%


def test_train_refuses_options_it_does_not_implement() -> None:
    from mcorekit.config.experiment import load_experiment
    from mcorekit.config.rules import Nodes, problems

    node = Nodes(transformer_engine=True, gpus=False)
    assert problems(load_experiment("examples/llama-tiny.yaml"), 1, node) == []  # the defaults are all built
    assert problems(load_experiment("examples/llama-tiny.yaml", ["data.dynamic_batching=true"]), 1, node) == [
        "data.dynamic_batching is not built yet; use data.packing for variable-length SFT data"]


# ---------------------------------------------------------------- experiment -> Megatron-Core config, per feature


def exp(*overrides: str) -> Any:
    from mcorekit.config.experiment import load_experiment

    return load_experiment("examples/llama-tiny.yaml", list(overrides))


def tcfg(e: Any, use_te: bool = True, moe: bool = False) -> Any:
    """The TransformerConfig train/ builds, constructed on CPU (fusions off: their checks import TE)."""
    from mcorekit.models.spec import resolve
    from mcorekit.config.megatron import transformer_config

    spec = resolve("mixtral-tiny" if moe else e.model.preset, None, e.model.overrides)
    return transformer_config(e, spec, use_te, fusions=False)


def test_fusions_follow_transformer_engine() -> None:
    from mcorekit.models.spec import resolve
    from mcorekit.config.megatron import transformer_kwargs

    spec = resolve("llama-tiny", None, {})
    on, off = transformer_kwargs(exp(), spec, use_te=True), transformer_kwargs(exp(), spec, use_te=False)
    for key in ("use_te_activation_func", "apply_rope_fusion", "masked_softmax_fusion", "cross_entropy_loss_fusion"):
        assert on[key] is True and off[key] is False, key
    assert on["cross_entropy_fusion_impl"] == "native"  # TE's variant is known unstable; Megatron-LM rejects it
    # a dense SwiGLU runs TE's kernel; Megatron-Core's fused bias-SwiGLU where TE's cannot: MoE (the torch._grouped_mm
    # experts use its weighted form), linear biases, GPT-OSS's clamped activation
    assert on["bias_activation_fusion"] is False and off["bias_activation_fusion"] is False
    for other in (resolve("mixtral-tiny", None, {}), resolve("llama-tiny", None, {"linear_bias": True}),
                  resolve("llama-tiny", None, {"activation": "gpt_oss", "glu_clamp": 7.0})):
        kw = transformer_kwargs(exp(), other, use_te=True)
        assert (kw["use_te_activation_func"], kw["bias_activation_fusion"]) == (False, True), other
    assert transformer_kwargs(exp(), spec, use_te=True, fusions=False)["use_te_activation_func"] is False


class SwiGLUWithExtraState(torch.nn.Module):
    """Stands in for TE's SwiGLU operation (TE is not installed here): SwiGLU with the always empty extra state of a
    TE 2.20 BasicOperation without quantizers, which also loads that state itself before the rest."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        pass

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        if prefix + "_extra_state" in state_dict:
            self.set_extra_state(state_dict[prefix + "_extra_state"])
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_te_activation_module_adds_no_checkpoint_key(model_parallel: None) -> None:
    """The dense MLP's TE activation module (models/megatron.te_swiglu_op) has no `_extra_state`, so checkpoints
    converted from HF and those written without it load into a model that runs it, and its checkpoints into one
    that does not. A real Megatron-Core MLP from the layer spec as models/megatron.layer_spec changes it, next to
    one running the plain SwiGLU with the same weights: the same output, bitwise."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcorekit.models.megatron import with_mlp_submodules, without_extra_state

    assert "_extra_state" in SwiGLUWithExtraState().state_dict()  # the stand-in has the key, as TE's op does
    stateless = without_extra_state(SwiGLUWithExtraState)
    assert stateless is without_extra_state(SwiGLUWithExtraState) and issubclass(stateless, SwiGLUWithExtraState)
    spec = with_mlp_submodules(get_gpt_layer_local_spec(), activation_func=lambda config: stateless())
    submodules = spec.submodules.mlp.keywords["submodules"]
    assert submodules.linear_fc1 is get_gpt_layer_local_spec().submodules.mlp.keywords["submodules"].linear_fc1

    def mlp(te_act: bool) -> Any:
        config = TransformerConfig(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=1,
                                   gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                   add_bias_linear=False, bias_activation_fusion=False, use_cpu_initialization=True,
                                   use_te_activation_func=te_act)
        torch.manual_seed(0)
        return MLP(config, submodules)

    te, plain = mlp(True), mlp(False)
    assert isinstance(te.activation_func, SwiGLUWithExtraState)
    assert list(te.state_dict()) == list(plain.state_dict())
    assert "linear_fc2.weight" in te.state_dict() and not [k for k in te.state_dict() if k.startswith("activation")]
    assert sorted(te.sharded_state_dict()) == sorted(plain.sharded_state_dict())
    te.load_state_dict(plain.state_dict())  # strict: nothing missing, nothing unexpected
    # a state dict written with the operation's extra state (at ab5ff08): an unexpected key, as for any module
    with pytest.raises(RuntimeError, match="Unexpected key.*activation_func._extra_state"):
        te.load_state_dict({**plain.state_dict(), "activation_func._extra_state": torch.empty(0, dtype=torch.uint8)})
    x = torch.randn(4, 2, 8)
    assert torch.equal(te(x)[0], plain(x)[0])


def test_te_swiglu_op_refuses_an_operation_with_quantizers(monkeypatch: pytest.MonkeyPatch) -> None:
    """models/megatron.te_swiglu_op builds TE's SwiGLU operation without extra state, and refuses one that holds
    quantizers, whose extra state a checkpoint would need. TE is not installed here: a stand-in module provides
    transformer_engine.pytorch.ops.SwiGLU with TE 2.20's num_quantizers."""
    import sys
    import types

    from mcorekit.models.megatron import te_swiglu_op

    class SwiGLU(SwiGLUWithExtraState):
        quantizers = 0

        def __init__(self, cache_quantized_input: bool = False) -> None:
            super().__init__()
            self.cache_quantized_input = cache_quantized_input

        def num_quantizers(self, mode: str) -> int:
            return self.quantizers if mode == "backward" else 0

    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["transformer_engine.pytorch.ops"].SwiGLU = SwiGLU  # type: ignore[attr-defined]
    op = te_swiglu_op(types.SimpleNamespace(activation_func_fp8_input_store=True))
    assert isinstance(op, SwiGLU) and op.cache_quantized_input and "_extra_state" not in op.state_dict()
    SwiGLU.quantizers = 1
    with pytest.raises(RuntimeError, match="keeps quantizer state"):
        te_swiglu_op(types.SimpleNamespace(activation_func_fp8_input_store=False))


def test_interleaved_pipeline_sends_unbatched() -> None:
    """With PP=2 the previous and next stage are one rank: batched p2p ops pair the gradient sent back with the
    activation expected forward (found on two H200s: step-1 gradients of the first chunks ~500x too large)."""
    c = tcfg(exp("parallel.pp=2", "parallel.vpp=2"))
    assert c.overlap_p2p_comm is True and c.batch_p2p_comm is False
    c = tcfg(exp("parallel.pp=2"))  # plain 1F1B never sends both ways in one call: Megatron's default stays
    assert c.overlap_p2p_comm is False and c.batch_p2p_comm is True


@pytest.mark.parametrize("recipe,fmt", [("delayed", "hybrid"), ("tensorwise", "e4m3"), ("blockwise", "e4m3"), ("mxfp8", "e4m3")])
def test_fp8_recipes(recipe: str, fmt: str) -> None:
    c = tcfg(exp(f"precision.fp8={recipe}"))
    assert (c.fp8, c.fp8_recipe, c.fp8_param) == (fmt, recipe, False)
    c = tcfg(exp(f"precision.fp8={recipe}", "precision.fp8_params=true"))
    assert c.fp8_param is True
    from mcorekit.config.megatron import ddp_config

    assert ddp_config(exp(f"precision.fp8={recipe}", "precision.fp8_params=true")).fp8_param_gather is True


def test_precision_dtypes_and_fp16_loss_scaling() -> None:
    import torch

    from mcorekit.config.megatron import optimizer_config

    c = tcfg(exp())
    assert c.bf16 and not c.fp16 and c.params_dtype == torch.bfloat16 and c.fp8 is None
    o = optimizer_config(exp())
    assert o.bf16 and not o.fp16
    o = optimizer_config(exp("precision.dtype=fp16"))
    assert o.fp16 and not o.bf16 and o.loss_scale is None and o.initial_loss_scale == 2.0**16  # dynamic
    assert tcfg(exp("precision.dtype=fp16")).fp16
    assert optimizer_config(exp("precision.dtype=fp16", "precision.loss_scale=128")).loss_scale == 128.0  # static


def test_moe_options() -> None:
    c = tcfg(exp(), moe=True)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_grouped_gemm, c.moe_token_dispatcher_type) == (4, 2, True, "alltoall")
    assert c.moe_router_load_balancing_type == "aux_loss" and c.moe_aux_loss_coeff == 1e-2
    c = tcfg(exp("moe.expert_bias=true"), moe=True)
    assert c.moe_router_enable_expert_bias and c.moe_router_load_balancing_type == "none"
    assert c.moe_router_score_function == "sigmoid" and c.moe_aux_loss_coeff == 0.0
    c = tcfg(exp("moe.capacity_factor=1.25"), moe=True)
    assert c.moe_expert_capacity_factor == 1.25 and c.moe_token_drop_policy == "probs"
    assert not c.moe_pad_expert_input_to_capacity
    assert tcfg(exp("moe.capacity_factor=1.0", "moe.pad_to_capacity=true"), moe=True).moe_pad_expert_input_to_capacity
    c = tcfg(exp("moe.shared_expert_ffn=96", "moe.shared_expert_overlap=true"), moe=True)
    assert c.moe_shared_expert_intermediate_size == 96 and c.moe_shared_expert_overlap
    c = tcfg(exp("moe.grouped_gemm=false", "moe.dispatcher=allgather", "moe.aux_loss_coeff=0.001"), moe=True)
    assert not c.moe_grouped_gemm and c.moe_token_dispatcher_type == "allgather" and c.moe_aux_loss_coeff == 0.001
    assert not tcfg(exp(), use_te=False, moe=True).moe_grouped_gemm  # grouped GEMM is TE's GroupedLinear
    c = tcfg(exp("parallel.ep=2", "moe.a2a_overlap=true"), moe=True)
    assert c.overlap_moe_expert_parallel_comm and c.expert_model_parallel_size == 2


def test_expert_gemm_resolution() -> None:
    """auto takes torch._grouped_mm where it applies (bf16, or FP8 delayed/tensorwise with bf16 weights, TE grouped
    experts, no a2a overlap), else TE."""
    from dataclasses import replace

    from mcorekit.config.rules import expert_gemm_problems, use_torch_expert_gemm
    from mcorekit.models.spec import resolve

    assert use_torch_expert_gemm(exp(), uses_te=True)
    assert not use_torch_expert_gemm(exp(), uses_te=False)
    for recipe in ("delayed", "tensorwise"):  # the FP8 grouped GEMM (models/fp8_grouped_mm.py)
        assert use_torch_expert_gemm(exp(f"precision.fp8={recipe}"), uses_te=True)
    for other in ("moe.expert_gemm=te", "precision.fp8=blockwise", "precision.fp8=delayed precision.fp8_params=true",
                  "precision.dtype=fp16", "moe.grouped_gemm=false",
                  "parallel.ep=2 moe.a2a_overlap=true", "recompute.granularity=selective recompute.modules=[moe_act]"):
        assert not use_torch_expert_gemm(exp(*other.split()), uses_te=True), other
        assert expert_gemm_problems(exp(*other.split()), uses_te=True) == []  # auto or te: never an error
    assert expert_gemm_problems(exp("moe.expert_gemm=torch"), uses_te=True) == []
    assert "use moe.expert_gemm=te or auto" in expert_gemm_problems(exp("moe.expert_gemm=torch", "precision.dtype=fp16"),
                                                                    uses_te=True)[0]
    # FP8 rows must be multiples of 16 bytes: an expert width of 200 keeps TE's experts, and torch is refused
    moe = resolve("mixtral-tiny", None, {})
    odd = replace(moe, moe_ffn_hidden_size=200)
    assert expert_gemm_problems(exp("moe.expert_gemm=torch", "precision.fp8=tensorwise"), True, moe) == []
    assert expert_gemm_problems(exp("moe.expert_gemm=torch", "precision.fp8=tensorwise"), True, odd) == [
        "moe.expert_gemm=torch with precision.fp8: FP8 grouped GEMMs need multiples of 16, got expert FFN size 200; "
        "use moe.expert_gemm=auto or te"]
    assert expert_gemm_problems(exp("moe.expert_gemm=torch"), True, odd) == []  # bf16 has no such need
    # each rank's part: expert tensor parallelism splits the FFN (1440 = 16 x 90, a quarter of it 360 is not)
    wide = replace(moe, moe_ffn_hidden_size=1440)
    fp8_torch = ("moe.expert_gemm=torch", "precision.fp8=tensorwise")
    assert expert_gemm_problems(exp(*fp8_torch, "parallel.etp=2"), True, wide) == []
    assert expert_gemm_problems(exp(*fp8_torch, "parallel.etp=4"), True, wide) == [
        "moe.expert_gemm=torch with precision.fp8: FP8 grouped GEMMs need multiples of 16, got expert FFN size 360 "
        "(per rank: 1440 / parallel.etp=4); use moe.expert_gemm=auto or te"]
    # torch._scaled_grouped_mm runs on compute capability 9.0 and 10.0: elsewhere FP8 MoE keeps TE's experts
    for gpu, ok in (((9, 0), True), ((10, 0), True), ((8, 9), False), ((12, 0), False), (None, True)):
        assert use_torch_expert_gemm(exp("precision.fp8=delayed"), True, gpu) is ok, gpu
        assert use_torch_expert_gemm(exp(), True, gpu)  # bf16 anywhere
    assert "compute capability 9.0 or 10.0" in expert_gemm_problems(
        exp("moe.expert_gemm=torch", "precision.fp8=delayed"), True, moe, (8, 9))[0]


def test_start_line_names_the_experts_class() -> None:
    from mcorekit.train.loop import experts_note

    class GroupedMMExperts(torch.nn.Module):
        pass

    class MoELayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = GroupedMMExperts()

    chunk = torch.nn.Sequential(MoELayer(), MoELayer())
    assert experts_note([chunk]) == ", MoE experts: GroupedMMExperts"
    assert experts_note([torch.nn.Sequential(torch.nn.Linear(2, 2))]) == ""


def test_recompute_and_offloading() -> None:
    c = tcfg(exp("recompute.granularity=selective"))
    assert c.recompute_granularity == "selective" and c.recompute_modules == ["core_attn"]
    c = tcfg(exp("recompute.granularity=selective", "recompute.modules=[core_attn,mlp,layernorm]"))
    assert c.recompute_modules == ["core_attn", "mlp", "layernorm"]
    c = tcfg(exp("recompute.granularity=full", "recompute.method=block", "recompute.num_layers=2"))
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "block", 2)
    c = tcfg(exp("recompute.offload_layers=1"))
    assert c.cpu_offloading and c.cpu_offloading_num_layers == 1 and c.cpu_offloading_activations
    assert tcfg(exp()).recompute_granularity is None and not tcfg(exp()).cpu_offloading


def test_parallel_and_overlap_options() -> None:
    from mcorekit.config.megatron import ddp_config, optimizer_config

    c = tcfg(exp("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2", "parallel.vpp=2", "parallel.cp=2",
                 "optimizer.tp_comm_overlap=true"))
    assert (c.tensor_model_parallel_size, c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size,
            c.context_parallel_size, c.sequence_parallel, c.tp_comm_overlap) == (2, 2, 2, 2, True, True)
    d = ddp_config(exp())
    assert d.use_distributed_optimizer and d.overlap_grad_reduce and d.overlap_param_gather and d.average_in_collective
    assert d.grad_reduce_in_fp32 and d.bucket_size == 40_000_000 and d.check_for_nan_in_grad
    d = ddp_config(exp("optimizer.distributed=false", "optimizer.overlap_param_gather=false", "optimizer.bucket_size=null"))
    assert not d.use_distributed_optimizer and not d.overlap_param_gather and d.bucket_size is None
    o = optimizer_config(exp("optimizer.lr=0.001", "optimizer.clip_grad=0.5", "optimizer.weight_decay=0.05"))
    assert (o.optimizer, o.lr, o.clip_grad, o.weight_decay, o.use_distributed_optimizer) == ("adam", 0.001, 0.5, 0.05, True)


def test_step_graph_where_it_applies() -> None:
    """schedule.cuda_graph=auto captures the step where nothing in it needs the host or changes shape (one GPU,
    bf16, pretraining data, the torch._grouped_mm experts); elsewhere the step stays eager, and `true` says why
    it cannot. With the graph, DDP overlaps nothing (one rank) and checks no NaN on the host."""
    from mcorekit.config.megatron import ddp_config, optimizer_config, transformer_kwargs
    from mcorekit.config.rules import Nodes, full_graph_blockers, problems, use_full_graph
    from dataclasses import replace

    from mcorekit.models.spec import resolve

    dense, moe = resolve("llama-tiny", None, {}), resolve("mixtral-tiny", None, {})
    gpu = Nodes(transformer_engine=True, gpus=True, capability=(9, 0))
    assert use_full_graph(exp(), dense, True, True, 1) and use_full_graph(exp(), moe, True, True, 1)
    assert not use_full_graph(exp("schedule.cuda_graph=false"), dense, True, True, 1)
    assert full_graph_blockers(exp(), dense, True, True, 2) == ["one data-parallel rank"]
    assert full_graph_blockers(exp(), dense, False, True, 1) == ["GPUs with Transformer Engine"]
    fp8_blocker = ("precision.dtype=bf16, without precision.fp8 or with its delayed or tensorwise recipe and bf16 "
                   "weights")
    assert full_graph_blockers(exp("precision.fp8=blockwise", "parallel.tp=2"), dense, True, True, 1) == [
        "one model replica per GPU (tp, pp, cp, ep = 1)", fp8_blocker]
    assert full_graph_blockers(exp("precision.fp8=delayed", "precision.fp8_params=true"), dense, True, True, 1) == [
        fp8_blocker]
    for recipe in ("delayed", "tensorwise"):  # FP8 steps are captured too (tests/test_gpu_train.py compares them)
        assert full_graph_blockers(exp(f"precision.fp8={recipe}"), dense, True, True, 1) == []
        assert full_graph_blockers(exp(f"precision.fp8={recipe}"), moe, True, True, 1, (9, 0)) == []
    # on an Ada GPU FP8 MoE takes TE's experts, whose host-side counts keep the step eager
    assert full_graph_blockers(exp("precision.fp8=delayed"), moe, True, True, 1, (8, 9)) == [
        "MoE: the torch._grouped_mm experts (moe.expert_gemm auto or torch)"]
    assert full_graph_blockers(exp("precision.fp8=delayed"), dense, True, True, 1, (8, 9)) == []
    assert full_graph_blockers(exp("precision.fp8=delayed"), replace(moe, moe_ffn_hidden_size=200), True, True, 1) == [
        "MoE: the torch._grouped_mm experts (moe.expert_gemm auto or torch)"]
    assert full_graph_blockers(exp("moe.expert_gemm=te", "moe.capacity_factor=1.5"), moe, True, True, 1) == [
        "MoE: the torch._grouped_mm experts (moe.expert_gemm auto or torch)",
        "MoE: no token dropping (moe.capacity_factor unset)"]
    assert full_graph_blockers(exp("recompute.granularity=full"), dense, True, True, 1) == ["no recompute"]
    # what has not been compared with the eager step keeps it (tests/test_gpu_train.py compares the rest)
    assert full_graph_blockers(exp("optimizer.clip_grad=0"), dense, True, True, 1) == [
        "optimizer.clip_grad > 0 (its gradient norm is the step's NaN check)"]
    assert full_graph_blockers(exp("moe.router_fusion=true"), moe, True, True, 1) == [
        "MoE: no moe.router_fusion, moe.shared_expert_overlap or moe.a2a_overlap"]
    model_wide = "a Llama/Qwen/Mixtral-style model: no multi-latent attention, sliding window, attention sinks or " \
                 "biases on every linear"
    for changed in ({"kv_lora_rank": 64}, {"sliding_window": 128}, {"attention_sinks": True}, {"linear_bias": True}):
        assert full_graph_blockers(exp(), replace(dense, **changed), True, True, 1) == [model_wide], changed
    assert full_graph_blockers(exp(), replace(moe, activation="silu", glu_clamp=7.0), True, True, 1) == [
        "SwiGLU MLPs (activation silu, no clamp)"]
    for changed in ({"moe_router_expert_bias": True}, {"moe_shared_expert_ffn_hidden_size": 64}):  # DeepSeek, Qwen2-MoE
        assert full_graph_blockers(exp(), replace(moe, **changed), True, True, 1) == [
            "MoE: no expert bias or shared expert (moe.expert_bias, moe.shared_expert_ffn, or the model's own)"]
    # true: the same rules, as an error before queueing; auto and false never refuse
    assert problems(exp("schedule.cuda_graph=true"), 1, gpu) == []
    [p] = problems(exp("schedule.cuda_graph=true"), 2, gpu)
    assert p == ("schedule.cuda_graph=true captures each step as one CUDA graph, which needs one data-parallel rank: "
                 "change those, or set schedule.cuda_graph=auto (the graph where it applies, the eager step elsewhere)")
    assert problems(exp(), 2, gpu) == problems(exp("schedule.cuda_graph=false"), 2, gpu) == []
    # what the graph changes in Megatron-Core's configs
    assert transformer_kwargs(exp(), dense, True, full_graph=True)["cuda_graph_impl"] == "full_iteration"
    assert "cuda_graph_impl" not in transformer_kwargs(exp(), dense, True)
    d, o = ddp_config(exp(), full_graph=True), optimizer_config(exp(), full_graph=True)
    assert not (d.overlap_grad_reduce or d.overlap_param_gather or d.check_for_nan_in_grad or o.overlap_param_gather)
    assert ddp_config(exp()).overlap_grad_reduce and optimizer_config(exp()).overlap_param_gather


def test_step_graph_refuses_a_batch_of_another_shape() -> None:
    """The graph's input buffers are copied into: a micro-batch of another shape, dtype or key set stops the run."""
    import torch

    from mcorekit.train.step_graph import StepGraph

    graph = object.__new__(StepGraph)  # the checker alone: building the wrapper needs CUDA
    graph.batch_layout = None
    batch = {"tokens": torch.zeros(2, 8, dtype=torch.long), "loss_mask": torch.ones(2, 8)}
    assert list(graph._same_layout(iter([batch, dict(batch)]))) == [batch, batch]
    for other in ({**batch, "tokens": torch.zeros(2, 4, dtype=torch.long)}, {**batch, "loss_mask": torch.ones(2, 8).long()},
                  {"tokens": batch["tokens"]}):
        with pytest.raises(RuntimeError, match="that each step's CUDA graph reads; set schedule.cuda_graph=false"):
            list(graph._same_layout(iter([other])))


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd", "constant"])
def test_schedules(decay: str) -> None:
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from mcorekit.config.megatron import scheduler_kwargs

    e = exp(f"schedule.decay={decay}", "schedule.train_iters=100", "schedule.warmup_iters=10", "optimizer.lr=1.0",
            "optimizer.min_lr=0.1", "schedule.global_batch_size=8")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = OptimizerParamScheduler(opt, **scheduler_kwargs(e))
    lrs = []
    for _ in range(100):
        sched.step(increment=8)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[4] == pytest.approx(0.5) and lrs[9] == pytest.approx(1.0)  # linear warmup over 10 steps
    mid, end = lrs[54], lrs[99]
    expected = {"cosine": (0.55, 0.1), "linear": (0.55, 0.1), "wsd": (1.0, 0.1), "constant": (1.0, 1.0)}[decay]
    assert (mid, end) == pytest.approx(expected, abs=0.03)
    if decay == "wsd":  # flat until the last fifth, then down to min_lr
        assert lrs[79] == pytest.approx(1.0) and lrs[89] < 0.9


def test_a_run_continuing_another_keeps_its_own_schedule_from_the_checkpoints_position(
        caplog: pytest.LogCaptureFixture) -> None:
    """checkpoint.load with finetune=false: the other run's position in the schedule, this run's schedule. Megatron-
    Core's default kept the checkpoint's length, so a run continuing a 100-step run for 200 steps decayed to min_lr
    at step 100 and trained on at min_lr."""
    import logging
    from pathlib import Path

    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from mcorekit.config.megatron import scheduler_kwargs
    from mcorekit.train.checkpoint import load_schedule

    def schedule(iters: int) -> tuple[OptimizerParamScheduler, torch.optim.Optimizer]:
        e = exp(f"schedule.train_iters={iters}", "schedule.warmup_iters=10", "optimizer.lr=1.0", "optimizer.min_lr=0.1",
                "schedule.global_batch_size=8")
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        return OptimizerParamScheduler(opt, **scheduler_kwargs(e)), opt

    first, first_opt = schedule(100)
    first.step(increment=50 * 8)
    same, opt = schedule(100)
    with caplog.at_level(logging.WARNING, logger="mcorekit.train"):
        load_schedule(same, first.state_dict(), Path("/ckpt/iter_0000050"))
    assert same.num_steps == 400 and opt.param_groups[0]["lr"] == first_opt.param_groups[0]["lr"]
    assert "another schedule" not in caplog.text
    longer, opt = schedule(200)
    with caplog.at_level(logging.WARNING, logger="mcorekit.train"):
        load_schedule(longer, first.state_dict(), Path("/ckpt/iter_0000050"))
    assert longer.num_steps == 400 and longer.lr_decay_steps == 1600
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 40 / 190)), abs=1e-6)
    assert ("/ckpt/iter_0000050 was trained with another schedule than this run's (lr_decay_steps 800 -> 1600): "
            "this run goes on from its position with its own") in caplog.text

    # a checkpoint of another global batch size: step 50 of this run's batches of 16 is sample 800, not 400
    from mcorekit.train.loop import _schedule_at

    _schedule_at(SimpleNamespace(scheduler=longer), 50, 16, Path("/ckpt/iter_0000050"))
    assert longer.num_steps == 800
    assert ("/ckpt/iter_0000050 was saved at step 50 after 400 samples; with this run's global batch of 16, step 50 "
            "is sample 800: the schedule goes on from there") in caplog.text


def test_launcher_runs_megatron_core_checks() -> None:
    from mcorekit.errors import LayoutError
    from mcorekit.config.cluster import load_profile
    from mcorekit.launch.plan import check

    h100 = load_profile("example-h100")
    gbs = "schedule.global_batch_size=64"
    with pytest.raises(LayoutError, match="Megatron-Core rejects the configuration: Invalid choices for recompute_modules"):
        check(exp(gbs, "recompute.granularity=selective", "recompute.modules=[attention]"), h100)
    with pytest.raises(LayoutError, match="CPU offloading does not work when activation recomputation is enabled"):
        check(exp(gbs, "recompute.granularity=full", "recompute.offload_layers=1"), h100)
    with pytest.raises(LayoutError, match="schedule.micro_batch_size=1"):
        check(exp(gbs, "data.kind=sft", "data.paths=[x.jsonl]", "data.packing=true", "schedule.micro_batch_size=2"), h100)
    with pytest.raises(LayoutError, match="moe.a2a_overlap .* needs parallel.ep > 1"):
        check(exp(gbs, "moe.a2a_overlap=true"), h100)
    with pytest.raises(LayoutError, match="moe.expert_gemm=torch computes TE's grouped experts with torch._grouped_mm"):
        check(exp(gbs, "moe.expert_gemm=torch", "precision.fp8=blockwise"), h100)
    check(exp(gbs, "precision.fp8=blockwise"), h100)  # auto: TE's experts under block-scaled FP8, no complaint
    check(exp(gbs, "moe.expert_gemm=torch", "precision.fp8=delayed"), h100)  # the FP8 grouped GEMM
    with pytest.raises(LayoutError, match="moe.pad_to_capacity .* needs moe.capacity_factor"):
        check(exp(gbs, "moe.pad_to_capacity=true"), h100)
    with pytest.raises(LayoutError, match="schedule.eval_interval=100 needs held-out data: data.valid_paths"):
        check(exp(gbs, "data.kind=indexed", "data.paths=[/data/web]", "schedule.eval_interval=100"), h100)
    with pytest.raises(LayoutError, match="data.valid_paths is set but schedule.eval_interval=0"):
        check(exp(gbs, "data.kind=indexed", "data.paths=[/data/web]", "data.valid_paths=[/data/held]"), h100)
    with pytest.raises(LayoutError, match="mock data validates on its own stream"):
        check(exp(gbs, "data.valid_paths=[/data/held]", "schedule.eval_interval=100"), h100)
    check(exp(gbs, "schedule.eval_interval=100"), h100)  # mock data: validation on another mock stream
    with pytest.raises(LayoutError, match="precision.loss_scale applies to fp16 only"):
        check(exp(gbs, "precision.loss_scale=128"), h100)
    check(exp(gbs, "precision.dtype=fp16", "precision.loss_scale=128", "recompute.granularity=selective"), h100)


def test_entry_rejects_a_bad_config_in_one_line() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "mcorekit.train", "--config", "examples/llama-tiny.yaml", "data.knd=sft"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("mcorekit.train: error: override 'data.knd=sft': unknown key "
                                                  "'data.knd'; did you mean 'kind'?")


def test_fp8_recipes_need_their_gpu_generation() -> None:
    import re

    from mcorekit.config.rules import Nodes, fp8_support_problems, problems

    for recipe in ("delayed", "tensorwise", "blockwise"):
        assert fp8_support_problems(recipe, (9, 0)) == []  # H100/H200
    assert fp8_support_problems("mxfp8", (10, 0)) == []
    [p] = fp8_support_problems("mxfp8", (9, 0))
    assert re.search(r"mxfp8 needs Blackwell .* this GPU is 9.0; on Hopper use delayed", p)
    [p] = fp8_support_problems("tensorwise", (8, 0))  # A100
    assert re.search(r"tensorwise needs Ada/Hopper .* this GPU is 8.0", p)
    # on the ranks the node's GPU is known: no FP8, no requirement; mxfp8 on a Hopper node is refused
    assert problems(exp(), 1, Nodes(transformer_engine=True, gpus=True, capability=(7, 0))) == []
    hopper = Nodes(transformer_engine=True, gpus=True, capability=(9, 0))
    assert problems(exp("precision.fp8=mxfp8"), 1, hopper) == fp8_support_problems("mxfp8", (9, 0))


def test_train_checks_the_layout_against_the_ranks_started() -> None:
    """torchrun starts skip the launcher, so build() applies its layout rules itself, before any process group."""
    from mcorekit.config.rules import Nodes
    from mcorekit.errors import ConfigError
    from mcorekit.models.spec import resolve
    from mcorekit.train.build import check

    spec = resolve("llama-tiny", None, {})
    te, no_te = Nodes(transformer_engine=True, gpus=True), Nodes(transformer_engine=False, gpus=True)
    check(exp("parallel.tp=2", "parallel.sequence_parallel=true"), spec, 4, te)
    with pytest.raises(ConfigError, match=r"cannot train on 2 ranks \(2 problems\):\n  - TP\*PP\*CP = 4\*1\*1 = 4 does not divide the world size 2"):
        check(exp("parallel.tp=4"), spec, 2, te)
    for bad in (exp("parallel.cp=2", "precision.dtype=fp32"), exp("parallel.cp=2")):
        with pytest.raises(ConfigError, match="parallel.cp > 1 runs Transformer Engine's context-parallel attention"):
            check(bad, spec, 2, te if bad.precision.dtype == "fp32" else no_te)
    check(exp("parallel.cp=2"), spec, 2, te)
    with pytest.raises(ConfigError, match=r"model.backend=te needs Transformer Engine, and Transformer Engine is not "
                                          r"importable on this node"):
        check(exp("model.backend=te"), spec, 1, no_te)


def test_launcher_refuses_context_parallel_in_fp32() -> None:
    from mcorekit.errors import LayoutError
    from mcorekit.config.cluster import load_profile
    from mcorekit.launch.plan import check

    h100 = load_profile("example-h100")
    with pytest.raises(LayoutError, match="needs precision.dtype bf16 or fp16"):
        check(exp("schedule.global_batch_size=64", "parallel.cp=2", "precision.dtype=fp32"), h100)


class Recorder:
    """Stands in for the GPU-only loaders (Megatron's dist_checkpointing and optimizer need CUDA): records calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def load(self, path: Any, model: Any, optimizer: Any, scheduler: Any, weights_loaded: bool = False) -> int:
        self.calls.append(("everything", path.name))
        return 7

    def load_weights(self, path: Any, model: Any, optimizer: Any = None) -> None:
        self.calls.append(("weights", path.name))


SAVED_AT_7 = SimpleNamespace(num_steps=7 * 8)  # Recorder.load's step, at the default global batch of 8


@pytest.mark.parametrize("tracker,finetune,expected", [
    ("release", False, [("weights", "release")]),  # a converted checkpoint has nothing but weights
    ("release", True, [("weights", "release")]),
    ("30", True, [("weights", "iter_0000030")]),  # fine-tune from another run: its weights, step 0
    ("30", False, [("everything", "iter_0000030")]),  # continue another run: optimizer, scheduler, step
])
def test_where_training_starts(tmp_path: Any, monkeypatch: Any, tracker: str, finetune: bool, expected: list) -> None:
    from mcorekit.train import checkpoint, loop

    src = tmp_path / "src"
    target = src / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    target.mkdir(parents=True)
    (target / "metadata.json").write_text("{}")
    (src / checkpoint.TRACKER).write_text(tracker)
    rec = Recorder()
    monkeypatch.setattr(checkpoint, "load", rec.load)
    monkeypatch.setattr(checkpoint, "load_weights", rec.load_weights)
    monkeypatch.setattr(loop, "mtp_weights_check", lambda path, spec: None)  # reads DCP metadata these dirs lack
    e = exp(f"checkpoint.load={src}", f"checkpoint.finetune={str(finetune).lower()}")
    step, own = loop._resume(type("T", (), {"model": [], "optimizer": None, "scheduler": SAVED_AT_7, "weights_from": None, "spec": None})(), tmp_path / "own", e)
    assert rec.calls == expected and step == (7 if expected[0][0] == "everything" else 0) and not own
    # this run's own checkpoint wins over checkpoint.load (a requeued fine-tune resumes, it does not restart)
    own = tmp_path / "own"
    (own / "iter_0000004").mkdir(parents=True)
    (own / "iter_0000004" / "metadata.json").write_text("{}")
    (own / checkpoint.TRACKER).write_text("4")
    rec.calls.clear()
    assert loop._resume(type("T", (), {"model": [], "optimizer": None, "scheduler": SAVED_AT_7, "weights_from": None, "spec": None})(), own, e) == (7, True)
    assert rec.calls == [("everything", "iter_0000004")]


def test_entry_reports_a_layout_that_does_not_fit_the_ranks(tmp_path: Any) -> None:
    """A single process asked for TP2 fails before any GPU work, in a message, not a traceback."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "mcorekit.train", "--config", "examples/llama-tiny.yaml", "--run-dir",
                        str(tmp_path), "parallel.tp=2", "parallel.sequence_parallel=true"], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "mcorekit.train: error: cannot train on 1 ranks: TP*PP*CP = 2*1*1 = 2 does not divide" in r.stderr
    assert "Traceback" not in r.stderr


def test_weights_are_gathered_before_a_checkpoint_reads_them() -> None:
    """With overlap_param_gather a rank's weights are partly one update behind until the next forward's
    all-gather; the saver forces that gather first. DDP is GPU-only, so the chunks here are recorders."""
    from types import SimpleNamespace

    from mcorekit.train.checkpoint import sync_params

    calls: list[tuple[str, bool]] = []

    class Chunk:
        def __init__(self, name: str, overlap: bool) -> None:
            self.name, self.ddp_config = name, SimpleNamespace(overlap_param_gather=overlap)

        def start_param_sync(self, force_sync: bool = False) -> None:
            calls.append((self.name, force_sync))

    sync_params([Chunk("overlapped", True), Chunk("synchronous", False)])
    assert calls == [("overlapped", True)]


def test_tasks_are_chosen_by_data_kind_and_share_the_loop() -> None:
    """Every experiment trains a task from train/tasks: chat jsonl is SFT (masked LM loss), preference pairs DPO,
    the rest LM."""
    from pathlib import Path

    from mcorekit.models.spec import resolve
    from mcorekit.train.tasks import TASKS, task_for

    spec = resolve("llama-tiny", None, {})
    assert type(task_for(exp(), spec, Path("/tmp"))).name == "lm"
    e = exp("data.kind=sft", "data.paths=[a.jsonl]", "data.tokenizer=tok")
    assert type(task_for(e, spec, Path("/tmp"))).name == "sft"
    e = exp("data.kind=dpo", "data.paths=[a.jsonl]", "data.tokenizer=tok")
    assert type(task_for(e, spec, Path("/tmp"))).name == "dpo"
    assert set(TASKS) == {"lm", "sft", "dpo", "grpo"} and all(cls.metrics[0] == "loss" for cls in TASKS.values())


def test_masked_mean_is_the_mean_over_unmasked_tokens() -> None:
    import torch

    from mcorekit.train.tasks.lm import masked_mean

    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    assert masked_mean(per_token, mask).item() == torch.tensor(10.0 / 3).item()  # fp32
    assert masked_mean(per_token, torch.zeros_like(mask)).item() == 0.0  # an all-masked batch is no NaN


def test_metrics_lines_are_json_after_a_kill_and_a_nan(tmp_path: Any) -> None:
    """A process killed mid-write left a line without its newline, and the next job's first line was glued to it;
    a NaN validation loss was written as NaN, which is not JSON."""
    import json

    from mcorekit.train.metrics import MetricsWriter

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # the killed job's last line
    writer = MetricsWriter(tmp_path, tensorboard=False, enabled=True)
    writer.write(3, 10, {"step": 3, "loss": float("nan"), "valid_loss": float("inf"), "lr": 1e-4})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[1] == '{"step": 2, "lo' and json.loads(lines[2]) == {"step": 3, "loss": None, "valid_loss": None,
                                                                         "lr": 1e-4}


def test_each_lora_dropout_step_is_seeded_from_the_seed_and_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """seed_step seeds Megatron-Core's random streams from data.seed, the pipeline stage and the step, only where a
    step draws random numbers (LoRA dropout) and never under a step graph: a resume then draws the masks of the run
    that was not interrupted (the GPU test test_lora_dropout_resume_reproduces_losses compares the losses).
    Megatron-Core's seeding needs CUDA: it is recorded here, not run."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    from mcorekit.train.build import seed_step

    seeds: list[int] = []
    monkeypatch.setattr(random, "model_parallel_cuda_manual_seed", seeds.append)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 2)

    def trainer(*overrides: str, graph: bool = False) -> Any:
        return SimpleNamespace(exp=exp(*overrides), full_graph=graph)

    lora = ("peft.lora.rank=8", "peft.lora.target_modules=[qkv]", "data.seed=7")
    seed_step(trainer(*lora), 0)  # dropout 0: nothing drawn
    seed_step(trainer(*lora, "peft.lora.dropout=0.1"), 0)
    seed_step(trainer(*lora, "peft.lora.dropout=0.1"), 41)
    seed_step(trainer(*lora, "peft.lora.dropout=0.1", graph=True), 41)  # a step graph keeps its generators
    seed_step(trainer("data.seed=7"), 41)  # no LoRA
    assert seeds == [7 + 200 + 1_000_003, 7 + 200 + 42 * 1_000_003]


@pytest.mark.parametrize("pp", [1, 2])
def test_the_step_end_groups_are_connected_at_the_start(model_parallel: None, pp: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """init_distributed reduces once over each group a step's end reduces over (data-parallel, with and without
    context parallel; model-parallel; pipeline when pp > 1), so NCCL makes their communicators while the GPU is
    empty (one gloo rank here; NCCL on the GPU), and init_distributed calls it."""
    import inspect
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcorekit.train import build

    pipeline = dist.new_group([0])  # stands in for a pipeline group
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_group", lambda: pipeline)
    reduced = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, **kw: (reduced.append(group), real(t, group=group)))
    assert "connect_step_end_groups(p.pp)" in inspect.getsource(build.init_distributed)
    build.connect_step_end_groups(pp)
    expected = [ps.get_data_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True),
                ps.get_model_parallel_group()] + ([pipeline] if pp > 1 else [])
    assert reduced == list(dict.fromkeys(expected)) and ps.get_data_parallel_group() in reduced

