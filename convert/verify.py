"""Proof that a conversion is right: bitwise comparison of HF checkpoints, and logits on a GPU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mcorekit.convert.hf_io import HFReader


@dataclass
class TensorReport:
    name: str
    status: str  # "equal", "different", "missing", "extra", "dtype", "shape"
    detail: str = ""


def compare_hf(a: str | Path, b: str | Path) -> list[TensorReport]:
    """Every tensor of a against b: equal only when dtype, shape and every bit agree; strict key coverage."""
    ra, rb = HFReader(a), HFReader(b)
    names_a, names_b = set(ra.names()), set(rb.names())
    out = [TensorReport(n, "missing", f"in {a} but not in {b}") for n in sorted(names_a - names_b)]
    out += [TensorReport(n, "extra", f"in {b} but not in {a}") for n in sorted(names_b - names_a)]
    for n in sorted(names_a & names_b):
        x, y = ra.get(n), rb.get(n)
        if x.dtype != y.dtype:
            out.append(TensorReport(n, "dtype", f"{x.dtype} vs {y.dtype}"))
        elif x.shape != y.shape:
            out.append(TensorReport(n, "shape", f"{tuple(x.shape)} vs {tuple(y.shape)}"))
        elif torch.equal(bx := _bits(x), by := _bits(y)):
            out.append(TensorReport(n, "equal"))
        else:
            out.append(TensorReport(n, "different", _difference(x, y, (bx != by).any(dim=1))))
    ra.close()
    rb.close()
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bytes (so -0.0 is not 0.0, and NaNs must share their payload)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Each element's bytes, one row per element (flattened first: a 0-dim tensor cannot be viewed as bytes)."""
    return t.reshape(-1).view(torch.uint8).reshape(t.numel(), t.element_size())


def _difference(x: torch.Tensor, y: torch.Tensor, differs: torch.Tensor) -> str:
    """What differs, counted by bits: -0.0 vs 0.0 and NaNs with other payloads differ while equal as numbers."""
    xs, ys = x.reshape(-1)[differs], y.reshape(-1)[differs]
    if x.is_floating_point():
        xs, ys = xs.double(), ys.double()
        numeric = ~((xs == ys) | (xs.isnan() & ys.isnan()))
    else:  # int64, exactly (a double would round large ones together)
        xs, ys = xs.long(), ys.long()
        numeric = xs != ys
    line = f"{int(differs.sum())} elements differ in their bits"
    if not numeric.any():
        return line + ", all equal as numbers (signed zeros or NaN payloads)"
    return line + f", {int(numeric.sum())} as numbers (max |diff| {(xs - ys)[numeric].abs().max().item():.3e})"


@dataclass
class LogitsReport:
    max_abs_diff: float
    mean_abs_diff: float
    cosine: float
    top1_agreement: float  # over positions whose reference top-1 is decisive (see compare_logits)
    near_ties: int = 0  # positions left out because the reference's top two are closer than numerical noise

    def passed(self, min_cosine: float = 0.9999, min_top1: float = 1.0) -> bool:
        return self.cosine >= min_cosine and self.top1_agreement >= min_top1

    def line(self) -> str:
        return (f"max |diff| {self.max_abs_diff:.3e}, mean |diff| {self.mean_abs_diff:.3e}, cosine {self.cosine:.6f}, "
                f"top-1 agreement {self.top1_agreement * 100:.1f}% ({self.near_ties} near-ties left out)")


def compare_logits(ref: torch.Tensor, got: torch.Tensor, tie_margin: float = 1e-3) -> LogitsReport:
    """Top-1 agreement counts positions where the reference's best token leads the runner-up by more than
    tie_margin: fp32 kernels of different libraries differ by ~1e-4 here, so a closer lead is a coin toss,
    not a conversion error (random tiny test models have nearly flat logits and produce such ties)."""
    ref, got = ref.float().reshape(-1, ref.shape[-1]), got.float().reshape(-1, got.shape[-1])
    diff = (ref - got).abs()
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=-1).mean().item()
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > tie_margin
    agree = ref.argmax(-1) == got.argmax(-1)
    top1 = agree[decisive].float().mean().item() if decisive.any() else 1.0
    return LogitsReport(diff.max().item(), diff.mean().item(), cos, top1, int((~decisive).sum()))
