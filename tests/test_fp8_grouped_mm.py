"""models/fp8_grouped_mm.py and the FP8 path of models/grouped_mm_experts.py on CPU.

torch._scaled_grouped_mm has no CPU kernel, so these tests put a reference in its place (`reference_kernel`):
it first runs the operator on meta tensors, which applies torch's own checks of the CUDA kernel's contract
(e4m3 operands, first row-major, second column-major, scale shapes, int32 offsets), then dequantizes and
multiplies in fp32. The real kernel's agreement with that reference is tests/test_gpu_train.py's."""

from __future__ import annotations

import pytest
import torch

import mcorekit.models.fp8_grouped_mm as fp8
from mcorekit.models.grouped_mm_experts import grouped_linear, grouped_swiglu_mlp


def reference_kernel(a, b, a_scale, b_scale, ends):
    meta = [t.to("meta") for t in (a, b, a_scale, b_scale, ends)]
    for t, m in zip((a, b), meta):
        assert m.stride() == t.stride()
    out = torch._scaled_grouped_mm(*meta[:4], offs=meta[4], out_dtype=torch.bfloat16)  # torch's contract checks
    a32 = a.float() * a_scale[:, None]
    b32 = b.float() * b_scale[:, None, :]
    got = torch._grouped_mm(a32, b32, offs=ends).to(torch.bfloat16)
    assert got.shape == out.shape
    return got


@pytest.fixture(autouse=True)
def cpu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8, "scaled_grouped_mm", reference_kernel)


def test_rows_are_scaled_to_the_e4m3_range() -> None:
    torch.manual_seed(0)
    t = torch.randn(6, 40, dtype=torch.bfloat16) * torch.tensor([1e-3, 1, 30, 1e4, 0, 2])[:, None]
    t[4] = 0  # an all-zero row
    q, scale = fp8.quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and scale.dtype == torch.float32
    assert scale.shape == (6,) and torch.isfinite(scale).all() and (scale > 0).all()
    peak = q.float().abs().amax(dim=1)
    assert peak[[0, 1, 2, 3, 5]].tolist() == [448.0] * 5  # each row's largest magnitude is e4m3's largest
    assert peak[4] == 0
    back = q.float() * scale[:, None]
    # e4m3 keeps 3 mantissa bits: within half a step (1/16 relative) of each value, or of the subnormal step
    assert ((back - t.float()).abs() <= t.float().abs() / 16 + scale[:, None] * 2**-9).all()


def test_weights_in_both_layouts() -> None:
    torch.manual_seed(1)
    w = torch.randn(3, 48, 32, dtype=torch.bfloat16)
    q = fp8.quantize_weights(w)
    assert q.rows.shape == (3, 48, 32) and q.row_scale.shape == (3, 48)
    assert q.cols.shape == (3, 32, 48) and q.col_scale.shape == (3, 32)
    assert q.rows.is_contiguous() and q.cols.is_contiguous()
    # the kernel reads them transposed: column-major views
    assert q.rows.transpose(1, 2).stride()[-2:] == (1, 32) and q.cols.transpose(1, 2).stride()[-2:] == (1, 48)
    for back in (q.rows.float() * q.row_scale[..., None], (q.cols.float() * q.col_scale[..., None]).transpose(1, 2)):
        torch.testing.assert_close(back, w.float(), rtol=1 / 16, atol=1e-2)


def grouped_case(seed: int = 2):
    torch.manual_seed(seed)
    counts = torch.tensor([16, 0, 40, 8])  # expert 1 gets no token
    x = torch.randn(int(counts.sum()), 32, dtype=torch.bfloat16)
    w = (torch.randn(4, 48, 32) / 32**0.5).to(torch.bfloat16)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    grad = torch.randn(x.shape[0], 48, dtype=torch.bfloat16)
    return x, w, ends, grad


def test_fp8_linear_forward_and_input_gradient_from_the_quantized_operands() -> None:
    """Forward and input gradient are the quantized operands' products (fp32 accumulation, as the kernel), the
    weight gradient is the bf16 path's exactly; everything stays within FP8's error of the bf16 results."""
    x, w, ends, grad = grouped_case()
    q = fp8.quantize_weights(w)
    xs = x.clone().requires_grad_()
    ws = [t.clone().requires_grad_() for t in w]
    out = grouped_linear(xs, ends, ws, fp8=q)
    out.backward(grad)

    xq, x_scale = fp8.quantize_rows(x)
    want = torch._grouped_mm(xq.float() * x_scale[:, None], (q.rows.float() * q.row_scale[..., None]).transpose(1, 2),
                             offs=ends).bfloat16()
    assert torch.equal(out, want)
    gq, g_scale = fp8.quantize_rows(grad)
    want_dx = torch._grouped_mm(gq.float() * g_scale[:, None], (q.cols.float() * q.col_scale[..., None]).transpose(1, 2),
                                offs=ends).bfloat16()
    assert torch.equal(xs.grad, want_dx)

    xb = x.clone().requires_grad_()
    wb = w.clone().requires_grad_()
    ref = grouped_linear(xb, ends, wb)
    ref.backward(grad)
    assert torch.equal(torch.stack([t.grad for t in ws]), wb.grad)  # bf16 weight gradient, the same GEMM
    for a, b in ((out, ref), (xs.grad, xb.grad)):
        err = (a.float() - b.float()).norm() / b.float().norm()
        assert 0 < err < 0.08, err  # FP8 differs from bf16, by FP8's rounding
    assert ws[1].grad.abs().sum() == 0  # the expert without tokens


