"""Qwen3: Llama's layout with RMS norms on q and k per head (`self_attn.q_norm` / `k_norm`), and a head_dim
that need not be hidden/heads."""

from __future__ import annotations

from typing import Any

from mcorekit.models import gpt_weights as gw
from mcorekit.models.families import llama
from mcorekit.models.mapping import WeightMap
from mcorekit.models.registry import Family, TensorRTLLM
from mcorekit.models.spec import ModelSpec, decoder_fields

QK_NORMS = dict(q_norm=f"{llama.L}.self_attn.q_norm", k_norm=f"{llama.L}.self_attn.k_norm")


def read(config: dict[str, Any]) -> ModelSpec:
    return ModelSpec("qwen3", **decoder_fields(config), qkv_bias=bool(config.get("attention_bias", False)),
                     qk_layernorm=True)


def weights(spec: ModelSpec) -> WeightMap:
    return llama.decoder(spec, gw.dense_mlp(spec, **llama.MLP), **QK_NORMS)


FAMILY = Family("qwen3", ("qwen3",), read, weights, trtllm=TensorRTLLM("QWenForCausalLM", qwen_type="qwen3"),
                peft_default_targets=("q_proj", "v_proj"))
