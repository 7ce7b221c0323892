"""Qwen2 / Qwen2.5: Llama's layout with biases on q/k/v (always: Qwen2 has no switch for them)."""

from __future__ import annotations

from typing import Any

from mcorekit.models import gpt_weights as gw
from mcorekit.models.families import llama
from mcorekit.models.mapping import WeightMap
from mcorekit.models.registry import Family, TensorRTLLM
from mcorekit.models.spec import ModelSpec, decoder_fields


def read(config: dict[str, Any]) -> ModelSpec:
    return ModelSpec("qwen2", **decoder_fields(config), qkv_bias=True)


def weights(spec: ModelSpec) -> WeightMap:
    return llama.decoder(spec, gw.dense_mlp(spec, **llama.MLP))  # q/k/v biases: spec.qkv_bias


FAMILY = Family("qwen2", ("qwen2",), read, weights, trtllm=TensorRTLLM("QWenForCausalLM", qwen_type="qwen2"),
                peft_default_targets=("q_proj", "v_proj"))