def test_fp8_with_fused_weight_gradients_into_main_grad() -> None:
    x, w, ends, grad = grouped_case(3)
    q = fp8.quantize_weights(w)
    ws = [t.clone().requires_grad_() for t in w]
    for t in ws:
        t.main_grad = torch.ones(t.shape, dtype=torch.float32)
        t.grad_added_to_main_grad = False
    grouped_linear(x.clone().requires_grad_(), ends, ws, fuse_wgrad=True, fp8=q).backward(grad)
    wb = w.clone().requires_grad_()
    grouped_linear(x, ends, wb).backward(grad)
    for t, g in zip(ws, wb.grad):
        assert t.grad_added_to_main_grad
        torch.testing.assert_close(t.main_grad, 1 + g.float(), rtol=0, atol=0)


def test_swiglu_experts_in_fp8_stay_close_to_bf16() -> None:
    torch.manual_seed(4)
    counts = torch.tensor([24, 8, 0, 32])
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    probs = torch.rand(64)
    fc1 = (torch.randn(4, 96, 32) / 32**0.5).to(torch.bfloat16)
    fc2 = (torch.randn(4, 32, 48) / 48**0.5).to(torch.bfloat16)
    got = grouped_swiglu_mlp(x, counts, probs, list(fc1), list(fc2),
                             fp8=(fp8.quantize_weights(fc1), fp8.quantize_weights(fc2)))
    want = grouped_swiglu_mlp(x, counts, probs, fc1, fc2)
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert got.dtype == torch.bfloat16 and 0 < err < 0.08, err


def test_the_kernel_contract_is_checked() -> None:
    """The reference refuses what the CUDA kernel refuses (a row-major second operand), so the layouts above are
    the kernel's."""
    x, w, ends, _ = grouped_case()
    q = fp8.quantize_weights(w)
    xq, x_scale = fp8.quantize_rows(x)
    with pytest.raises(RuntimeError, match="column major"):
        reference_kernel(xq, q.rows.transpose(1, 2).contiguous(), x_scale, q.row_scale, ends)


def test_alignment() -> None:
    assert fp8.alignment_problem(2048, 1408) is None
    assert fp8.alignment_problem(2050, 1408) == "FP8 grouped GEMMs need multiples of 16, got hidden size 2050"


def test_weights_are_quantized_once_per_step_and_again_after_an_update() -> None:
    """GroupedMMExperts' FP8 weight cache, with the flags Megatron's schedule sets: a step's first micro-batch
    quantizes, the others reuse it; the next step (after the optimizer changed the weights) quantizes anew, also
    when TE's own forward took its first micro-batch and cleared the flag; disable_parameter_transpose_cache
    quantizes every time."""
    from types import SimpleNamespace

    from mcorekit.models.grouped_mm_experts import grouped_mm_experts_class

    experts = grouped_mm_experts_class()
    w1 = [torch.randn(48, 32, dtype=torch.bfloat16) for _ in range(2)]
    w2 = [torch.randn(32, 24, dtype=torch.bfloat16) for _ in range(2)]
    me = SimpleNamespace(linear_fc1=SimpleNamespace(is_first_microbatch=True),
                         linear_fc2=SimpleNamespace(is_first_microbatch=True),
                         config=SimpleNamespace(disable_parameter_transpose_cache=False), fp8_weights=None)

    def micro_batch(te_took_it: bool = False):
        experts._forget_fp8_weights_on_a_new_step(me)  # forward's first call, before it chooses a path
        if te_took_it:  # TEGroupedMLP's forward ran instead: it clears the flags and leaves the cache alone
            me.linear_fc1.is_first_microbatch = me.linear_fc2.is_first_microbatch = False
            return None
        return experts._fp8_weights(me, w1, w2)

    def new_step():
        me.linear_fc1.is_first_microbatch = me.linear_fc2.is_first_microbatch = True  # set_is_first_microbatch

    first = micro_batch()
    assert micro_batch() is first and not me.linear_fc1.is_first_microbatch
    torch.testing.assert_close(first[0].rows.float() * first[0].row_scale[..., None], torch.stack(w1).float(),
                               rtol=1 / 16, atol=1e-2)
    for w in w1 + w2:
        w.mul_(-2)  # the optimizer's update
    new_step()
    second = micro_batch()
    assert second is not first and torch.equal(second[0].rows, fp8.quantize_weights(torch.stack(w1)).rows)
    for w in w1 + w2:
        w.mul_(3)
    new_step()
    assert micro_batch(te_took_it=True) is None
    third = micro_batch()  # the step's first micro-batch went to TE: the cache was still dropped
    assert torch.equal(third[1].rows, fp8.quantize_weights(torch.stack(w2)).rows)
    me.config.disable_parameter_transpose_cache = True
    assert micro_batch() is not micro_batch()
