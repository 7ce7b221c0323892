"""Mixtral: Llama's attention, every layer a mixture of experts under `block_sparse_moe` (router `gate`,
experts `w1` = gate, `w3` = up, `w2` = down), top-k then renormalised (no norm_topk_prob switch)."""

from __future__ import annotations

from typing import Any

from mcorekit.models import gpt_weights as gw
from mcorekit.models.families import llama
from mcorekit.models.mapping import WeightMap
from mcorekit.models.registry import Family, TensorRTLLM
from mcorekit.models.spec import ModelSpec, decoder_fields, size_problems, topk_problems

MOE = f"{llama.L}.block_sparse_moe"
EXPERT_COUNTS = ("num_local_experts", "num_experts")  # transformers writes either name
EXPERT = f"{MOE}.experts.{{expert}}"


def num_experts(config: dict[str, Any]) -> int | None:
    return config.get("num_local_experts") or config.get("num_experts")


def read(config: dict[str, Any]) -> ModelSpec:
    return ModelSpec("mixtral", **decoder_fields(config), qkv_bias=bool(config.get("attention_bias", False)),
                     num_experts=num_experts(config), moe_router_topk=config.get("num_experts_per_tok", 2),
                     moe_ffn_hidden_size=config.get("intermediate_size"), moe_norm_topk_prob=True)


def problems(config: dict[str, Any]) -> list[str]:
    out = size_problems(config, optional=EXPERT_COUNTS) + topk_problems(config.get("num_experts_per_tok", 2),
                                                                        num_experts(config))
    if not num_experts(config):
        out.append("num_local_experts (or num_experts) is missing (a mixtral model has experts)")
    if config.get("sliding_window"):
        out.append(f"sliding-window attention (sliding_window={config.get('sliding_window')}) is not supported")
    if config.get("attention_bias"):
        out.append("attention_bias=true is not supported for mixtral")
    return out


def weights(spec: ModelSpec) -> WeightMap:
    return llama.decoder(spec, gw.moe_mlp(spec, norm=llama.POST_ATTENTION_NORM, router=f"{MOE}.gate",
                                          gate=f"{EXPERT}.w1", up=f"{EXPERT}.w3", down=f"{EXPERT}.w2"))


FAMILY = Family("mixtral", ("mixtral",), read, weights, problems, TensorRTLLM("MixtralForCausalLM"),
                peft_default_targets=("q_proj", "v_proj"))
