"""Qwen3-MoE: Qwen3's attention (q/k norms), every layer a mixture of experts under `mlp` (router `mlp.gate`,
experts `mlp.experts.E.{gate,up,down}_proj`), renormalised top-k when norm_topk_prob."""

from __future__ import annotations

from typing import Any

from mcorekit.models import gpt_weights as gw
from mcorekit.models.families import llama, qwen3
from mcorekit.models.mapping import WeightMap
from mcorekit.models.registry import Family, TensorRTLLM
from mcorekit.models.spec import ModelSpec, decoder_fields, size_problems, topk_problems

EXPERT = f"{llama.L}.mlp.experts.{{expert}}"


def read(config: dict[str, Any]) -> ModelSpec:
    return ModelSpec("qwen3_moe", **decoder_fields(config), qkv_bias=bool(config.get("attention_bias", False)),
                     qk_layernorm=True, num_experts=config.get("num_local_experts") or config.get("num_experts"),
                     moe_router_topk=config.get("num_experts_per_tok", 2),
                     moe_ffn_hidden_size=config.get("moe_intermediate_size"),
                     moe_norm_topk_prob=bool(config.get("norm_topk_prob", True)))


def problems(config: dict[str, Any]) -> list[str]:
    out = size_problems(config, optional=("num_local_experts", "num_experts", "moe_intermediate_size"))
    experts = config.get("num_local_experts") or config.get("num_experts")
    out += topk_problems(config.get("num_experts_per_tok", 2), experts)
    if not experts:
        out.append("num_local_experts (or num_experts) is missing (a qwen3_moe model has experts)")
    if not config.get("moe_intermediate_size"):
        out.append("moe_intermediate_size is missing")
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        out.append("qwen3_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported; "
                   "supported: every layer MoE")
    return out


def weights(spec: ModelSpec) -> WeightMap:
    moe = gw.moe_mlp(spec, norm=llama.POST_ATTENTION_NORM, router=f"{llama.L}.mlp.gate", gate=f"{EXPERT}.gate_proj",
                     up=f"{EXPERT}.up_proj", down=f"{EXPERT}.down_proj")
    return llama.decoder(spec, moe, **qwen3.QK_NORMS)


FAMILY = Family("qwen3_moe", ("qwen3_moe",), read, weights, problems,
                TensorRTLLM("QWenForCausalLM", qwen_type="qwen3_moe"), peft_moves_mlp_to_experts=True)
