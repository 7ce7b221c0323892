"""ModelSpec -> Megatron-Core GPTModel. train/ builds its model here and convert/ checks its keys against it.

GPTModel, not HybridModel: the checkpoints users exchange (Megatron-LM, Megatron-Bridge, NeMo) carry GPTModel's
layer-stacked keys, and convert/ must produce what those tools load. GPTModel's 0.19 deprecation notice is
about where new features land, not about removal.
"""

from __future__ import annotations

from typing import Any

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


def transformer_config(spec: ModelSpec, par: Layout = Layout(), params_dtype: torch.dtype = torch.float32,
                       cpu_init: bool = False, **overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

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
        kwargs.update(
            num_moe_experts=spec.num_experts,
            moe_router_topk=spec.moe_router_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size,
            # top-k then softmax (Mixtral) equals softmax, top-k, renormalise (Qwen3-MoE norm_topk_prob=true)
            moe_router_pre_softmax=not spec.moe_norm_topk_prob,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.0,
        )
        if spec.moe_shared_expert_ffn_hidden_size:  # Qwen2-MoE: a gated shared expert beside the routed ones
            kwargs.update(moe_shared_expert_intermediate_size=spec.moe_shared_expert_ffn_hidden_size,
                          moe_shared_expert_gate=spec.moe_shared_expert_gate)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(spec: ModelSpec, use_te: bool, grouped_gemm: bool = False, torch_expert_gemm: bool = False) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        te_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.num_experts, moe_grouped_gemm=grouped_gemm, qk_layernorm=spec.qk_layernorm)
        if spec.is_moe and grouped_gemm and torch_expert_gemm:
            from mcorekit.models.grouped_mm_experts import use_grouped_mm_experts

            te_spec = use_grouped_mm_experts(te_spec)
        return te_spec
    from mcorekit.models.sdpa_attention import SDPAttention

    local = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=spec.num_experts, moe_grouped_gemm=grouped_gemm, qk_layernorm=spec.qk_layernorm, normalization="RMSNorm")
    # PyTorch's fused SDPA instead of Megatron's unfused local attention (no parameters: checkpoints unchanged)
    local.submodules.self_attention.submodules.core_attention = SDPAttention
    if spec.is_moe:
        # The local spec renames pre_mlp_layernorm to the dense TE name (mlp.linear_fc1.layer_norm_weight) even in
        # MoE layers, where the TE spec keeps decoder.layers.pre_mlp_layernorm.weight; keep the TE name so
        # checkpoints move between the two specs.
        keys_map = dict(local.submodules.sharded_state_dict_keys_map)
        keys_map.pop("pre_mlp_layernorm.", None)
        local.submodules.sharded_state_dict_keys_map = keys_map
    return local


def build_gpt(spec: ModelSpec, config: Any, padded_vocab: int, use_te: bool, grouped_gemm: bool = False,
              pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
              torch_expert_gemm: bool = False) -> Any:
    from megatron.core.models.gpt import GPTModel

    factor = rope_scaling_factor(spec)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, use_te, grouped_gemm, torch_expert_gemm),
        vocab_size=padded_vocab,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(spec.rope_theta),
        rope_scaling=factor is not None,
        rope_scaling_factor=factor or 8.0,
        vp_stage=vp_stage,
    )
