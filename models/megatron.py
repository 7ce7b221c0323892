"""ModelSpec -> Megatron-Core GPTModel. train/ builds its model here and convert/ checks its keys against it.

GPTModel, not HybridModel: the checkpoints users exchange (Megatron-LM, Megatron-Bridge, NeMo) carry GPTModel's
layer-stacked keys, and convert/ must produce what those tools load. GPTModel's 0.19 deprecation notice is
about where new features land, not about removal.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from mcorekit.errors import ModelError
from mcorekit.models import dtypes
from mcorekit.models.parallel import Layout
from mcorekit.models.spec import ModelSpec

DTYPES = {name: dtypes.to_torch(name) for name in dtypes.NAMES}  # "bf16" -> torch.bfloat16 (models/dtypes.py)
LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def padded_vocab_size(vocab: int, divisible_by: int) -> int:
    """Megatron pads the vocabulary to a multiple of make-vocab-size-divisible-by (times TP in training)."""
    return -(-vocab // divisible_by) * divisible_by


def te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def rope_scaling_factor(spec: ModelSpec) -> float | None:
    """Megatron-Core implements llama3 scaling with Llama 3.1's fixed frequency factors; other values are refused."""
    rs = spec.rope_scaling
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "llama3":
        raise ModelError(f"rope scaling {kind!r} is not supported; supported: llama3")
    for key, want in LLAMA3_DEFAULTS.items():
        if key in rs and float(rs[key]) != want:
            raise ModelError(f"llama3 rope scaling with {key}={rs[key]} is not supported (Megatron-Core fixes it at {want})")
    return float(rs.get("factor", 8.0))


def mla_fields(spec: ModelSpec) -> dict[str, Any]:
    """MLATransformerConfig's fields: the latent ranks and head dims, and the rope (YaRN, or plain)."""
    out: dict[str, Any] = dict(multi_latent_attention=True, q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
                               qk_head_dim=spec.qk_head_dim, qk_pos_emb_head_dim=spec.qk_pos_emb_head_dim,
                               v_head_dim=spec.v_head_dim, rotary_base=spec.rope_theta, rope_type="rope",
                               qk_layernorm=True)  # the q and kv latent RMS norms
    rs = spec.rope_scaling
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind != "yarn":
            raise ModelError(f"rope scaling {kind!r} is not supported with multi-latent attention; supported: yarn")
        if rs.get("attention_factor") is not None:
            raise ModelError("yarn rope scaling with attention_factor is not supported (Megatron-Core derives it from "
                             "mscale and mscale_all_dim)")
        out.update(rope_type="yarn", rotary_scaling_factor=float(rs["factor"]),
                   original_max_position_embeddings=int(rs.get("original_max_position_embeddings")
                                                        or spec.max_position_embeddings),
                   beta_fast=float(rs.get("beta_fast", 32)), beta_slow=float(rs.get("beta_slow", 1)),
                   mscale=float(rs.get("mscale", 1)), mscale_all_dim=float(rs.get("mscale_all_dim", 0)))
    else:
        out.update(rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return out


def moe_fields(spec: ModelSpec) -> dict[str, Any]:
    """The routing and the expert layers of an MoE spec (the experiment adds dispatch, balancing and kernels)."""
    out: dict[str, Any] = dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_router_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size,
        # top-k then softmax (Mixtral) equals softmax, top-k, renormalise (Qwen3-MoE norm_topk_prob=true)
        moe_router_pre_softmax=not spec.moe_norm_topk_prob,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.0,
    )
    if spec.moe_shared_expert_ffn_hidden_size:  # Qwen2-MoE (gated), DeepSeek (ungated): beside the routed experts
        out.update(moe_shared_expert_intermediate_size=spec.moe_shared_expert_ffn_hidden_size,
                   moe_shared_expert_gate=spec.moe_shared_expert_gate)
    if spec.moe_router_score_function != "softmax":  # DeepSeek-V3: sigmoid scores, fp32 like HF's router
        out.update(moe_router_score_function=spec.moe_router_score_function, moe_router_dtype="fp32")
    if spec.moe_router_expert_bias:
        out.update(moe_router_enable_expert_bias=True)
    if spec.moe_router_num_groups:
        out.update(moe_router_num_groups=spec.moe_router_num_groups, moe_router_group_topk=spec.moe_router_group_topk)
    if spec.moe_router_topk_scaling_factor is not None:
        out.update(moe_router_topk_scaling_factor=spec.moe_router_topk_scaling_factor)
    if spec.moe_first_k_dense:
        k = spec.moe_first_k_dense
        out.update(moe_layer_freq=[0] * k + [1] * (spec.num_layers - k))
    return out


