"""Target `engine` (TensorRT-LLM <= 1.2): `config.json` + `rank{N}.safetensors` per mapping rank, the input
of `trtllm-build`.

Ranks: rank = pp_rank * tp + tp_rank; experts are parallel inside the TP group (moe_tp * moe_ep = tp,
moe_tp_rank = tp_rank // moe_ep, moe_ep_rank = tp_rank % moe_ep). Per rank, layer names use local indices
(`transformer.layers.0` is the stage's first layer). The HF tensors of each GPTModel tensor and how TP splits
them (column: dim 0, row: dim 1, replicated) come from the family's weight map (models/families/); what
TensorRT-LLM calls each is below. Besides those splits:
  attention.qkv    [Q_r; K_r; V_r] (not interleaved); KV heads duplicated when there are fewer than TP
  mlp.fc = gate, mlp.gate = up (dense MLP)
  MoE: mlp.router fp32 replicated; mlp.fc = [up; gate] per local expert, mlp.proj = down, split by moe_tp;
       the shared expert's mlp.shared_expert.fc = [up; gate], split by TP
  lm_head padded to a multiple of TP and split by rows; vocab_embedding replicated on the first stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mcorekit.convert.hf_io import HFReader, copy_assets
from mcorekit.errors import ExportError, ModelError
from mcorekit.export import fp8
from mcorekit.export.targets import check_layout
from mcorekit.models import dtypes, registry
from mcorekit.models import gpt_weights as gw
from mcorekit.models.mapping import EXPERT, GLOBAL, HF_SPLIT_DIM, REPLICATED, Mapping
from mcorekit.models.parallel import Layout
from mcorekit.models.spec import ModelSpec

RENORMALIZE, NO_NORMALIZATION = 1, 0  # TensorRT-LLM MoeConfig.ExpertScaleNormalizationMode
# GPTModel tensor -> TensorRT-LLM's name for it in transformer.layers.N (one HF tensor each, split as the map says).
LAYER_NAMES = {
    gw.INPUT_NORM: "input_layernorm",
    gw.PROJ: "attention.dense",
    gw.Q_NORM: "attention.q_layernorm",
    gw.K_NORM: "attention.k_layernorm",
    gw.FC1_NORM: "post_layernorm",
    gw.PRE_MLP_NORM: "post_layernorm",
    gw.FC2: "mlp.proj",
    gw.SHARED_FC2: "mlp.shared_expert.proj",
    gw.SHARED_GATE: "mlp.shared_expert_gate",
}


def check(spec: ModelSpec, layout: Layout) -> None:
    """What this target needs beyond the layout: a TensorRT-LLM architecture for the family, a rope scaling it
    writes, and a writer for every tensor of its map (checked before anything is written)."""
    trtllm_names(spec)
    rotary_scaling(spec)
    amap = registry.weight_map(spec)
    known = set(LAYER_NAMES) | {gw.EMBEDDING, gw.OUTPUT, gw.FINAL_NORM, gw.QKV_WEIGHT, gw.QKV_BIAS, gw.FC1, gw.SHARED_FC1,
                                gw.ROUTER, gw.EXPERT_FC1, gw.EXPERT_FC2}
    unknown = [m.mcore for m in amap.mappings if m.mcore not in known]
    if unknown:
        raise ExportError(f"the engine target does not write {', '.join(unknown)} ({spec.architecture}); use --target pytorch")


def trtllm_names(spec: ModelSpec) -> registry.TensorRTLLM:
    try:
        names = registry.family(spec.architecture).trtllm
    except ModelError as e:
        raise ExportError(str(e)) from None
    if names is None:
        why = registry.family(spec.architecture).no_engine
        raise ExportError(f"the engine target has no TensorRT-LLM architecture for {spec.architecture}"
                          f"{f' ({why})' if why else ''}; use --target pytorch")
    return names


def rotary_scaling(spec: ModelSpec) -> dict[str, Any] | None:
    """config.json's rotary_scaling: none for plain rope (HF's "default" type included), llama3's with its fields."""
    rs = spec.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ExportError(f"the engine target writes llama3 rope scaling only, not {kind!r} ({spec.architecture}); "
                          f"use --target pytorch")
    return {"type": "llama3", **{k: v for k, v in rs.items() if k not in ("rope_type", "type")}}


