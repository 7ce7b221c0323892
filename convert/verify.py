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
        elif torch.equal(x.view(torch.uint8) if x.dtype != torch.bool else x, y.view(torch.uint8) if y.dtype != torch.bool else y):
            out.append(TensorReport(n, "equal"))
        else:
            diff = (x.float() - y.float()).abs()
            out.append(TensorReport(n, "different", f"max |diff| {diff.max().item():.3e}, {int((diff > 0).sum())} elements differ"))
    ra.close()
    rb.close()
    return out


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
