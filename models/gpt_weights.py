"""The Megatron side of every weight map: GPTModel's tensors, each written once with its transform, its
tensor-parallel split and its shape, as building blocks that a family (models/families/) fills with its HF names.

Megatron keys are GPTModel's layer-stacked torch_dist keys with the Transformer Engine layer spec (the keys
Megatron-LM, Megatron-Bridge and NeMo exchange): the input norm lives in linear_qkv (`layer_norm_weight`), a dense
MLP's norm in linear_fc1; MoE layers keep a separate pre_mlp_layernorm. HF arguments are module names (the
builders add `.weight` / `.bias`) and may hold {layer} and {expert}.
"""

from __future__ import annotations

from dataclasses import replace

from mcorekit.errors import ModelError
from mcorekit.models.mapping import (COLUMN, EXPERT, GLOBAL, MTP, MTP_LAYER, QKV, REPLICATED, ROW, Direct, GatedFC1,
                                     InterleavedGateUp, Mapping, Part, TEModule, TransposedExpert, VocabRows)
from mcorekit.models.spec import ModelSpec

ATTN = "decoder.layers.self_attention"
MLP = "decoder.layers.mlp"

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
INPUT_NORM = f"{ATTN}.linear_qkv.layer_norm_weight"
QKV_WEIGHT = f"{ATTN}.linear_qkv.weight"
QKV_BIAS = f"{ATTN}.linear_qkv.bias"
PROJ = f"{ATTN}.linear_proj.weight"
Q_NORM = f"{ATTN}.q_layernorm.weight"
K_NORM = f"{ATTN}.k_layernorm.weight"
FC1_NORM = f"{MLP}.linear_fc1.layer_norm_weight"
FC1 = f"{MLP}.linear_fc1.weight"
FC2 = f"{MLP}.linear_fc2.weight"
PRE_MLP_NORM = "decoder.layers.pre_mlp_layernorm.weight"
ROUTER = f"{MLP}.router.weight"
EXPERT_FC1 = f"{MLP}.experts.experts.linear_fc1.weight"
EXPERT_FC2 = f"{MLP}.experts.experts.linear_fc2.weight"
SHARED_FC1 = f"{MLP}.shared_experts.linear_fc1.weight"
SHARED_FC2 = f"{MLP}.shared_experts.linear_fc2.weight"
SHARED_GATE = f"{MLP}.shared_experts.gate_weight"
EXPERT_BIAS = f"{MLP}.router.expert_bias"
# GPT-OSS: biases on the output projection, the router and the experts; the attention sinks
PROJ_BIAS = f"{ATTN}.linear_proj.bias"
SINKS = f"{ATTN}.core_attention.softmax_offset"
ROUTER_BIAS = f"{MLP}.router.bias"
EXPERT_FC1_BIAS = f"{MLP}.experts.experts.linear_fc1.bias"
EXPERT_FC2_BIAS = f"{MLP}.experts.experts.linear_fc2.bias"
# Multi-latent attention (MLASelfAttention, TE spec: the q/kv latent norms fused into the up projections)
MLA_INPUT_NORM = "decoder.layers.input_layernorm.weight"
MLA_Q = f"{ATTN}.linear_q_proj.weight"
MLA_Q_DOWN = f"{ATTN}.linear_q_down_proj.weight"
MLA_Q_NORM = f"{ATTN}.linear_q_up_proj.layer_norm_weight"
MLA_Q_UP = f"{ATTN}.linear_q_up_proj.weight"
MLA_KV_DOWN = f"{ATTN}.linear_kv_down_proj.weight"
MLA_KV_NORM = f"{ATTN}.linear_kv_up_proj.layer_norm_weight"
MLA_KV_UP = f"{ATTN}.linear_kv_up_proj.weight"


def embedding(spec: ModelSpec, hf: str) -> Part:
    return [VocabRows(EMBEDDING, (f"{hf}.weight",), shape=(spec.vocab_size, spec.hidden_size))], []


def final_norm(spec: ModelSpec, hf: str) -> Part:
    return [Direct(FINAL_NORM, (f"{hf}.weight",), scope=GLOBAL, shape=(spec.hidden_size,))], \
        [TEModule("decoder.final_layernorm", GLOBAL)]


