"""FP8 grouped GEMMs for the MoE experts under precision.fp8 (models/grouped_mm_experts.py calls them).

Transformer Engine's FP8 grouped experts need each expert's token count on the host: a device-to-host copy and a
sync per MoE layer and micro-batch, which keeps the step out of a CUDA graph (train/step_graph.py). Eager FP8 MoE
trained at 0.43x transformers bf16 on one H200 (docs/train.md, 2026-12-02). Here the forward and input-gradient
GEMMs are `torch._scaled_grouped_mm`, Hopper's FP8 grouped GEMM, which reads the expert boundaries from a GPU
tensor, so nothing waits on the host and the step can be captured.

Scaling is per row and computed from the data each time (current scaling, no amax history): every token's row of
the activations and gradients, and every weight row along the contracted dimension, gets its own fp32 scale so
that its largest magnitude maps to e4m3's 448. Finer than TE's per-tensor scales, so gradients use e4m3 too.
The weight gradient stays a bf16 grouped GEMM: in FP8 its contracted dimension is the tokens, whose per-expert
groups vary in size each step and would need column scales per group.
Importing this module does not import torch: config/rules.py reads FP8_RECIPES and alignment_problem on the login
node, where the launcher stays quick without it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:
    import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_RECIPES = ("delayed", "tensorwise")  # precision.fp8 recipes whose experts run here (per-tensor scaled elsewhere)
GPUS = ((9, 0), (10, 0))  # compute capabilities torch._scaled_grouped_mm runs on (Hopper, datacenter Blackwell)
TINY = 1e-12  # an all-zero row gets this amax: its quantized values are zeros, and no scale is 0 or inf


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [..., rows, cols] -> (e4m3 values of the same shape, contiguous; fp32 dequantization scale per row
    [..., rows]), with values * scale ~= t. Any strides in. On a GPU a 2-D t (activations, gradients) goes through
    one kernel that torch.compile makes of quantize_rows_eager, one per width for any number of rows:
    bench/fp8_quant_bench.py measured 139 ms per step of the MoE benchmark as separate kernels, 41 ms fused (one
    H200; a bf16 copy of the same tensors takes 26)."""
    if not (t.is_cuda and t.dim() == 2):
        return quantize_rows_eager(t)
    return _run_compiled(quantize_rows_eager, t, dynamic_dim=0)


def quantize_rows_eager(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows as torch ops: the amax is one reduction over t's own dtype, then a scale and a cast."""
    import torch

    amax = torch.linalg.vector_norm(t, float("inf"), dim=-1, keepdim=True).float()
    scale = amax.clamp(min=TINY) / E4M3_MAX
    values = (t * scale.reciprocal()).to(torch.float8_e4m3fn, memory_format=torch.contiguous_format)
    return values, scale.squeeze(-1)


class Fp8Weights(NamedTuple):
    """One grouped linear's expert weights [experts, out, in] in e4m3, in the two layouts its GEMMs read."""
    rows: torch.Tensor        # [experts, out, in]: scaled per output row, for the forward
    row_scale: torch.Tensor   # [experts, out]
    cols: torch.Tensor        # [experts, in, out]: scaled per input column, for the input gradient
    col_scale: torch.Tensor   # [experts, in]


def quantize_weights(w: torch.Tensor) -> Fp8Weights:
    """w [experts, out, in] -> both layouts. The rows go through quantize_rows as [experts * out, in] rows, so the
    activations' kernels of that width serve them; the columns through one kernel per weight shape."""
    experts, out, inp = w.shape
    rows, row_scale = quantize_rows(w.reshape(experts * out, inp))
    cols, col_scale = quantize_columns(w)
    return Fp8Weights(rows.view(experts, out, inp), row_scale.view(experts, out), cols, col_scale)


def quantize_columns(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [experts, out, in] -> quantize_rows of w.transpose(1, 2): [experts, in, out] values, contiguous, and a
    scale per (expert, input column)."""
    return _run_compiled(_transposed_rows, w, dynamic_dim=None) if w.is_cuda else _transposed_rows(w)


def _transposed_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows_eager(w.transpose(1, 2))


def _run_compiled(fn: Callable, t: torch.Tensor, dynamic_dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(t) through its torch.compile'd kernel: every size of t fixed in the graph but `dynamic_dim` (token rows)."""
    import torch

    t = t.detach()  # the marks stay off the caller's tensor, and requires_grad (a guard) is always False
    for dim in range(t.dim()):
        if dim == dynamic_dim:
            torch._dynamo.maybe_mark_dynamic(t, dim)
        else:
            torch._dynamo.mark_static(t, dim)
    with torch.no_grad():  # never differentiated; one grad mode, so calls from generation do not recompile
        return _compiled(fn)(t)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """torch.compile(fn), made on first use. torch keeps at most eight compiled graphs per function and runs it
    uncompiled beyond them (correct, slower): a model's experts need three widths of quantize_rows (hidden, FFN,
    twice the FFN) and two weight shapes of _transposed_rows, and generation (inference tensors, another guard)
    two widths and two shapes more."""
    import torch

    return torch.compile(fn)


def fp8_grouped_mm(x: torch.Tensor, ends: torch.Tensor, w: Fp8Weights) -> torch.Tensor:
    """Forward: rows of x [tokens, in] sorted by expert (`ends`: cumulative counts, int32) -> x @ W_e.T, bf16."""
    xq, x_scale = quantize_rows(x)
    # the kernel wants its second operand column-major: rows.transpose is [experts, in, out] over [out, in] storage
    return scaled_grouped_mm(xq, w.rows.transpose(1, 2), x_scale, w.row_scale, ends)


def fp8_grouped_mm_dgrad(grad: torch.Tensor, ends: torch.Tensor, w: Fp8Weights) -> torch.Tensor:
    """Input gradient: grad [tokens, out] -> grad @ W_e, bf16."""
    gq, g_scale = quantize_rows(grad)
    return scaled_grouped_mm(gq, w.cols.transpose(1, 2), g_scale, w.col_scale, ends)


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                      ends: torch.Tensor) -> torch.Tensor:
    """torch._scaled_grouped_mm (CUDA only; CPU tests put a dequantizing reference in its place)."""
    import torch

    return torch._scaled_grouped_mm(a, b, a_scale, b_scale, offs=ends, out_dtype=torch.bfloat16)


def alignment_problem(hidden: int, ffn: int) -> str | None:
    """The FP8 kernel reads rows of 16-byte multiples: both GEMM widths must be multiples of 16."""
    bad = [f"{name} {n}" for name, n in (("hidden size", hidden), ("expert FFN size", ffn)) if n % 16]
    return f"FP8 grouped GEMMs need multiples of 16, got {' and '.join(bad)}" if bad else None
