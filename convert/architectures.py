"""Each architecture's whole HF <-> Megatron name map, read top to bottom.

Megatron keys are GPTModel's layer-stacked torch_dist keys with the Transformer Engine layer spec (the keys
Megatron-LM, Megatron-Bridge and NeMo exchange): the input norm lives in linear_qkv (`layer_norm_weight`),
a dense MLP's norm in linear_fc1; MoE layers keep a separate pre_mlp_layernorm.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcorekit.convert.mapping import EXPERT, GLOBAL, QKV, Direct, GatedFC1, Mapping, TEModule, VocabRows
from mcorekit.errors import ConversionError
from mcorekit.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec

ATTN = "decoder.layers.self_attention"
MLP = "decoder.layers.mlp"
HF_LAYER = "model.layers.{layer}"


@dataclass(frozen=True)
class ArchitectureMap:
    mappings: tuple[Mapping, ...]
    te_modules: tuple[TEModule, ...]

    def by_mcore(self) -> dict[str, Mapping]:
        return {m.mcore: m for m in self.mappings}


def _attention(spec: ModelSpec) -> tuple[list[Mapping], list[TEModule]]:
    a = f"{HF_LAYER}.self_attn"
    maps: list[Mapping] = [
        Direct(f"{ATTN}.linear_qkv.layer_norm_weight", (f"{HF_LAYER}.input_layernorm.weight",)),
        QKV(f"{ATTN}.linear_qkv.weight", (f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight")),
        Direct(f"{ATTN}.linear_proj.weight", (f"{a}.o_proj.weight",)),
    ]
    te = [TEModule(f"{ATTN}.linear_qkv"), TEModule(f"{ATTN}.linear_proj")]
    if spec.qkv_bias:  # Qwen2
        maps.append(QKV(f"{ATTN}.linear_qkv.bias", (f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias")))
    if spec.qk_layernorm:  # Qwen3, Qwen3-MoE
        maps += [Direct(f"{ATTN}.q_layernorm.weight", (f"{a}.q_norm.weight",)),
                 Direct(f"{ATTN}.k_layernorm.weight", (f"{a}.k_norm.weight",))]
        te += [TEModule(f"{ATTN}.q_layernorm"), TEModule(f"{ATTN}.k_layernorm")]
    return maps, te


def _dense_mlp() -> tuple[list[Mapping], list[TEModule]]:
    m = f"{HF_LAYER}.mlp"
    return [
        Direct(f"{MLP}.linear_fc1.layer_norm_weight", (f"{HF_LAYER}.post_attention_layernorm.weight",)),
        GatedFC1(f"{MLP}.linear_fc1.weight", (f"{m}.gate_proj.weight", f"{m}.up_proj.weight")),
        Direct(f"{MLP}.linear_fc2.weight", (f"{m}.down_proj.weight",)),
    ], [TEModule(f"{MLP}.linear_fc1"), TEModule(f"{MLP}.linear_fc2")]


def _moe_mlp(router: str, gate: str, up: str, down: str) -> tuple[list[Mapping], list[TEModule]]:
    """Router [experts, hidden] per layer; experts stacked [layers, experts, ...] (global expert ids)."""
    return [
        Direct("decoder.layers.pre_mlp_layernorm.weight", (f"{HF_LAYER}.post_attention_layernorm.weight",)),
        Direct(f"{MLP}.router.weight", (router,)),
        GatedFC1(f"{MLP}.experts.experts.linear_fc1.weight", (gate, up), scope=EXPERT),
        Direct(f"{MLP}.experts.experts.linear_fc2.weight", (down,), scope=EXPERT),
    ], [TEModule("decoder.layers.pre_mlp_layernorm"), TEModule(f"{MLP}.experts.experts.linear_fc1", EXPERT),
        TEModule(f"{MLP}.experts.experts.linear_fc2", EXPERT)]


def architecture_map(spec: ModelSpec) -> ArchitectureMap:
    attn, attn_te = _attention(spec)
    if spec.architecture in ("llama", "qwen2", "qwen3"):
        mlp, mlp_te = _dense_mlp()
    elif spec.architecture == "mixtral":
        e = f"{HF_LAYER}.block_sparse_moe"
        mlp, mlp_te = _moe_mlp(f"{e}.gate.weight", f"{e}.experts.{{expert}}.w1.weight", f"{e}.experts.{{expert}}.w3.weight",
                               f"{e}.experts.{{expert}}.w2.weight")
    elif spec.architecture == "qwen3_moe":
        e = f"{HF_LAYER}.mlp"
        mlp, mlp_te = _moe_mlp(f"{e}.gate.weight", f"{e}.experts.{{expert}}.gate_proj.weight",
                               f"{e}.experts.{{expert}}.up_proj.weight", f"{e}.experts.{{expert}}.down_proj.weight")
    else:
        raise ConversionError(f"no mapping for architecture {spec.architecture!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    maps: list[Mapping] = [VocabRows("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    maps += attn + mlp
    maps.append(Direct("decoder.final_layernorm.weight", ("model.norm.weight",), scope=GLOBAL))
    if not spec.tie_word_embeddings:  # tied: Megatron reuses the embedding, HF has no separate lm_head
        maps.append(VocabRows("output_layer.weight", ("lm_head.weight",)))
    te = attn_te + mlp_te + [TEModule("decoder.final_layernorm", GLOBAL)]
    return ArchitectureMap(tuple(maps), tuple(te))


def check_supported(config: dict) -> None:
    """Config features the mappings do not cover fail here, before any tensor is read."""
    t = config.get("model_type")
    if t == "qwen3_moe":
        if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
            raise ConversionError("qwen3_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported; "
                                  "supported: every layer MoE")
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act={config.get('hidden_act')!r} is not supported; supported: silu (SwiGLU)")
    if config.get("use_sliding_window") or (t in ("llama", "mixtral") and config.get("sliding_window")):
        raise ConversionError(f"sliding-window attention (sliding_window={config.get('sliding_window')}) is not supported")
    if t in ("llama", "mixtral") and config.get("attention_bias"):
        raise ConversionError("attention_bias=true is not supported for llama/mixtral")
    if config.get("mlp_bias"):
        raise ConversionError("mlp_bias=true is not supported")