def trtllm_config(spec: ModelSpec, dtype: str, layout: Layout, quant_algo: str | None) -> dict[str, Any]:
    names = trtllm_names(spec)
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    cfg: dict[str, Any] = {
        "architecture": names.architecture,
        "dtype": dtype,
        "logits_dtype": "float32",
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "hidden_size": spec.hidden_size,
        "head_size": spec.kv_channels,
        "intermediate_size": spec.ffn_hidden_size,
        "vocab_size": spec.vocab_size,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "norm_epsilon": spec.norm_epsilon,
        "rotary_base": spec.rope_theta,
        "rotary_scaling": rotary_scaling(spec),
        "qk_layernorm": spec.qk_layernorm,
        "bias": False,
        "attn_bias": spec.qkv_bias,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "share_embedding_table": False,
        "use_parallel_embedding": False,
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "cp_size": 1,
                    "moe_tp_size": tp // ep if spec.is_moe else tp, "moe_ep_size": ep if spec.is_moe else 1},
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None,
                         "exclude_modules": ["lm_head", "*router"] if quant_algo else None},
    }
    if names.qwen_type:
        cfg["qwen_type"] = names.qwen_type
    if spec.is_moe:
        shared = spec.moe_shared_expert_ffn_hidden_size or 0
        cfg["moe"] = {"num_experts": spec.num_experts, "top_k": spec.moe_router_topk, "shared_expert_intermediate_size": shared,
                      "normalization_mode": RENORMALIZE if spec.moe_norm_topk_prob else NO_NORMALIZATION}
        cfg["moe_intermediate_size"] = spec.moe_ffn_hidden_size
        if shared:
            cfg["moe_shared_expert_intermediate_size"] = shared
    return cfg


def _chunk(t: torch.Tensor, parts: int, rank: int, dim: int | None) -> torch.Tensor:
    return t if parts == 1 or dim is None else torch.chunk(t, parts, dim=dim)[rank].contiguous()


def _kv_for_rank(t: torch.Tensor, spec: ModelSpec, tp: int, rank: int) -> torch.Tensor:
    """K or V rows of this TP rank: a contiguous block of heads, or one duplicated head when heads < TP."""
    g, d = spec.num_query_groups, spec.kv_channels
    if g >= tp:
        return _chunk(t, tp, rank, 0)
    head = rank // (tp // g)
    return t[head * d:(head + 1) * d].contiguous()