def output_layer(spec: ModelSpec, hf: str) -> Part:
    """Tied embeddings: Megatron reuses the embedding and HF has no separate head, so there is nothing to map."""
    if spec.tie_word_embeddings:
        return [], []
    return [VocabRows(OUTPUT, (f"{hf}.weight",), shape=(spec.vocab_size, spec.hidden_size))], []


def attention(spec: ModelSpec, *, norm: str, q: str, k: str, v: str, o: str, q_norm: str | None = None,
              k_norm: str | None = None) -> Part:
    """Self-attention with its input norm; q/k/v biases when spec.qkv_bias, q/k norms when spec.qk_layernorm."""
    h, g, d, H = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels, spec.hidden_size
    qkv = (h + 2 * g) * d
    maps: list[Mapping] = [
        Direct(INPUT_NORM, (f"{norm}.weight",), shape=(H,)),
        QKV(QKV_WEIGHT, (f"{q}.weight", f"{k}.weight", f"{v}.weight"), shape=(qkv, H)),
        Direct(PROJ, (f"{o}.weight",), split=ROW, shape=(H, h * d)),
    ]
    te = [TEModule(f"{ATTN}.linear_qkv"), TEModule(f"{ATTN}.linear_proj")]
    if spec.qkv_bias:
        maps.append(QKV(QKV_BIAS, (f"{q}.bias", f"{k}.bias", f"{v}.bias"), shape=(qkv,)))
    if spec.qk_layernorm:
        if not (q_norm and k_norm):
            raise ModelError(f"{spec.architecture}: the model has q/k norms but its family names no HF q_norm/k_norm")
        maps += [Direct(Q_NORM, (f"{q_norm}.weight",), shape=(d,)), Direct(K_NORM, (f"{k_norm}.weight",), shape=(d,))]
        te += [TEModule(f"{ATTN}.q_layernorm"), TEModule(f"{ATTN}.k_layernorm")]
    return maps, te


def on_layers(part: Part, layers: range) -> Part:
    """The part for some layers only (the dense or the MoE layers of a model that has both); a range, so that the
    map of a config claiming a billion layers is small until its counts are checked against the weights."""
    maps, te = part
    return [replace(m, layers=layers) for m in maps], [replace(t, layers=layers) for t in te]


def mla_attention(spec: ModelSpec, *, norm: str, o: str, kv_a: str, kv_norm: str, kv_b: str, q: str | None = None,
                  q_a: str | None = None, q_norm: str | None = None, q_b: str | None = None) -> Part:
    """Multi-latent attention with its input norm. q is one projection (q) or, with spec.q_lora_rank, a down
    projection (q_a), an RMS norm on the latent (q_norm) and an up projection (q_b); k/v come from one down
    projection [kv latent; shared rope key] (kv_a), a norm on the latent (kv_norm) and an up projection to
    [k_nope; v] per head (kv_b). Every row order is Megatron's: the tensors map as they are. The down projections
    are replicated over TP (TE's duplicated linear), the up projections split by heads."""
    H, heads = spec.hidden_size, spec.num_attention_heads
    qk, rope, v = spec.qk_head_dim, spec.qk_pos_emb_head_dim, spec.v_head_dim
    maps: list[Mapping] = [Direct(MLA_INPUT_NORM, (f"{norm}.weight",), shape=(H,))]
    te = [TEModule("decoder.layers.input_layernorm")]
    if spec.q_lora_rank:
        r = spec.q_lora_rank
        maps += [Direct(MLA_Q_DOWN, (f"{q_a}.weight",), shape=(r, H)),
                 Direct(MLA_Q_NORM, (f"{q_norm}.weight",), shape=(r,)),
                 Direct(MLA_Q_UP, (f"{q_b}.weight",), split=COLUMN, shape=(heads * (qk + rope), r))]
        te += [TEModule(f"{ATTN}.linear_q_down_proj"), TEModule(f"{ATTN}.linear_q_up_proj")]
    else:
        maps.append(Direct(MLA_Q, (f"{q}.weight",), split=COLUMN, shape=(heads * (qk + rope), H)))
        te.append(TEModule(f"{ATTN}.linear_q_proj"))
    c = spec.kv_lora_rank
    maps += [Direct(MLA_KV_DOWN, (f"{kv_a}.weight",), shape=(c + rope, H)),
             Direct(MLA_KV_NORM, (f"{kv_norm}.weight",), shape=(c,)),
             Direct(MLA_KV_UP, (f"{kv_b}.weight",), split=COLUMN, shape=(heads * (qk + v), c)),
             Direct(PROJ, (f"{o}.weight",), split=ROW, shape=(H, heads * v))]
    te += [TEModule(f"{ATTN}.linear_kv_down_proj"), TEModule(f"{ATTN}.linear_kv_up_proj"),
           TEModule(f"{ATTN}.linear_proj")]
    return maps, te


