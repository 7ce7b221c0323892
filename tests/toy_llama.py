"""A test-only architecture family, written as a file of models/families/ would be: "toy_llama", a Llama with
its own HF model_type and every HF tensor renamed. tests/test_model_registry.py registers it (models.registry.
register) and runs it through convert/ and export/ without any other change, which is what adding an
architecture takes.

HF names: tok_emb, blocks.N.{attn_norm, attn.{wq,wk,wv,wo}, ffn_norm, ffn.{w_gate,w_up,w_down}}, out_norm, head.
"""

from __future__ import annotations

from typing import Any

from mcorekit.models import gpt_weights as gw
from mcorekit.models.mapping import WeightMap
from mcorekit.models.registry import Family, TensorRTLLM
from mcorekit.models.spec import ModelSpec, decoder_fields

B = "blocks.{layer}"
# toy name -> the Llama name it stands for (the test renames a Llama checkpoint with it)
LLAMA_NAMES = {"tok_emb": "model.embed_tokens", "out_norm": "model.norm", "head": "lm_head",
               f"{B}.attn_norm": "model.layers.{layer}.input_layernorm",
               f"{B}.attn.wq": "model.layers.{layer}.self_attn.q_proj",
               f"{B}.attn.wk": "model.layers.{layer}.self_attn.k_proj",
               f"{B}.attn.wv": "model.layers.{layer}.self_attn.v_proj",
               f"{B}.attn.wo": "model.layers.{layer}.self_attn.o_proj",
               f"{B}.ffn_norm": "model.layers.{layer}.post_attention_layernorm",
               f"{B}.ffn.w_gate": "model.layers.{layer}.mlp.gate_proj",
               f"{B}.ffn.w_up": "model.layers.{layer}.mlp.up_proj",
               f"{B}.ffn.w_down": "model.layers.{layer}.mlp.down_proj"}


def read(config: dict[str, Any]) -> ModelSpec:
    return ModelSpec("toy_llama", **decoder_fields(config))


def weights(spec: ModelSpec) -> WeightMap:
    return WeightMap.of(
        gw.embedding(spec, "tok_emb"),
        gw.attention(spec, norm=f"{B}.attn_norm", q=f"{B}.attn.wq", k=f"{B}.attn.wk", v=f"{B}.attn.wv", o=f"{B}.attn.wo"),
        gw.dense_mlp(spec, norm=f"{B}.ffn_norm", gate=f"{B}.ffn.w_gate", up=f"{B}.ffn.w_up", down=f"{B}.ffn.w_down"),
        gw.final_norm(spec, "out_norm"),
        gw.output_layer(spec, "head"),
    )


FAMILY = Family("toy_llama", ("toy_llama",), read, weights, trtllm=TensorRTLLM("LlamaForCausalLM"))