def transformer_config(spec: ModelSpec, par: Layout = Layout(), params_dtype: torch.dtype = torch.float32,
                       cpu_init: bool = False, **overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        sequence_parallel=par.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=cpu_init,
    )
    if spec.is_moe:
        kwargs.update(moe_fields(spec))
    if spec.is_mla:
        kwargs.update(mla_fields(spec))
    kwargs.update(gpt_oss_fields(spec))
    if spec.mtp_layers:  # Megatron-Core's MTP block (build_gpt), on the last pipeline stage
        kwargs.update(mtp_num_layers=spec.mtp_layers, mtp_loss_scaling_factor=spec.mtp_loss_scale)
    kwargs.update(overrides)
    config = (MLATransformerConfig if spec.is_mla else TransformerConfig)(**kwargs)
    for key, value in yarn_fields(spec).items():
        # GPTModel's YaRN rope and the attention's concentration factor read these when present; they are not
        # TransformerConfig fields in Megatron-Core 0.19 (Megatron-Bridge sets them on its config the same way)
        setattr(config, key, value)
    return config


def gpt_oss_fields(spec: ModelSpec) -> dict[str, Any]:
    """Linear biases, attention sinks, sliding windows on some layers, and the clamped SwiGLU."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    out: dict[str, Any] = {}
    if spec.linear_bias:
        out.update(add_bias_linear=True)
    if spec.attention_sinks:
        out.update(softmax_type="learnable")
    if spec.sliding_window:
        # HF lets token i see j when i - j < sliding_window; Megatron's window (left, right) sees i - left .. i
        out.update(window_size=(spec.sliding_window - 1, 0), window_attn_skip_freq=list(spec.window_layers or ()))
    if spec.activation == "gpt_oss":  # (up + 1) * quick_gelu(gate): quick_gelu is g * sigmoid(1.702 g)
        out.update(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=spec.glu_clamp)
    elif spec.activation != "silu":
        raise ModelError(f"activation {spec.activation!r} is not supported; supported: silu, gpt_oss")
    return out


def te_swiglu(spec: ModelSpec) -> bool:
    """Whether TE's SwiGLU kernel runs a model's MLPs (Megatron-Core's use_te_activation_func) where TE's layers do:
    dense models with the plain SwiGLU and no linear biases. Megatron-Core's bias-SwiGLU otherwise, which
    torch.compile compiles at step 1; MoE models keep it, as their torch._grouped_mm experts use its weighted form."""
    return not spec.is_moe and spec.activation == "silu" and not spec.linear_bias


@functools.cache  # one class per module class, as for a class statement
def without_extra_state(module_class: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """`module_class` with PyTorch's own get/set_extra_state and state-dict loading, so that its state dict has no
    `_extra_state` key (and one given to it is an unexpected key, as for any module). TE's activation operations
    hold no quantizer (TE 2.20: BasicOperation.num_quantizers is 0 for them; te_swiglu_op checks), so their extra
    state is always empty; left in, it would be one key per layer that checkpoints converted from HF, and those
    written by runs without TE's SwiGLU, do not have, and loading them would fail."""
    own = {name: getattr(torch.nn.Module, name)
           for name in ("get_extra_state", "set_extra_state", "_load_from_state_dict")}
    return type(module_class.__name__, (module_class,), {
        "__module__": __name__, "__qualname__": module_class.__name__, "__doc__": module_class.__doc__, **own})


def te_swiglu_op(config: Any) -> torch.nn.Module:
    """The MLP's activation module where config.use_te_activation_func is on (te_swiglu): TE's SwiGLU operation,
    without extra state (without_extra_state), which it may leave out only while the operation has no quantizer."""
    from transformer_engine.pytorch.ops import SwiGLU

    op = without_extra_state(SwiGLU)(cache_quantized_input=config.activation_func_fp8_input_store)
    if op.num_quantizers("forward") or op.num_quantizers("backward"):
        raise RuntimeError("this Transformer Engine's SwiGLU operation keeps quantizer state, which its checkpoint "
                           "entry would hold: models/megatron.without_extra_state must not leave it out")
    return op


def with_mlp_submodules(layer_spec: Any, **changes: Any) -> Any:
    """`layer_spec` with fields of its MLP's (or MoE layer's) submodules replaced. Megatron-Core 0.19's layer specs
    give the MLP as a partial of its class whose `submodules` keyword holds them."""
    mlp = layer_spec.submodules.mlp
    submodules = dataclasses.replace(mlp.keywords["submodules"], **changes)
    layer_spec.submodules.mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    return layer_spec


def uses_yarn(spec: ModelSpec) -> bool:
    """Standard attention with YaRN rope (GPT-OSS); multi-latent attention has its own (mla_fields)."""
    rs = spec.rope_scaling or {}
    return not spec.is_mla and rs.get("rope_type", rs.get("type")) == "yarn"


def yarn_fields(spec: ModelSpec) -> dict[str, Any]:
    if not uses_yarn(spec):
        return {}
    rs = spec.rope_scaling
    if rs.get("attention_factor") is not None:
        raise ModelError("yarn rope scaling with attention_factor is not supported (Megatron-Core derives it from "
                         "mscale and mscale_all_dim)")
    return dict(yarn_rotary_scaling_factor=float(rs["factor"]),
                yarn_original_max_position_embeddings=int(rs.get("original_max_position_embeddings")
                                                          or spec.max_position_embeddings),
                yarn_beta_fast=float(rs.get("beta_fast", 32)), yarn_beta_slow=float(rs.get("beta_slow", 1)),
                yarn_mscale=rs.get("mscale"), yarn_mscale_all_dim=rs.get("mscale_all_dim"),
                yarn_correction_range_round_to_int=bool(rs.get("truncate", True)))


def layer_spec(spec: ModelSpec, use_te: bool, grouped_gemm: bool = False, torch_expert_gemm: bool = False,
               moe: bool | None = None) -> Any:
    """One layer's spec: with experts when the model has them (or when `moe` says so, for mixed models)."""
    from megatron.core.models.gpt import gpt_layer_specs

    moe = spec.is_moe if moe is None else moe
    experts = spec.num_experts if moe else None
    if use_te:
        te_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=grouped_gemm and moe, qk_layernorm=spec.qk_layernorm,
            multi_latent_attention=spec.is_mla)
        if not moe and te_swiglu(spec):  # it runs where config.use_te_activation_func is on (config/megatron.py)
            te_spec = with_mlp_submodules(te_spec, activation_func=te_swiglu_op)
        if moe and grouped_gemm and torch_expert_gemm:
            from mcorekit.models.grouped_mm_experts import use_grouped_mm_experts

            te_spec = use_grouped_mm_experts(te_spec)
        return te_spec
    from mcorekit.models.sdpa_attention import SDPAttention

    local = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=grouped_gemm and moe, qk_layernorm=spec.qk_layernorm or spec.is_mla,
        normalization="RMSNorm", multi_latent_attention=spec.is_mla)
    # PyTorch's fused SDPA instead of Megatron's unfused local attention (no parameters: checkpoints unchanged);
    # attention sinks and sliding windows stay with Megatron's own, which implements them
    if not (spec.attention_sinks or spec.sliding_window):
        local.submodules.self_attention.submodules.core_attention = SDPAttention
    if spec.is_mla:
        # The TE spec fuses the q/kv latent norms into the up projections and a dense MLP's norm into linear_fc1;
        # the local MLA spec keeps them apart. Store them under the TE names, as for the standard attention.
        keys_map = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
        if not moe:
            keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
        local.submodules.sharded_state_dict_keys_map = keys_map
        return local
    if moe:
        # The local spec renames pre_mlp_layernorm to the dense TE name (mlp.linear_fc1.layer_norm_weight) even in
        # MoE layers, where the TE spec keeps decoder.layers.pre_mlp_layernorm.weight; keep the TE name so
        # checkpoints move between the two specs.
        keys_map = dict(local.submodules.sharded_state_dict_keys_map)
        keys_map.pop("pre_mlp_layernorm.", None)
        local.submodules.sharded_state_dict_keys_map = keys_map
    return local