def dense_mlp(spec: ModelSpec, *, norm: str, gate: str, up: str, down: str) -> Part:
    """SwiGLU MLP with its pre-MLP norm (fused into linear_fc1 in the TE spec)."""
    f, H = spec.ffn_hidden_size, spec.hidden_size
    return [
        Direct(FC1_NORM, (f"{norm}.weight",), shape=(H,)),
        GatedFC1(FC1, (f"{gate}.weight", f"{up}.weight"), shape=(2 * f, H)),
        Direct(FC2, (f"{down}.weight",), split=ROW, shape=(H, f)),
    ], [TEModule(f"{MLP}.linear_fc1"), TEModule(f"{MLP}.linear_fc2")]


def moe_mlp(spec: ModelSpec, *, norm: str, router: str, gate: str, up: str, down: str,
            router_bias: str | None = None, router_keep_dtype: bool = False) -> Part:
    """Router [experts, hidden] per layer; expert weights stacked [layers, experts, ...] by global expert id
    (expert parallelism splits them by expert id, expert tensor parallelism like a dense MLP). With
    spec.moe_router_expert_bias, the per-expert bias added to the scores to pick experts (`router_bias` names the
    full HF tensor: DeepSeek's e_score_correction_bias), kept in its own dtype (fp32), as the router weight is with
    router_keep_dtype."""
    f, H = spec.moe_ffn_hidden_size or spec.ffn_hidden_size, spec.hidden_size
    bias: list[Mapping] = []
    if spec.moe_router_expert_bias:
        if not router_bias:
            raise ModelError(f"{spec.architecture}: the model has a router expert bias but its family names no HF one")
        bias = [Direct(EXPERT_BIAS, (router_bias,), shape=(spec.num_experts,), keep_dtype=True)]
    return [
        Direct(PRE_MLP_NORM, (f"{norm}.weight",), shape=(H,)),
        Direct(ROUTER, (f"{router}.weight",), shape=(spec.num_experts, H), keep_dtype=router_keep_dtype),
        *bias,
        GatedFC1(EXPERT_FC1, (f"{gate}.weight", f"{up}.weight"), scope=EXPERT, shape=(2 * f, H)),
        Direct(EXPERT_FC2, (f"{down}.weight",), scope=EXPERT, split=ROW, shape=(H, f)),
    ], [TEModule("decoder.layers.pre_mlp_layernorm"), TEModule(f"{MLP}.experts.experts.linear_fc1", EXPERT),
        TEModule(f"{MLP}.experts.experts.linear_fc2", EXPERT)]


def shared_expert(spec: ModelSpec, *, gate: str, up: str, down: str, gate_weight: str | None = None) -> Part:
    """The shared expert every token passes through besides its routed ones (Megatron's SharedExpertMLP,
    moe_shared_expert_intermediate_size), and with spec.moe_shared_expert_gate its sigmoid gate ([1, hidden],
    replicated): output = sigmoid(x @ gate_weight.T) * shared_expert(x)."""
    s, H = spec.moe_shared_expert_ffn_hidden_size, spec.hidden_size
    if not s:
        return [], []
    maps: list[Mapping] = [
        GatedFC1(SHARED_FC1, (f"{gate}.weight", f"{up}.weight"), shape=(2 * s, H)),
        Direct(SHARED_FC2, (f"{down}.weight",), split=ROW, shape=(H, s)),
    ]
    if spec.moe_shared_expert_gate:
        if not gate_weight:
            raise ModelError(f"{spec.architecture}: the model has a shared-expert gate but its family names no HF one")
        maps.append(Direct(SHARED_GATE, (f"{gate_weight}.weight",), split=REPLICATED, shape=(1, H)))
    return maps, [TEModule(f"{MLP}.shared_experts.linear_fc1"), TEModule(f"{MLP}.shared_experts.linear_fc2")]



