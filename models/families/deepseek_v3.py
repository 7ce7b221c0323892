"""DeepSeek-V3 (and R1, Kimi-K2-style configs of the same model_type), and DeepSeek-V2 / V2-Lite (`deepseek_v2`:
the same layout without the router bias, softmax routing kept unnormalised, see v2_routing_problems): multi-latent attention
(`self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj`),
the first `first_k_dense_replace` layers with a dense MLP (`mlp.{gate,up,down}_proj`), the others a mixture of
experts (`mlp.experts.E.{gate,up,down}_proj`) with `n_shared_experts` ungated shared experts
(`mlp.shared_experts.*`, one MLP of n x moe_intermediate_size) and a router (`mlp.gate.weight`) that scores
with a sigmoid, adds `e_score_correction_bias` only to pick experts, limits the pick to `topk_group` of
`n_group` groups (ranked by the sum of their top-2 scores), renormalises and scales by routed_scaling_factor.

Megatron-Core: MLATransformerConfig (YaRN rope; its MLA rope takes DeepSeek's interleaved rope layout, as HF's
rope_interleave=true), moe_layer_freq [0]*k + [1]*(L-k), moe_router_score_function=sigmoid,
moe_router_enable_expert_bias (the `expert_bias` buffer), moe_router_num_groups / group_topk,
moe_router_topk_scaling_factor. Weights map as they are (no re-layout); the router and its bias keep their
dtype (fp32 in DeepSeek's checkpoints).

The multi-token-prediction layer(s) of a checkpoint that carries them (`model.layers.<num_hidden_layers + i>.*`,
num_nextn_predict_layers; transformers neither builds nor saves them) map to Megatron-Core's MTP block
(gpt_weights.mtp): enorm, hnorm, eh_proj (its input [enorm(embedding); hnorm(hidden)] in both), the decoder layer
(MLA + MoE, as the last decoder layer) under mtp.layers.<i>.transformer_layer, shared_head.norm as final_layernorm.
Their embed_tokens and shared_head.head are copies of the main model's, which Megatron shares (mtp_copies):
checked equal on import, written from the main ones on export.

Not covered, refused with the reason: q_lora_rank=null (V2-Lite; Megatron-Core 0.19 adds a norm before
linear_q_proj then), rope_interleave=false,
FP8 block-quantized weights (weight_scale_inv), and routings Megatron-Core computes differently
(norm_topk_prob=false with top-k > 1, group scores from other than the top-2 experts of a group)."""

from __future__ import annotations

from typing import Any

from mcorekit.models import gpt_weights as gw
from mcorekit.models.families import llama
from mcorekit.models.mapping import WeightMap
from mcorekit.models.registry import Family
from mcorekit.models.spec import ModelSpec, decoder_fields, number_or, size_problems, topk_problems
from mcorekit.options import MAX_INT

L = llama.L
ATTN = f"{L}.self_attn"
MLP = f"{L}.mlp"
EXPERT = f"{MLP}.experts.{{expert}}"
SHARED = f"{MLP}.shared_experts"
MAX_MTP_LAYERS = 64  # DeepSeek-V3 has 1; the map lists each, so a config claiming a billion would exhaust memory
SIZES = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size",
         "n_routed_experts", "num_experts_per_tok")