def write(reader: HFReader, spec: ModelSpec, out: Path, layout: Layout, dtype: str,
          scales: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> int:
    check_layout(spec, layout)
    check(spec, layout)
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    quant = "FP8" if scales else None
    (out / "config.json").write_text(json.dumps(trtllm_config(spec, dtypes.NAMES[dtype], layout, quant), indent=2) + "\n")
    amap = registry.weight_map(spec)
    entries = amap.by_mcore()
    torch_dtype = dtypes.to_torch(dtype)
    per_stage = spec.num_layers // pp
    moe_ep = ep if spec.is_moe else 1
    moe_tp = tp // moe_ep
    total = 0

    def get(name: str, cast: bool = True) -> torch.Tensor:
        """HF tensor `name` in --dtype, or as stored (`cast=False`: a linear's weight, which FP8 rounds only once)."""
        return reader.get(name).to(torch_dtype) if cast else reader.get(name)

    def split(name: str, m: Mapping, parts: int, rank: int, cast: bool = True) -> torch.Tensor:
        """HF tensor `name` of entry m, this rank's part of it (split on the dim the entry's TP split implies)."""
        return _chunk(get(name, cast), parts, rank, HF_SPLIT_DIM[m.split])

    for p in range(pp):
        for t in range(tp):
            w: dict[str, torch.Tensor] = {}

            def linear(prefix: str, parts: list[torch.Tensor], hf_names: list[str]) -> None:
                """Store a (possibly fused) linear from this rank's parts of its HF weights as stored: FP8 quantizes
                them with the modules' shared scales, rounding the source once (as the pytorch target does); else
                they are cast to the dtype."""
                module = hf_names[0].removesuffix(".weight")
                if scales and module in scales:
                    w_scale, a_scale = scales[module]
                    w[f"{prefix}.weight"] = fp8.quantize(torch.cat([x.float() for x in parts]), w_scale)
                    w[f"{prefix}.weights_scaling_factor"] = w_scale.reshape(1).clone()
                    w[f"{prefix}.activation_scaling_factor"] = a_scale.reshape(1).clone()
                else:
                    w[f"{prefix}.weight"] = torch.cat([x.to(torch_dtype) for x in parts])

            if p == 0:
                w["transformer.vocab_embedding.weight"] = get(amap.hf(gw.EMBEDDING)[0])
            for i in range(per_stage):
                layer = p * per_stage + i
                tl = f"transformer.layers.{i}"
                for m in amap.mappings:
                    if m.scope in (GLOBAL, EXPERT):
                        continue
                    names = m.hf_names(layer)
                    if m.mcore in (gw.QKV_WEIGHT, gw.QKV_BIAS):
                        q, k, v = names
                        qkv = [_chunk(get(q, cast=False), tp, t, 0), _kv_for_rank(get(k, cast=False), spec, tp, t),
                               _kv_for_rank(get(v, cast=False), spec, tp, t)]
                        if m.mcore == gw.QKV_WEIGHT:
                            linear(f"{tl}.attention.qkv", qkv, names)
                        else:
                            w[f"{tl}.attention.qkv.bias"] = torch.cat([x.to(torch_dtype) for x in qkv])
                    elif m.mcore == gw.FC1:
                        gate, up = names
                        linear(f"{tl}.mlp.fc", [split(gate, m, tp, t, cast=False)], [gate])
                        linear(f"{tl}.mlp.gate", [split(up, m, tp, t, cast=False)], [up])
                    elif m.mcore == gw.SHARED_FC1:
                        gate, up = names
                        linear(f"{tl}.mlp.shared_expert.fc",
                               [split(up, m, tp, t, cast=False), split(gate, m, tp, t, cast=False)], [up])
                    elif m.mcore == gw.ROUTER:
                        w[f"{tl}.mlp.router.weight"] = reader.get(names[0]).float()
                    elif m.split == REPLICATED:
                        w[f"{tl}.{LAYER_NAMES[m.mcore]}.weight"] = split(names[0], m, tp, t)
                    else:
                        linear(f"{tl}.{LAYER_NAMES[m.mcore]}", [split(names[0], m, tp, t, cast=False)], names)
                if spec.is_moe:
                    fc1, fc2 = entries[gw.EXPERT_FC1], entries[gw.EXPERT_FC2]
                    local = spec.num_experts // moe_ep
                    experts = range((t % moe_ep) * local, (t % moe_ep + 1) * local)
                    r = t // moe_ep
                    fc = []
                    for x in experts:
                        gate, up = fc1.hf_names(layer, x)
                        fc.append(torch.cat([split(up, fc1, moe_tp, r), split(gate, fc1, moe_tp, r)]))
                    w[f"{tl}.mlp.fc.weight"] = torch.stack(fc)
                    w[f"{tl}.mlp.proj.weight"] = torch.stack([split(fc2.hf_names(layer, x)[0], fc2, moe_tp, r) for x in experts])
            if p == pp - 1:
                w["transformer.ln_f.weight"] = get(amap.hf(gw.FINAL_NORM)[0])
                head = get(amap.hf(gw.EMBEDDING if spec.tie_word_embeddings else gw.OUTPUT)[0])
                padded = -(-head.shape[0] // tp) * tp
                if padded != head.shape[0]:
                    head = torch.cat([head, head.new_zeros(padded - head.shape[0], head.shape[1])])
                w["lm_head.weight"] = _chunk(head, tp, t, 0)
            save_file({k: v.contiguous() for k, v in w.items()}, str(out / f"rank{p * tp + t}.safetensors"))
            total += sum(v.numel() * v.element_size() for v in w.values())
    (out / "hf").mkdir()
    # the tokenizer for serving the engine, and its config.json without a source's quantization_config: these
    # weights are the engine's own (config.json beside the rank files), whatever the source was quantized as
    config = dict(reader.config)
    copy_assets(reader.path, out / "hf", config if config.pop("quantization_config", None) is not None else None)
    return total
