"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases), every layer a mixture of experts
under `mlp` (router `mlp.gate`, experts `mlp.experts.E.{gate,up,down}_proj`) plus one shared expert every token
passes through (`mlp.shared_expert.{gate,up,down}_proj`), scaled by sigmoid(`mlp.shared_expert_gate`): Megatron's
SharedExpertMLP with moe_shared_expert_gate. Softmax over all experts, then top-k, renormalised only when
norm_topk_prob (false by default)."""

from __future__ import annotations

from typing import Any

from mcorekit.models import gpt_weights as gw
from mcorekit.models.families import llama
from mcorekit.models.mapping import WeightMap
from mcorekit.models.registry import Family, TensorRTLLM
from mcorekit.models.spec import ModelSpec, decoder_fields, size_problems, topk_problems

MLP = f"{llama.L}.mlp"
EXPERT = f"{MLP}.experts.{{expert}}"
SHARED = f"{MLP}.shared_expert"


def read(config: dict[str, Any]) -> ModelSpec:
    return ModelSpec("qwen2_moe", **decoder_fields(config), qkv_bias=bool(config.get("qkv_bias", True)),
                     num_experts=config.get("num_local_experts") or config.get("num_experts"),
                     moe_router_topk=config.get("num_experts_per_tok", 2),
                     moe_ffn_hidden_size=config.get("moe_intermediate_size"),
                     moe_norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                     moe_shared_expert_ffn_hidden_size=config.get("shared_expert_intermediate_size"),
                     moe_shared_expert_gate=True)


def problems(config: dict[str, Any]) -> list[str]:
    sizes = ("moe_intermediate_size", "shared_expert_intermediate_size")
    out = size_problems(config, optional=("num_local_experts", "num_experts", *sizes))
    experts = config.get("num_local_experts") or config.get("num_experts")
    out += topk_problems(config.get("num_experts_per_tok", 2), experts)
    if not experts:
        out.append("num_local_experts (or num_experts) is missing (a qwen2_moe model has experts)")
    out += [f"{k} is missing (a qwen2_moe model has it)" for k in sizes if not config.get(k)]
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        out.append("qwen2_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported; "
                   "supported: every layer MoE")
    return out


def weights(spec: ModelSpec) -> WeightMap:
    moe = gw.moe_mlp(spec, norm=llama.POST_ATTENTION_NORM, router=f"{MLP}.gate", gate=f"{EXPERT}.gate_proj",
                     up=f"{EXPERT}.up_proj", down=f"{EXPERT}.down_proj")
    shared = gw.shared_expert(spec, gate=f"{SHARED}.gate_proj", up=f"{SHARED}.up_proj", down=f"{SHARED}.down_proj",
                              gate_weight=f"{MLP}.shared_expert_gate")
    return llama.decoder(spec, moe, shared)


FAMILY = Family("qwen2_moe", ("qwen2_moe",), read, weights, problems,
                TensorRTLLM("QWenForCausalLM", qwen_type="qwen2_moe"))