def is_v2(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "deepseek_v2"


def read(config: dict[str, Any]) -> ModelSpec:
    fields = decoder_fields(config, rope_types=("yarn",))
    heads = config["num_attention_heads"]
    experts = config.get("n_routed_experts")
    groups = config.get("n_group") or 1
    shared = (config.get("n_shared_experts") or 0) * config["moe_intermediate_size"]
    # V3: sigmoid scores, the bias picks, top-k renormalised. V2: softmax over all experts, top-k kept as they are
    # (Megatron's pre-softmax routing), its router ignores norm_topk_prob.
    v2 = is_v2(config)
    return ModelSpec(
        "deepseek_v3", **{**fields, "num_query_groups": heads, "kv_channels": config["v_head_dim"]},
        num_experts=experts, moe_router_topk=config["num_experts_per_tok"],
        moe_ffn_hidden_size=config["moe_intermediate_size"], moe_norm_topk_prob=not v2,
        moe_shared_expert_ffn_hidden_size=shared or None,
        moe_router_score_function="softmax" if v2 else "sigmoid", moe_router_expert_bias=not v2,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=config.get("topk_group") if groups > 1 else None,
        moe_router_topk_scaling_factor=number_or(config.get("routed_scaling_factor"), 1.0),
        moe_first_k_dense=config.get("first_k_dense_replace") or 0,
        q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
        qk_head_dim=config["qk_nope_head_dim"], qk_pos_emb_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        # the MTP layers a V3 checkpoint may hold (converted when it does; trained when model.overrides.mtp_layers asks)
        extra={} if v2 else {"nextn_predict_layers": config.get("num_nextn_predict_layers") or 0})


def problems(config: dict[str, Any]) -> list[str]:
    out = (size_problems(config, SIZES, ("q_lora_rank", "n_group", "topk_group"))
           or topk_problems(config["num_experts_per_tok"], config["n_routed_experts"]))
    if out:
        return out
    k, layers = config.get("first_k_dense_replace") or 0, config["num_hidden_layers"]
    if type(k) is not int or not 0 <= k < layers:
        out.append(f"first_k_dense_replace={k!r} must be an integer from 0 to num_hidden_layers-1={layers - 1}")
    if config.get("n_shared_experts") is not None and (type(config["n_shared_experts"]) is not int
                                                      or not 0 <= config["n_shared_experts"] <= MAX_INT):
        out.append(f"n_shared_experts={config['n_shared_experts']!r} must be an integer from 0 to {MAX_INT}")
    if config.get("mlp_bias"):
        out.append("mlp_bias=true is not supported")
    if not config.get("q_lora_rank"):
        out.append("q_lora_rank=null (a plain q_proj, as in DeepSeek-V2-Lite) is not supported: Megatron-Core 0.19's "
                   "MLA with q/kv latent norms then puts an RMS norm in front of linear_q_proj (fused into it), which "
                   "HF's q_proj does not have")
    if config.get("attention_bias"):
        out.append(f"attention_bias=true is not supported for {config.get('model_type')}")
    if config.get("quantization_config"):
        out.append(f"quantized weights ({config['quantization_config'].get('quant_method', '?')}) are not converted; "
                   f"convert a bf16 checkpoint (DeepSeek's fp8_cast_bf16.py)")
    if is_v2(config):  # V2's rope multiplies interleaved pairs as complex numbers: no switch
        return out + v2_routing_problems(config)
    mtp = config.get("num_nextn_predict_layers")
    if mtp is not None and (type(mtp) is not int or not 0 <= mtp <= MAX_MTP_LAYERS):
        out.append(f"num_nextn_predict_layers={mtp!r} must be an integer from 0 to {MAX_MTP_LAYERS} (the "
                   f"multi-token-prediction layers; DeepSeek-V3 has 1)")
    if config.get("rope_interleave", True) is not True:
        out.append("rope_interleave=false is not supported (Megatron-Core's MLA rope takes DeepSeek's interleaved "
                   "layout only)")
    topk, experts = config["num_experts_per_tok"], config["n_routed_experts"]
    groups, pick = config.get("n_group") or 1, config.get("topk_group") or 1
    if groups > 1:
        if experts % groups or pick > groups:
            out.append(f"n_group={groups}, topk_group={pick}: n_group must divide n_routed_experts={experts} and "
                       f"topk_group be at most n_group")
        elif topk % pick or topk // pick != 2:
            out.append(f"num_experts_per_tok={topk} / topk_group={pick} != 2: DeepSeek ranks a group by its top-2 "
                       f"scores, Megatron-Core by its top-(top_k / group_topk); they agree only at 2")
    if not config.get("norm_topk_prob", True) and topk > 1:
        out.append("norm_topk_prob=false is not supported (Megatron-Core renormalises sigmoid top-k scores)")
    if config.get("topk_method", "noaux_tc") != "noaux_tc" or config.get("scoring_func", "sigmoid") != "sigmoid":
        out.append(f"routing topk_method={config.get('topk_method')!r} scoring_func={config.get('scoring_func')!r} "
                   f"is not supported; supported: noaux_tc with sigmoid")
    return out


def v2_routing_problems(config: dict[str, Any]) -> list[str]:
    topk, method = config["num_experts_per_tok"], config.get("topk_method", "greedy")
    groups, pick = config.get("n_group") or 1, config.get("topk_group") or 1
    if method == "greedy":
        return []
    if method != "group_limited_greedy":
        return [f"topk_method={method!r} is not supported; supported: greedy, group_limited_greedy"]
    if config["n_routed_experts"] % groups or pick > groups:
        return [f"n_group={groups}, topk_group={pick}: n_group must divide n_routed_experts and topk_group be at "
                f"most n_group"]
    if topk // pick != 1:
        return [f"num_experts_per_tok={topk} / topk_group={pick}: DeepSeek-V2 ranks a group by its best expert, "
                f"Megatron-Core by the sum of its top-(top_k // group_topk); they agree only when that is 1"]
    return []


def weights(spec: ModelSpec) -> WeightMap:
    q = (dict(q_a=f"{ATTN}.q_a_proj", q_norm=f"{ATTN}.q_a_layernorm", q_b=f"{ATTN}.q_b_proj") if spec.q_lora_rank
         else dict(q=f"{ATTN}.q_proj"))
    attention = gw.mla_attention(spec, norm=f"{L}.input_layernorm", o=f"{ATTN}.o_proj",
                                 kv_a=f"{ATTN}.kv_a_proj_with_mqa", kv_norm=f"{ATTN}.kv_a_layernorm",
                                 kv_b=f"{ATTN}.kv_b_proj", **q)
    dense = gw.on_layers(gw.dense_mlp(spec, **llama.MLP), spec.dense_layers())
    moe = gw.on_layers(gw.moe_mlp(spec, norm=llama.POST_ATTENTION_NORM, router=f"{MLP}.gate",
                                  gate=f"{EXPERT}.gate_proj", up=f"{EXPERT}.up_proj", down=f"{EXPERT}.down_proj",
                                  router_bias=f"{MLP}.gate.e_score_correction_bias" if spec.moe_router_expert_bias
                                  else None, router_keep_dtype=True),
                       spec.moe_layers())
    shared = gw.on_layers(gw.shared_expert(spec, gate=f"{SHARED}.gate_proj", up=f"{SHARED}.up_proj",
                                           down=f"{SHARED}.down_proj"), spec.moe_layers())
    # the MTP layers' decoder layer is built like the decoder's last (an MoE layer)
    last = dense if spec.num_layers - 1 in spec.dense_layers() else (moe[0] + shared[0], moe[1] + shared[1])
    mtp = gw.mtp(spec, (attention[0] + last[0], attention[1] + last[1]), enorm=f"{L}.enorm", hnorm=f"{L}.hnorm",
                 eh_proj=f"{L}.eh_proj", final_norm=f"{L}.shared_head.norm")
    return WeightMap.of(gw.embedding(spec, "model.embed_tokens"), attention, dense, moe, shared,
                        gw.final_norm(spec, "model.norm"), gw.output_layer(spec, "lm_head"), mtp,
                        copies=mtp_copies(spec))


def mtp_copies(spec: ModelSpec) -> list[tuple[str, str]]:
    """Each MTP layer's embed_tokens and shared_head.head in DeepSeek's checkpoints: copies of the main model's
    embedding and head, which Megatron-Core's MTP block shares (never stored twice)."""
    head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    out = []
    for i in range(spec.mtp_layers):
        layer = f"model.layers.{spec.num_layers + i}"
        out += [(f"{layer}.embed_tokens.weight", "model.embed_tokens.weight"), (f"{layer}.shared_head.head.weight", head)]
    return out


FAMILY = Family("deepseek_v3", ("deepseek_v3", "deepseek_v2"), read, weights, problems, trtllm=None,
                peft_moves_mlp_to_experts=True,
                no_engine="TensorRT-LLM serves DeepSeek-V3 (MLA, sigmoid group routing) from its PyTorch backend "
                          "only; its TensorRT engine workflow has no DeepseekV3 checkpoint format")
