"""Llama 2/3 (Llama 3.x rope scaling: rope_type llama3), and the HF layout the other decoder families here share:
`model.embed_tokens`, `model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
mlp.{gate,up,down}_proj}`, `model.norm`, `lm_head`."""

from __future__ import annotations

from typing import Any

from mcorekit.models import gpt_weights as gw
from mcorekit.models.mapping import Part, WeightMap
from mcorekit.models.registry import Family, TensorRTLLM
from mcorekit.models.spec import ModelSpec, decoder_fields

L = "model.layers.{layer}"
ATTENTION = dict(norm=f"{L}.input_layernorm", q=f"{L}.self_attn.q_proj", k=f"{L}.self_attn.k_proj",
                 v=f"{L}.self_attn.v_proj", o=f"{L}.self_attn.o_proj")
POST_ATTENTION_NORM = f"{L}.post_attention_layernorm"
MLP = dict(norm=POST_ATTENTION_NORM, gate=f"{L}.mlp.gate_proj", up=f"{L}.mlp.up_proj", down=f"{L}.mlp.down_proj")


def decoder(spec: ModelSpec, *mlp: Part, q_norm: str | None = None, k_norm: str | None = None) -> WeightMap:
    """A decoder in this HF layout: embeddings, attention (q/k norms when the family has them), the given MLP
    parts, final norm and (untied) head."""
    return WeightMap.of(gw.embedding(spec, "model.embed_tokens"),
                        gw.attention(spec, **ATTENTION, q_norm=q_norm, k_norm=k_norm), *mlp,
                        gw.final_norm(spec, "model.norm"), gw.output_layer(spec, "lm_head"))


def read(config: dict[str, Any]) -> ModelSpec:
    return ModelSpec("llama", **decoder_fields(config), qkv_bias=bool(config.get("attention_bias", False)))


def problems(config: dict[str, Any]) -> list[str]:
    """Llama's config names sliding windows and biases its own way (no use_sliding_window switch)."""
    out = []
    if config.get("sliding_window"):
        out.append(f"sliding-window attention (sliding_window={config.get('sliding_window')}) is not supported")
    if config.get("attention_bias"):
        out.append("attention_bias=true is not supported for llama")
    return out


def weights(spec: ModelSpec) -> WeightMap:
    return decoder(spec, gw.dense_mlp(spec, **MLP))


FAMILY = Family("llama", ("llama",), read, weights, problems, TensorRTLLM("LlamaForCausalLM"),
                peft_default_targets=("q_proj", "v_proj"))
