"""The vocabulary of a weight map: one entry per Megatron-Core tensor, the HF tensors that make one slice of it,
the pure transform between them, and how tensor parallelism splits it.

A Megatron key is GPTModel's layer-stacked torch_dist key (e.g. `decoder.layers.self_attention.linear_qkv.weight`,
global shape [layers, ...] or [layers, experts, ...]); its `scope` says which leading dims are stacked, and its
`split` how one slice is divided over tensor-parallel ranks (over expert-tensor-parallel ranks for expert
tensors, which expert parallelism divides by expert id first):

    replicated     every rank holds all of it (norms, the router, the shared-expert gate)
    column         dim 0 in contiguous blocks (fused QKV by query groups, vocabulary rows)
    gated-column   dim 0 of each half of [gate; up]: rank r holds [gate_r; up_r]
    row            dim 1 in contiguous blocks (attention output projection, fc2)

The HF tensors of a column or gated-column entry are split on their dim 0, those of a row entry on dim 1.
Every transform is a re-arrangement (cat/split/view), so a round trip is bit-exact. torch is imported only when
a transform runs: the model registry (models/families/) is read by CLIs that answer --help without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from string import Formatter
from typing import TYPE_CHECKING, Iterable, Sequence

from mcorekit.models.spec import ModelSpec

if TYPE_CHECKING:
    import torch

GLOBAL, LAYER, EXPERT = "global", "layer", "expert"
# Megatron-Core's multi-token-prediction layers (DeepSeek-V3): entries named `mtp.layers.<name>` are stacked over
# spec.mtp_layers (not the decoder's layers) and stored one key per MTP layer, `mtp.layers.<i>.<name>`; their
# decoder layer is `mtp.layers.<i>.transformer_layer.*` (torch_dist) or `.mtp_model_layer.*` (module names).
MTP = "mtp.layers."
MTP_LAYER = f"{MTP}transformer_layer."
MTP_MODULE_LAYER = f"{MTP}mtp_model_layer."
REPLICATED, COLUMN, GATED_COLUMN, ROW = "replicated", "column", "gated-column", "row"
HF_SPLIT_DIM = {REPLICATED: None, COLUMN: 0, GATED_COLUMN: 0, ROW: 1}


# ---------------------------------------------------------------- tensor-parallel splits of one Megatron slice


def shard(split: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of a Megatron slice split `size` ways."""
    import torch

    if size == 1 or split == REPLICATED:
        return tensor
    if split == GATED_COLUMN:
        gate, up = torch.chunk(tensor, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, dim=0)[rank], torch.chunk(up, size, dim=0)[rank]], dim=0)
    if split == COLUMN:
        return torch.chunk(tensor, size, dim=0)[rank].clone()
    if split == ROW:
        return torch.chunk(tensor, size, dim=1)[rank].contiguous()
    raise ValueError(f"unknown split {split!r}")


