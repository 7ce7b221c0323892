"""A parallel layout: how a model is split over GPUs (shared by launch/, train/ and the model builder), and the one
check of whether a layout splits a model's weights (layout_problems; convert/ and export/ call it, the launcher
adds its world-size rules)."""

from __future__ import annotations

from dataclasses import dataclass

from mcorekit.models.spec import ModelSpec


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False

    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def dp(self, world: int) -> int:
        return world // self.model_parallel()

    def __str__(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp:
            parts.append(f"VPP{self.vpp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.etp > 1:
            parts.append(f"ETP{self.etp}")
        return "x".join(parts)


MEGATRON, TENSORRT_LLM = "megatron", "tensorrt-llm"


def layout_problems(spec: ModelSpec, layout: Layout, runtime: str = MEGATRON, padded_vocab: int | None = None) -> list[str]:
    """Every rule `layout` breaks for this model's weights (no world size: how the weights split, not how ranks
    are placed), as messages; empty when it fits.

    runtime MEGATRON: Megatron-Core's splits (a converted checkpoint loaded at this layout, legacy rank files):
    TP divides the heads and query groups (and `padded_vocab` when given) and the dense layers' FFN, PP*VPP the
    layers, EP the experts, ETP the expert FFN. runtime TENSORRT_LLM: TensorRT-LLM's mapping (export): KV heads are
    split or duplicated, no virtual stages, experts placed inside the TP group (moe_tp * moe_ep = tp)."""
    sizes = {"TP": layout.tp, "PP": layout.pp, "EP": layout.ep, "ETP": layout.etp, "VPP": layout.vpp or 1}
    small = [f"{k}={v}" for k, v in sizes.items() if type(v) is not int or v < 1]
    if small:
        return [f"parallel sizes must be integers >= 1: {', '.join(small)}"]
    tp, pp, ep, etp, vpp = layout.tp, layout.pp, layout.ep, layout.etp, layout.vpp
    h, g = spec.num_attention_heads, spec.num_query_groups
    megatron = runtime == MEGATRON
    if runtime not in (MEGATRON, TENSORRT_LLM):
        raise ValueError(f"unknown runtime {runtime!r}")
    out = []
    if megatron and g % tp:
        out.append(f"TP={tp} does not divide num_query_groups={g}")
    if h % tp:
        out.append(f"TP={tp} does not divide num_attention_heads={h}")
    if not megatron and (g % tp) and (tp % g):
        out.append(f"TP={tp} and num_key_value_heads={g}: one must divide the other (KV heads are split or duplicated)")
    if padded_vocab is not None and padded_vocab % tp:
        out.append(f"TP={tp} does not divide the padded vocab {padded_vocab} (raise --vocab-divisible-by)")
    stages = pp * (vpp or 1)
    if megatron and spec.num_layers % stages:
        out.append(f"PP*VPP={stages} does not divide num_layers={spec.num_layers}")
    if not megatron and spec.num_layers % pp:
        out.append(f"PP={pp} does not divide num_hidden_layers={spec.num_layers}")
    if vpp and (pp < 2 or not megatron):
        out.append(f"VPP={vpp} needs PP >= 2" if megatron else f"VPP={vpp}: TensorRT-LLM has no virtual pipeline stages")
    shared = spec.moe_shared_expert_ffn_hidden_size if spec.is_moe else None
    if shared and shared % tp:
        out.append(f"TP={tp} does not divide the shared expert's FFN size {shared}")
    if spec.dense_layers() and spec.ffn_hidden_size % tp:  # dense MLPs split over TP, an MoE model's first layers' too
        out.append(f"TP={tp} does not divide {'ffn_hidden_size' if megatron else 'intermediate_size'}="
                   f"{spec.ffn_hidden_size}{' (the dense layers of the MoE model)' if spec.is_moe else ''}")
    if not spec.is_moe:
        if ep > 1 or etp > 1:
            out.append(f"{', '.join(f'{k}={v}' for k, v in (('EP', ep), ('ETP', etp)) if v > 1)} given for a dense model")
        return out
    expert_ffn = spec.moe_ffn_hidden_size or spec.ffn_hidden_size
    if megatron:
        if spec.num_experts % ep:
            out.append(f"EP={ep} does not divide num_experts={spec.num_experts}")
        if expert_ffn % etp:
            out.append(f"ETP={etp} does not divide the expert FFN size {expert_ffn}")
        if spec.linear_bias and etp > 1:
            out.append(f"ETP={etp}: Megatron-Core supports biased experts ({spec.architecture}) only at expert TP 1")
    elif tp % ep:
        out.append(f"EP={ep} must divide TP={tp} (TensorRT-LLM places experts inside the TP group: moe_tp * moe_ep = tp)")
    elif spec.num_experts % ep:
        out.append(f"EP={ep} does not divide num_experts={spec.num_experts}")
    elif expert_ffn % (tp // ep):
        out.append(f"moe_tp={tp // ep} does not divide the expert FFN size {expert_ffn}")
    return out