def block_spec(spec: ModelSpec, config: Any, use_te: bool, grouped_gemm: bool = False, torch_expert_gemm: bool = False,
               vp_stage: int | None = None) -> Any:
    """The decoder's spec: one layer spec for a model whose layers are alike, else this pipeline stage's list of
    them (DeepSeek's first dense layers), sliced as Megatron-Core's get_gpt_decoder_block_spec does."""
    if not spec.per_layer_keys:
        return layer_spec(spec, use_te, grouped_gemm, torch_expert_gemm)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense = layer_spec(spec, use_te, grouped_gemm, torch_expert_gemm, moe=False)
    moe = layer_spec(spec, use_te, grouped_gemm, torch_expert_gemm, moe=True)
    layers = [dense if i < spec.moe_first_k_dense else moe for i in range(spec.num_layers)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local = layers[offset: offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as norm
    else:
        norm = dense.submodules.input_layernorm
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=norm)


def mtp_block_spec(spec: ModelSpec, config: Any, decoder: Any, use_te: bool, vp_stage: int | None = None) -> Any:
    """Megatron-Core's multi-token-prediction block for spec.mtp_layers (None without, and on every stage but the
    last): each MTP layer is enorm, hnorm, eh_proj, a decoder layer like the decoder's last (DeepSeek-V3: MLA and
    MoE) and final_layernorm; it shares the embedding and the output layer with the main model."""
    if not spec.mtp_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, decoder, use_transformer_engine=use_te, vp_stage=vp_stage)