def attention_extras(spec: ModelSpec, *, o: str, sinks: str | None = None) -> Part:
    """With spec.linear_bias the output projection's bias (replicated: added once after the row-parallel
    reduction), with spec.attention_sinks the learned per-head softmax sink (Megatron's softmax_offset of
    softmax_type=learnable; split with the heads)."""
    maps: list[Mapping] = []
    if spec.linear_bias:
        maps.append(Direct(PROJ_BIAS, (f"{o}.bias",), shape=(spec.hidden_size,)))
    if spec.attention_sinks:
        maps.append(Direct(SINKS, (sinks,), split=COLUMN, shape=(spec.num_attention_heads,)))
    return maps, []


def stacked_experts_mlp(spec: ModelSpec, *, norm: str, router: str, gate_up: str, down: str) -> Part:
    """A mixture of experts whose HF tensors hold every expert (GPT-OSS: `gate_up` [experts, hidden, 2 * ffn] with
    gate and up alternating, `down` [experts, ffn, hidden], both x @ W, and with spec.linear_bias their biases
    `<name>_bias` and the router's bias)."""
    f, H, E = spec.moe_ffn_hidden_size or spec.ffn_hidden_size, spec.hidden_size, spec.num_experts
    maps: list[Mapping] = [
        Direct(PRE_MLP_NORM, (f"{norm}.weight",), shape=(H,)),
        Direct(ROUTER, (f"{router}.weight",), shape=(E, H)),
        InterleavedGateUp(EXPERT_FC1, (gate_up,), shape=(2 * f, H)),
        TransposedExpert(EXPERT_FC2, (down,), shape=(H, f)),
    ]
    if spec.linear_bias:
        maps += [Direct(ROUTER_BIAS, (f"{router}.bias",), shape=(E,)),
                 InterleavedGateUp(EXPERT_FC1_BIAS, (f"{gate_up}_bias",), shape=(2 * f,)),
                 Direct(EXPERT_FC2_BIAS, (f"{down}_bias",), scope=EXPERT, shape=(H,), hf_experts=True)]
    return maps, [TEModule("decoder.layers.pre_mlp_layernorm"), TEModule(f"{MLP}.experts.experts.linear_fc1", EXPERT),
                  TEModule(f"{MLP}.experts.experts.linear_fc2", EXPERT)]


def mtp(spec: ModelSpec, layer: Part, *, enorm: str, hnorm: str, eh_proj: str, final_norm: str) -> Part:
    """Megatron-Core's multi-token-prediction layers (spec.mtp_layers of them; nothing when 0): per layer the norm of
    the next token's embedding (enorm) and of the hidden state (hnorm), eh_proj on their concatenation
    [enorm(embedding); hnorm(hidden)] ([hidden, 2 * hidden], split by output rows like any column-parallel linear),
    a decoder layer (`layer`: the part of the decoder's last layer, its Megatron names moved under
    mtp.layers.transformer_layer) and final_layernorm before the shared output layer. HF names hold {layer}: MTP
    layer i is HF layer num_layers + i (DeepSeek's checkpoints number them after the decoder)."""
    if not spec.mtp_layers:
        return [], []
    H, layers, offset = spec.hidden_size, range(spec.mtp_layers), spec.num_layers
    maps, te = layer
    moved = [replace(m, mcore=m.mcore.replace("decoder.layers.", MTP_LAYER, 1), layers=layers, hf_layer_offset=offset)
             for m in maps]
    own = [Direct(f"{MTP}enorm.weight", (f"{enorm}.weight",), shape=(H,)),
           Direct(f"{MTP}hnorm.weight", (f"{hnorm}.weight",), shape=(H,)),
           Direct(f"{MTP}eh_proj.weight", (f"{eh_proj}.weight",), split=COLUMN, shape=(H, 2 * H)),
           Direct(f"{MTP}final_layernorm.weight", (f"{final_norm}.weight",), shape=(H,))]
    own = [replace(m, layers=layers, hf_layer_offset=offset) for m in own]
    te_moved = [replace(t, name=t.name.replace("decoder.layers.", MTP_LAYER, 1), layers=layers) for t in te]
    te_own = [TEModule(f"{MTP}{name}", layers=layers) for name in ("enorm", "hnorm", "eh_proj", "final_layernorm")]
    return moved + own, te_moved + te_own
