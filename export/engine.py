"""Target `engine` (TensorRT-LLM <= 1.2): `config.json` + `rank{N}.safetensors` per mapping rank, the input
of `trtllm-build`.

Ranks: rank = pp_rank * tp + tp_rank; experts are parallel inside the TP group (moe_tp * moe_ep = tp,
moe_tp_rank = tp_rank // moe_ep, moe_ep_rank = tp_rank % moe_ep). Per rank, layer names use local indices
(`transformer.layers.0` is the stage's first layer). Splits:
  attention.qkv    [Q_r; K_r; V_r] (not interleaved); KV heads duplicated when there are fewer than TP
  attention.dense  o_proj split on its input dim
  mlp.fc = gate, mlp.gate = up (split on output dim), mlp.proj = down (split on input dim)
  MoE: mlp.router fp32 replicated; mlp.fc = [up; gate] per local expert, mlp.proj = down, split by moe_tp
  lm_head padded to a multiple of TP and split by rows; vocab_embedding replicated on the first stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mcorekit.convert.hf_io import HFReader
from mcorekit.errors import ExportError
from mcorekit.export import fp8
from mcorekit.models.spec import ModelSpec

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", None),
    "mixtral": ("MixtralForCausalLM", None),
    "qwen2": ("QWenForCausalLM", "qwen2"),
    "qwen3": ("QWenForCausalLM", "qwen3"),
    "qwen3_moe": ("QWenForCausalLM", "qwen3_moe"),
}
RENORMALIZE, NO_NORMALIZATION = 1, 0  # TensorRT-LLM MoeConfig.ExpertScaleNormalizationMode


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int) -> None:
    """TP/PP/EP must be >= 1 and split the model evenly (both targets: TensorRT-LLM splits it this way)."""
    bad = [f"--{k}={v}" for k, v in (("tp", tp), ("pp", pp), ("ep", ep)) if not isinstance(v, int) or v < 1]
    if bad:
        raise ExportError(f"{', '.join(bad)}: parallel sizes must be integers >= 1")
    problems = []
    if spec.num_attention_heads % tp:
        problems.append(f"TP={tp} does not divide num_attention_heads={spec.num_attention_heads}")
    g = spec.num_query_groups
    if (g % tp) and (tp % g):
        problems.append(f"TP={tp} and num_key_value_heads={g}: one must divide the other (KV heads are split or duplicated)")
    if spec.num_layers % pp:
        problems.append(f"PP={pp} does not divide num_hidden_layers={spec.num_layers}")
    if spec.is_moe:
        if tp % ep:
            problems.append(f"EP={ep} must divide TP={tp} (TensorRT-LLM places experts inside the TP group: moe_tp * moe_ep = tp)")
        elif spec.num_experts % ep:
            problems.append(f"EP={ep} does not divide num_experts={spec.num_experts}")
        elif (spec.moe_ffn_hidden_size or spec.ffn_hidden_size) % (tp // ep):
            problems.append(f"moe_tp={tp // ep} does not divide the expert FFN size")
    else:
        if ep != 1:
            problems.append(f"EP={ep} given for a dense model")
        if spec.ffn_hidden_size % tp:
            problems.append(f"TP={tp} does not divide intermediate_size={spec.ffn_hidden_size}")
    if problems:
        raise ExportError("layout does not fit the model: " + "; ".join(problems))


def trtllm_config(spec: ModelSpec, dtype: str, tp: int, pp: int, ep: int, quant_algo: str | None) -> dict[str, Any]:
    arch, qwen_type = ARCHITECTURES[spec.architecture]
    rope_scaling = None
    if spec.rope_scaling:
        rope_scaling = {"type": "llama3", **{k: v for k, v in spec.rope_scaling.items() if k not in ("rope_type", "type")}}
    cfg: dict[str, Any] = {
        "architecture": arch,
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
        "rotary_scaling": rope_scaling,
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
    if qwen_type:
        cfg["qwen_type"] = qwen_type
    if spec.is_moe:
        cfg["moe"] = {"num_experts": spec.num_experts, "top_k": spec.moe_router_topk, "shared_expert_intermediate_size": 0,
                      "normalization_mode": RENORMALIZE if spec.moe_norm_topk_prob else NO_NORMALIZATION}
        cfg["moe_intermediate_size"] = spec.moe_ffn_hidden_size
    return cfg


def _chunk(t: torch.Tensor, parts: int, rank: int, dim: int) -> torch.Tensor:
    return t if parts == 1 else torch.chunk(t, parts, dim=dim)[rank].contiguous()


def _kv_for_rank(t: torch.Tensor, spec: ModelSpec, tp: int, rank: int) -> torch.Tensor:
    """K or V rows of this TP rank: a contiguous block of heads, or one duplicated head when heads < TP."""
    g, d = spec.num_query_groups, spec.kv_channels
    if g >= tp:
        return _chunk(t, tp, rank, 0)
    head = rank // (tp // g)
    return t[head * d:(head + 1) * d].contiguous()


def write(reader: HFReader, spec: ModelSpec, out: Path, tp: int, pp: int, ep: int, dtype: torch.dtype,
          dtype_name: str, scales: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> int:
    check_layout(spec, tp, pp, ep)
    quant = "FP8" if scales else None
    (out / "config.json").write_text(json.dumps(trtllm_config(spec, dtype_name, tp, pp, ep, quant), indent=2) + "\n")
    per_stage = spec.num_layers // pp
    moe_ep = ep if spec.is_moe else 1
    moe_tp = tp // moe_ep
    total = 0

    def get(name: str) -> torch.Tensor:
        return reader.get(name).to(dtype)

    for p in range(pp):
        for t in range(tp):
            w: dict[str, torch.Tensor] = {}

            def linear(prefix: str, weight: torch.Tensor, hf_modules: list[str]) -> None:
                """Store a (possibly fused) linear, FP8-quantized with the modules' shared scales when asked."""
                if scales and hf_modules[0] in scales:
                    w_scale, a_scale = scales[hf_modules[0]]
                    w[f"{prefix}.weight"] = fp8.quantize(weight, w_scale)
                    w[f"{prefix}.weights_scaling_factor"] = w_scale.reshape(1).clone()
                    w[f"{prefix}.activation_scaling_factor"] = a_scale.reshape(1).clone()
                else:
                    w[f"{prefix}.weight"] = weight

            if p == 0:
                w["transformer.vocab_embedding.weight"] = get("model.embed_tokens.weight")
            for i in range(per_stage):
                layer = p * per_stage + i
                hf, tl = f"model.layers.{layer}", f"transformer.layers.{i}"
                a = f"{hf}.self_attn"
                q = _chunk(get(f"{a}.q_proj.weight"), tp, t, 0)
                k = _kv_for_rank(get(f"{a}.k_proj.weight"), spec, tp, t)
                v = _kv_for_rank(get(f"{a}.v_proj.weight"), spec, tp, t)
                linear(f"{tl}.attention.qkv", torch.cat([q, k, v]), [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"])
                if spec.qkv_bias:
                    w[f"{tl}.attention.qkv.bias"] = torch.cat([
                        _chunk(get(f"{a}.q_proj.bias"), tp, t, 0), _kv_for_rank(get(f"{a}.k_proj.bias"), spec, tp, t),
                        _kv_for_rank(get(f"{a}.v_proj.bias"), spec, tp, t)])
                linear(f"{tl}.attention.dense", _chunk(get(f"{a}.o_proj.weight"), tp, t, 1), [f"{a}.o_proj"])
                if spec.qk_layernorm:
                    w[f"{tl}.attention.q_layernorm.weight"] = get(f"{a}.q_norm.weight")
                    w[f"{tl}.attention.k_layernorm.weight"] = get(f"{a}.k_norm.weight")
                w[f"{tl}.input_layernorm.weight"] = get(f"{hf}.input_layernorm.weight")
                w[f"{tl}.post_layernorm.weight"] = get(f"{hf}.post_attention_layernorm.weight")
                if spec.is_moe:
                    if spec.architecture == "mixtral":
                        e, gate, up, down = f"{hf}.block_sparse_moe", "w1", "w3", "w2"
                    else:
                        e, gate, up, down = f"{hf}.mlp", "gate_proj", "up_proj", "down_proj"
                    w[f"{tl}.mlp.router.weight"] = reader.get(f"{e}.gate.weight").float()
                    local = spec.num_experts // moe_ep
                    experts = range((t % moe_ep) * local, (t % moe_ep + 1) * local)
                    r = t // moe_ep
                    fc = [torch.cat([_chunk(get(f"{e}.experts.{x}.{up}.weight"), moe_tp, r, 0),
                                     _chunk(get(f"{e}.experts.{x}.{gate}.weight"), moe_tp, r, 0)]) for x in experts]
                    w[f"{tl}.mlp.fc.weight"] = torch.stack(fc)
                    w[f"{tl}.mlp.proj.weight"] = torch.stack(
                        [_chunk(get(f"{e}.experts.{x}.{down}.weight"), moe_tp, r, 1) for x in experts])
                else:
                    m = f"{hf}.mlp"
                    linear(f"{tl}.mlp.fc", _chunk(get(f"{m}.gate_proj.weight"), tp, t, 0), [f"{m}.gate_proj"])
                    linear(f"{tl}.mlp.gate", _chunk(get(f"{m}.up_proj.weight"), tp, t, 0), [f"{m}.up_proj"])
                    linear(f"{tl}.mlp.proj", _chunk(get(f"{m}.down_proj.weight"), tp, t, 1), [f"{m}.down_proj"])
            if p == pp - 1:
                w["transformer.ln_f.weight"] = get("model.norm.weight")
                head = get("model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight")
                padded = -(-head.shape[0] // tp) * tp
                if padded != head.shape[0]:
                    head = torch.cat([head, head.new_zeros(padded - head.shape[0], head.shape[1])])
                w["lm_head.weight"] = _chunk(head, tp, t, 0)
            save_file({k: v.contiguous() for k, v in w.items()}, str(out / f"rank{p * tp + t}.safetensors"))
            total += sum(v.numel() * v.element_size() for v in w.values())
    return total
