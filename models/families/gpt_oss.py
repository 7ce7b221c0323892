"""GPT-OSS (HF `gpt_oss`, bf16 weights): Llama's attention layout with biases on q/k/v/o, a learned softmax sink
per head (`self_attn.sinks`), sliding-window attention on the layers `layer_types` calls "sliding_attention"
(the others full), YaRN rope (truncate=false), every layer a mixture of experts under `mlp` with a biased router
(`mlp.router.{weight,bias}`, top-k on the logits then softmax) and experts whose HF tensors hold every expert:
`mlp.experts.gate_up_proj` [experts, hidden, 2 * ffn] (x @ W; gate and up alternate on the last dim) with its
bias, `mlp.experts.down_proj` [experts, ffn, hidden] with its bias, and the clamped SwiGLU
(up + 1) * g * sigmoid(alpha * g), g = min(gate, limit), up clamped to +-limit.

Megatron-Core 0.19: add_bias_linear, softmax_type=learnable (core_attention.softmax_offset), window_size with
window_attn_skip_freq as a per-layer list, quick_gelu (alpha 1.702) with glu_linear_offset=1 and
activation_func_clamp_value=limit, GPTModel's yarn rope. Megatron keeps fc1 as [gate; up] and x @ W.T, so the
experts are de-interleaved and transposed (exact re-arrangements). Biased experts need expert TP 1 (Megatron).

Refused with the reason: MXFP4 checkpoints (OpenAI's release; dequantize them with transformers first), a
swiglu_alpha other than 1.702 (Megatron's quick_gelu fixes it), layer types other than sliding/full attention."""

from __future__ import annotations

from typing import Any

from mcorekit.models import gpt_weights as gw
from mcorekit.models.families import llama
from mcorekit.models.mapping import WeightMap
from mcorekit.models.registry import Family
from mcorekit.models.spec import ModelSpec, decoder_fields, number_or, size_problems, topk_problems

MLP = f"{llama.L}.mlp"
QUICK_GELU_ALPHA = 1.702
LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(config: dict[str, Any]) -> list[str]:
    """HF's default when the config has none: sliding on even layers, full on odd ones."""
    return config.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(config["num_hidden_layers"])]


def read(config: dict[str, Any]) -> ModelSpec:
    types = layer_types(config)
    window = config.get("sliding_window") if "sliding_attention" in types else None
    return ModelSpec("gpt_oss", **decoder_fields(config, rope_types=("yarn",)),
                     qkv_bias=bool(config.get("attention_bias", True)), linear_bias=True, attention_sinks=True,
                     num_experts=config["num_local_experts"], moe_router_topk=config["num_experts_per_tok"],
                     moe_ffn_hidden_size=config["intermediate_size"], moe_norm_topk_prob=True,
                     sliding_window=window, window_layers=tuple(int(t == "sliding_attention") for t in types) if window else None,
                     activation="gpt_oss", glu_clamp=number_or(config.get("swiglu_limit"), 7.0))


def problems(config: dict[str, Any]) -> list[str]:
    out = (size_problems(config, ("num_local_experts", "num_experts_per_tok"), ("sliding_window",))
           or topk_problems(config["num_experts_per_tok"], config["num_local_experts"]))
    if out:
        return out
    quant = config.get("quantization_config") or {}
    if quant:
        out.append(f"{quant.get('quant_method', 'quantized')} weights are not converted (MXFP4 experts would need "
                   f"dequantizing on read, which is not built); save a bf16 copy first with transformers "
                   f"(Mxfp4Config(dequantize=True)) and convert that")
    if float(config.get("swiglu_alpha", QUICK_GELU_ALPHA)) != QUICK_GELU_ALPHA:
        out.append(f"swiglu_alpha={config.get('swiglu_alpha')} is not supported: Megatron-Core's clamped GLU uses "
                   f"quick_gelu, whose alpha is fixed at {QUICK_GELU_ALPHA}")
    if config.get("attention_bias") is False:
        out.append("attention_bias=false is not supported for gpt_oss (its output projection bias is always mapped)")
    types = layer_types(config)
    if not isinstance(types, list) or len(types) != config["num_hidden_layers"] or set(types) - set(LAYER_TYPES):
        out.append(f"layer_types {types!r}: one of {LAYER_TYPES} per layer is supported")
    elif "sliding_attention" in types and not config.get("sliding_window"):
        out.append("sliding_attention layers without a sliding_window")
    return out


def weights(spec: ModelSpec) -> WeightMap:
    attn = gw.attention(spec, **llama.ATTENTION)
    extras = gw.attention_extras(spec, o=llama.ATTENTION["o"], sinks=f"{llama.L}.self_attn.sinks")
    moe = gw.stacked_experts_mlp(spec, norm=llama.POST_ATTENTION_NORM, router=f"{MLP}.router",
                                 gate_up=f"{MLP}.experts.gate_up_proj", down=f"{MLP}.experts.down_proj")
    return WeightMap.of(gw.embedding(spec, "model.embed_tokens"), attn, extras, moe,
                        gw.final_norm(spec, "model.norm"), gw.output_layer(spec, "lm_head"))


FAMILY = Family("gpt_oss", ("gpt_oss",), read, weights, problems, trtllm=None,
                no_engine="TensorRT-LLM serves GPT-OSS (attention sinks, clamped SwiGLU) from its PyTorch backend "
                          "only; its TensorRT engine workflow has no GptOss checkpoint format")