def unshard(split: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The Megatron slice again from every rank's part (shard's inverse)."""
    import torch

    if len(parts) == 1 or split == REPLICATED:
        return parts[0]
    if split == GATED_COLUMN:
        gates, ups = zip(*(torch.chunk(p, 2, dim=0) for p in parts))
        return torch.cat([torch.cat(gates, dim=0), torch.cat(ups, dim=0)], dim=0)
    if split == COLUMN:
        return torch.cat(parts, dim=0)
    if split == ROW:
        return torch.cat(parts, dim=1)
    raise ValueError(f"unknown split {split!r}")


# ---------------------------------------------------------------- named transforms


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """HF q/k/v -> Megatron's fused QKV: per query group, [that group's q heads; its k head; its v head].

    Head size is kv_channels, which is not always hidden/heads (Qwen3). Works for weights [out, in] and biases [out].
    """
    import torch

    g, d = spec.num_query_groups, spec.kv_channels
    per_group = spec.num_attention_heads // g
    rest = q.shape[1:]
    q = q.reshape(g, per_group * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(g * (per_group + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    g, d = spec.num_query_groups, spec.kv_channels
    per_group = spec.num_attention_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return (q.reshape(g * per_group * d, *rest).contiguous(), k.reshape(g * d, *rest).contiguous(),
            v.reshape(g * d, *rest).contiguous())


def concat_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gated MLP fc1 is [gate; up] on the output dim (under TP Megatron shards each half: gated-column)."""
    import torch

    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Megatron shards the vocabulary over TP, so rows are padded with zeros; they are cut again on export."""
    import torch

    if weight.shape[0] == padded_rows:
        return weight
    pad = weight.new_zeros((padded_rows - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, pad], dim=0)


# ---------------------------------------------------------------- mapping classes


@dataclass(frozen=True)
class Ctx:
    """What a transform may need besides the tensors: the model and the Megatron-side vocab size."""

    spec: ModelSpec
    padded_vocab: int


@dataclass(frozen=True)
class Mapping:
    """One Megatron tensor <-> one or more HF tensors. `hf` names may hold {layer} and {expert}; `shape` is one
    slice's Megatron shape (without the stacked layer/expert dims)."""

    mcore: str
    hf: tuple[str, ...]
    scope: str = LAYER  # GLOBAL: not stacked; LAYER: [layers, ...]; EXPERT: [layers, experts, ...]
    split: str = REPLICATED
    shape: tuple[int, ...] = ()
    layers: Sequence[int] | None = None  # the layers that have it (dense or MoE layers of a mixed model); None: all
    keep_dtype: bool = False  # written back to HF in its stored dtype, not the config's (DeepSeek's fp32 router)
    hf_experts: bool = False  # EXPERT scope: one HF tensor holds every expert on its dim 0 (GPT-OSS), no {expert}
    hf_layer_offset: int = 0  # HF {layer} = index + offset (MTP layer i is HF layer num_layers + i in DeepSeek's)

    @property
    def is_mtp(self) -> bool:
        return self.mcore.startswith(MTP)

    def stack(self, spec: ModelSpec) -> int:
        """How many slices the leading layer dim holds: the decoder's layers, or the MTP layers."""
        return spec.mtp_layers if self.is_mtp else spec.num_layers

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> list[str]:
        layer = None if layer is None else layer + self.hf_layer_offset
        return [n.format(layer=layer, expert=expert) for n in self.hf]

    def stacked_layers(self, spec: ModelSpec) -> Sequence[int]:
        """The layers (MTP layers for an MTP entry) that have it, in order."""
        return range(self.stack(spec)) if self.layers is None else self.layers

    def slices(self, spec: ModelSpec) -> list[tuple[int, ...]]:
        """The leading index of every slice: () when GLOBAL, (layer,) for LAYER, (layer, expert) for EXPERT."""
        if self.scope == GLOBAL:
            return [()]
        layers = self.stacked_layers(spec)
        if self.scope == LAYER:
            return [(layer,) for layer in layers]
        return [(layer, e) for layer in layers for e in range(spec.num_experts or 0)]

    def has_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has it (MTP entries: see is_mtp)."""
        return self.scope != GLOBAL and not self.is_mtp and (self.layers is None or layer in self.layers)

    def hf_names_at(self, index: tuple[int, ...]) -> list[str]:
        """The HF names of the slice at a leading index of slices()."""
        return self.hf_names(index[0] if index else None, index[1] if len(index) > 1 else None)

    def mcore_shape(self, ctx: Ctx) -> tuple[int, ...]:
        return self.shape

    def to_mcore(self, tensors: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        (t,) = tensors
        return t

    def to_hf(self, tensor: torch.Tensor, ctx: Ctx) -> list[torch.Tensor]:
        return [tensor]


@dataclass(frozen=True)
class Direct(Mapping):
    """One HF tensor is the Megatron slice as it is."""


@dataclass(frozen=True)
class VocabRows(Mapping):
    """Embedding or output layer: padded to the Megatron vocab size on import, trimmed on export."""

    scope: str = GLOBAL
    split: str = COLUMN

    def mcore_shape(self, ctx: Ctx) -> tuple[int, ...]:
        return (ctx.padded_vocab, *self.shape[1:])

    def to_mcore(self, tensors: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        return pad_vocab(tensors[0], ctx.padded_vocab)

    def to_hf(self, tensor: torch.Tensor, ctx: Ctx) -> list[torch.Tensor]:
        return [tensor[: ctx.spec.vocab_size].contiguous()]


@dataclass(frozen=True)
class QKV(Mapping):
    """hf = (q, k, v) names; weight or bias. Megatron interleaves them per query group."""

    split: str = COLUMN

    def to_mcore(self, tensors: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        return interleave_qkv(*tensors, ctx.spec)

    def to_hf(self, tensor: torch.Tensor, ctx: Ctx) -> list[torch.Tensor]:
        return list(split_qkv(tensor, ctx.spec))


@dataclass(frozen=True)
class GatedFC1(Mapping):
    """hf = (gate, up) names; Megatron holds [gate; up]."""

    split: str = GATED_COLUMN

    def to_mcore(self, tensors: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        return concat_gate_up(*tensors)

    def to_hf(self, tensor: torch.Tensor, ctx: Ctx) -> list[torch.Tensor]:
        return list(split_gate_up(tensor))


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[g0, u0, g1, u1, ...] on dim 0 -> [g0, g1, ...; u0, u1, ...] (GPT-OSS's gate/up -> Megatron's [gate; up])."""
    import torch

    return torch.cat([t[0::2], t[1::2]], dim=0).contiguous()


