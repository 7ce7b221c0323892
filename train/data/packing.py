"""Sequence packing for SFT: several examples share one sequence of seq_length, and the packed-sequence
boundaries (cu_seqlens) keep attention within each example.

Each example of n tokens contributes n-1 positions (inputs t0..t(n-2), labels t1..t(n-1)), so no label is ever
the first token of the next example. Padding at the end of a bin is its own segment with loss mask 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Example:
    ids: list[int]  # the whole example, prompt and response
    mask: list[int]  # 1 where the token is a target (response), per token of ids

    @property
    def positions(self) -> int:
        return len(self.ids) - 1


class EpochOrder:
    """Global sample index -> bin number: every epoch visits the bins in a new order drawn from (seed, epoch), so a
    resumed run continues the exact order. The current epoch's permutation is kept."""

    def __init__(self, seed: int, bins: int) -> None:
        self.seed, self.bins = seed, bins
        self._order: tuple[int, Any] = (-1, None)

    def __call__(self, index: int) -> int:
        epoch, i = divmod(index, self.bins)
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.bins))
        return int(self._order[1][i])


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total <= capacity; longest first, each into the first bin it
    fits (deterministic: ties keep input order)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"example {i} has {lengths[i]} positions, more than the sequence length {capacity}")
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack(examples: list[Example], seq_length: int, pad_id: int) -> dict[str, torch.Tensor | int]:
    """One packed sample: tokens, labels, loss_mask, position_ids (restarting at 0 per example) and
    cu_seqlens (int32 boundaries, padding as a last segment)."""
    tokens, labels, mask, positions, bounds = [], [], [], [], [0]
    for ex in examples:
        n = ex.positions
        tokens += ex.ids[:-1]
        labels += ex.ids[1:]
        mask += ex.mask[1:]
        positions += list(range(n))
        bounds.append(bounds[-1] + n)
    pad = seq_length - len(tokens)
    if pad < 0:
        raise ValueError(f"examples of {len(tokens)} positions do not fit a sequence of {seq_length}")
    if pad:
        tokens += [pad_id] * pad
        labels += [pad_id] * pad
        mask += [0] * pad
        positions += list(range(pad))
        bounds.append(seq_length)
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    return {"tokens": torch.tensor(tokens), "labels": torch.tensor(labels),
            "loss_mask": torch.tensor(mask, dtype=torch.float32), "position_ids": torch.tensor(positions),
            "cu_seqlens": torch.tensor(bounds, dtype=torch.int32), "max_seqlen": max(lengths)}


def pad_one(ex: Example, seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Without packing: one example per sequence, padded at the end (causal attention never looks ahead, so
    the padding does not change the example's tokens; its loss mask is 0)."""
    sample = pack([ex], seq_length, pad_id)
    sample.pop("cu_seqlens"), sample.pop("max_seqlen")
    return sample  # type: ignore[return-value]
