"""Parameter mappings between HF tensors and Megatron-Core's layer-stacked torch_dist tensors.

A mapping knows one Megatron key (e.g. `decoder.layers.self_attention.linear_qkv.weight`, global shape
[layers, ...] or [layers, experts, ...]), the HF names that make one slice of it, and the two named transforms
between them. Every transform is a pure re-arrangement (cat/split/view), so a round trip is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcorekit.models.spec import ModelSpec

Tensors = dict[str, torch.Tensor]


# ---------------------------------------------------------------- named transforms


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """HF q/k/v -> Megatron's fused QKV: per query group, [that group's q heads; its k head; its v head].

    Head size is kv_channels, which is not always hidden/heads (Qwen3). Works for weights [out, in] and biases [out].
    """
    g, d = spec.num_query_groups, spec.kv_channels
    per_group = spec.num_attention_heads // g
    rest = q.shape[1:]
    q = q.reshape(g, per_group * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(g * (per_group + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = spec.num_query_groups, spec.kv_channels
    per_group = spec.num_attention_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return (q.reshape(g * per_group * d, *rest).contiguous(), k.reshape(g * d, *rest).contiguous(),
            v.reshape(g * d, *rest).contiguous())


def concat_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gated MLP fc1 is [gate; up] on the output dim (under TP Megatron shards each half, see torch_dist docs)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Megatron shards the vocabulary over TP, so rows are padded with zeros; they are cut again on export."""
    if weight.shape[0] == padded_rows:
        return weight
    pad = weight.new_zeros((padded_rows - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, pad], dim=0)


# ---------------------------------------------------------------- mapping classes

GLOBAL, LAYER, EXPERT = "global", "layer", "expert"


@dataclass(frozen=True)
class Ctx:
    """What a transform may need besides the tensors: the model and the Megatron-side vocab size."""

    spec: ModelSpec
    padded_vocab: int


@dataclass(frozen=True)
class Mapping:
    """One Megatron tensor <-> one or more HF tensors. `hf` names may hold {layer} and {expert}."""

    mcore: str
    hf: tuple[str, ...]
    scope: str = LAYER  # GLOBAL: not stacked; LAYER: [layers, ...]; EXPERT: [layers, experts, ...]

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> list[str]:
        return [n.format(layer=layer, expert=expert) for n in self.hf]

    def to_mcore(self, tensors: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        (t,) = tensors
        return t

    def to_hf(self, tensor: torch.Tensor, ctx: Ctx) -> list[torch.Tensor]:
        return [tensor]


@dataclass(frozen=True)
class Direct(Mapping):
    pass


@dataclass(frozen=True)
class VocabRows(Mapping):
    """Embedding or output layer: padded to the Megatron vocab size on import, trimmed on export."""

    scope: str = GLOBAL

    def to_mcore(self, tensors: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        return pad_vocab(tensors[0], ctx.padded_vocab)

    def to_hf(self, tensor: torch.Tensor, ctx: Ctx) -> list[torch.Tensor]:
        return [tensor[: ctx.spec.vocab_size].contiguous()]


@dataclass(frozen=True)
class QKV(Mapping):
    """hf = (q, k, v) names; weight or bias."""

    def to_mcore(self, tensors: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        return interleave_qkv(*tensors, ctx.spec)

    def to_hf(self, tensor: torch.Tensor, ctx: Ctx) -> list[torch.Tensor]:
        return list(split_qkv(tensor, ctx.spec))


@dataclass(frozen=True)
class GatedFC1(Mapping):
    """hf = (gate, up) names."""

    def to_mcore(self, tensors: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        return concat_gate_up(*tensors)

    def to_hf(self, tensor: torch.Tensor, ctx: Ctx) -> list[torch.Tensor]:
        return list(split_gate_up(tensor))


@dataclass(frozen=True)
class TEModule:
    """A Transformer Engine module whose `_extra_state` Megatron's loader expects one bytes entry for,
    per layer (and per expert for expert modules)."""

    name: str  # e.g. "decoder.layers.self_attention.linear_qkv" or "decoder.final_layernorm"
    scope: str = LAYER