def build_gpt(spec: ModelSpec, config: Any, padded_vocab: int, use_te: bool, grouped_gemm: bool = False,
              pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
              torch_expert_gemm: bool = False) -> Any:
    from megatron.core.models.gpt import GPTModel

    factor = None if spec.is_mla or uses_yarn(spec) else rope_scaling_factor(spec)  # MLA: its own rope (mla_fields)
    decoder = block_spec(spec, config, use_te, grouped_gemm, torch_expert_gemm, vp_stage)
    own_layers_unfused = config.gradient_accumulation_fusion and not apex_wgrad_available()
    with _apex_check_passed(own_layers_unfused):
        model = GPTModel(
            config=config,
            transformer_layer_spec=decoder,
            mtp_block_spec=mtp_block_spec(spec, config, decoder, use_te, vp_stage),
            vocab_size=padded_vocab,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="yarn" if uses_yarn(spec) else "rope",
            rotary_percent=1.0,
            rotary_base=int(spec.rope_theta),
            rope_scaling=factor is not None,
            rope_scaling_factor=factor or 8.0,
            vp_stage=vp_stage,
        )
    if own_layers_unfused:  # Megatron's own linear layers (the output layer): a .grad that DDP adds to main_grad
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        for module in model.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.gradient_accumulation_fusion = False
    if torch_expert_gemm:
        from mcorekit.models.grouped_mm_experts import keep_expert_counts_on_gpu, skip_identity_sort

        keep_expert_counts_on_gpu(model)
        skip_identity_sort(model)
    return model


def apex_wgrad_available() -> bool:
    """APEX's fused weight-gradient kernel, which Megatron's own linear layers need for gradient_accumulation_fusion
    (TE's layers fuse by themselves)."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def _apex_check_passed(active: bool) -> Iterator[None]:
    """Lets Megatron's ColumnParallelLinear be built with gradient_accumulation_fusion set although APEX is
    missing (it refuses in __init__); build_gpt sets those layers back to the plain weight gradient right after."""
    if not active:
        yield
        return
    from megatron.core.tensor_parallel import layers

    before, layers._grad_accum_fusion_available = layers._grad_accum_fusion_available, True
    try:
        yield
    finally:
        layers._grad_accum_fusion_available = before