def interleave(t: torch.Tensor) -> torch.Tensor:
    import torch

    gate, up = torch.chunk(t, 2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(t.shape).contiguous()


@dataclass(frozen=True)
class InterleavedGateUp(Mapping):
    """GPT-OSS experts' gate_up_proj [experts, hidden, 2 * ffn] (x @ W, gate and up alternating on the last dim)
    or its bias [experts, 2 * ffn] -> one expert's Megatron fc1 [gate; up] ([2 * ffn, hidden] or [2 * ffn])."""

    scope: str = EXPERT
    split: str = GATED_COLUMN
    hf_experts: bool = True

    def to_mcore(self, tensors: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        (t,) = tensors
        return deinterleave(t.t() if t.dim() == 2 else t)

    def to_hf(self, tensor: torch.Tensor, ctx: Ctx) -> list[torch.Tensor]:
        t = interleave(tensor)
        return [t.t().contiguous() if t.dim() == 2 else t]


@dataclass(frozen=True)
class TransposedExpert(Mapping):
    """GPT-OSS experts' down_proj [experts, ffn, hidden] (x @ W) -> one expert's Megatron fc2 [hidden, ffn]."""

    scope: str = EXPERT
    split: str = ROW
    hf_experts: bool = True

    def to_mcore(self, tensors: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        return tensors[0].t().contiguous()

    def to_hf(self, tensor: torch.Tensor, ctx: Ctx) -> list[torch.Tensor]:
        return [tensor.t().contiguous()]


@dataclass(frozen=True)
class TEModule:
    """A Transformer Engine module whose `_extra_state` Megatron's loader expects one bytes entry for,
    per layer (and per expert for expert modules)."""

    name: str  # e.g. "decoder.layers.self_attention.linear_qkv" or "decoder.final_layernorm"
    scope: str = LAYER
    layers: Sequence[int] | None = None  # the layers that have it; None: all

    @property
    def is_mtp(self) -> bool:
        return self.name.startswith(MTP)

    def has_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has it (MTP modules: see is_mtp)."""
        return not self.is_mtp and (self.layers is None or layer in self.layers)


Part = tuple[list[Mapping], list[TEModule]]


@dataclass(frozen=True)
class WeightMap:
    """A family's whole HF <-> Megatron map for one model: every tensor, and the TE modules with extra state.
    `copies`: (HF tensor, the HF tensor it must equal) pairs that Megatron stores once (DeepSeek's MTP layers hold
    copies of the embedding and the head, which Megatron-Core's MTP block shares with the main model): checked
    equal on import, written from their source on export."""

    mappings: tuple[Mapping, ...]
    te_modules: tuple[TEModule, ...]
    copies: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, *parts: Part, copies: Iterable[tuple[str, str]] = ()) -> WeightMap:
        return cls(tuple(m for maps, _ in parts for m in maps), tuple(t for _, te in parts for t in te), tuple(copies))

    def by_mcore(self) -> dict[str, Mapping]:
        return {m.mcore: m for m in self.mappings}

    def get(self, mcore: str) -> Mapping | None:
        return self.by_mcore().get(mcore)

    def hf(self, mcore: str, layer: int | None = None, expert: int | None = None) -> list[str]:
        """The HF names of Megatron tensor `mcore` at one layer (and expert); KeyError when the map has none."""
        return self.by_mcore()[mcore].hf_names(layer, expert)

    def fused_hf_modules(self, spec: ModelSpec) -> list[tuple[str, ...]]:
        """HF linear modules that make one Megatron weight together (q/k/v, gate/up), every slice: a runtime that
        fuses them (TensorRT-LLM) needs one quantization scale per group."""
        return [tuple(n.removesuffix(".weight") for n in m.hf_names_at(index))
                for m in self.mappings if len(m.hf) > 1 and all(n.endswith(".weight") for n in m.hf)
                for index in m.slices(spec)]

    def linear_hf_modules(self, spec: ModelSpec) -> list[str]:
        """HF modules of the decoder's linear layers (entries split over TP, every slice), not norms, routers,
        gates, embeddings or the head: what FP8 quantizes."""
        return [n.removesuffix(".weight") for m in self.mappings if m.split != REPLICATED and not isinstance(m, VocabRows)
                for index in m.slices(spec) for n in m.hf_names_at(index) if n.endswith(".weight")]

    def stacked_ids(self, names: Iterable[str]) -> tuple[set[int], set[int]]:
        """The layer ids and the expert ids that HF tensor names hold, read with the map's own name templates."""
        layer_prefixes, expert_infixes = set(), set()
        for m in self.mappings:
            for template in m.hf:
                fields = [(text, name) for text, name, _, _ in Formatter().parse(template)]
                if fields and fields[0][1] == "layer":
                    layer_prefixes.add(fields[0][0])
                    if len(fields) > 1 and fields[1][1] == "expert":
                        expert_infixes.add(fields[1][0])
        if not layer_prefixes:
            return set(), set()
        prefix = "|".join(map(re.escape, sorted(layer_prefixes)))
        layer_re = re.compile(rf"(?:{prefix})(\d+)(?=\.|$)")
        expert_re = re.compile(rf"(?:{prefix})\d+(?:{'|'.join(map(re.escape, sorted(expert_infixes)))})(\d+)(?=\.|$)") \
            if expert_infixes else None
        layers, experts = set(), set()
        for name in names:
            if m := layer_re.match(name):
                layers.add(int(m.group(1)))
                if expert_re and (e := expert_re.match(name)):
                    experts.add(int(e.group(1)))
        return layers, experts
