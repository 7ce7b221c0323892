"""models/grouped_mm_experts.py on CPU: the grouped computation equals a loop over experts (forward and
gradients), and the layer spec swap keeps everything but the experts' class. Its speed and its agreement with
TEGroupedMLP inside a training run are GPU matters (tests/test_gpu_train.py, bench/train_bench.py)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from mcorekit.models.grouped_mm_experts import grouped_swiglu_mlp, use_grouped_mm_experts


def per_expert_loop(x, counts, probs, fc1, fc2):
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        h = x[start:start + n] @ fc1[e].T
        gate, up = h.chunk(2, dim=-1)
        out.append(((F.silu(gate) * up).float() * probs[start:start + n, None]).to(x.dtype) @ fc2[e].T)
        start += n
    return torch.cat(out)


def test_grouped_equals_per_expert_loop_with_an_empty_expert() -> None:
    torch.manual_seed(0)
    experts, hidden, ffn = 4, 32, 48
    counts = torch.tensor([5, 0, 9, 2])  # expert 1 gets no token
    x = torch.randn(int(counts.sum()), hidden, dtype=torch.float32)
    probs = torch.rand(x.shape[0])
    fc1 = torch.randn(experts, 2 * ffn, hidden) / hidden**0.5
    fc2 = torch.randn(experts, hidden, ffn) / ffn**0.5
    grad_out = torch.randn(x.shape[0], hidden)

    leaves = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
    got = grouped_swiglu_mlp(leaves[0], counts, leaves[1], leaves[2], leaves[3])
    got.backward(grad_out)
    ref_leaves = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
    want = per_expert_loop(ref_leaves[0], counts, ref_leaves[1], ref_leaves[2], ref_leaves[3])
    want.backward(grad_out)

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(["x", "probs", "fc1", "fc2"], leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")
    assert fc1.new_zeros(1).sum() == leaves[2].grad[1].abs().sum()  # the empty expert gets a zero gradient


def test_bf16_matches_the_loop_to_bf16_rounding() -> None:
    torch.manual_seed(1)
    counts = torch.tensor([16, 8, 24])
    x = torch.randn(48, 64, dtype=torch.bfloat16)
    fc1 = (torch.randn(3, 128, 64) / 8).bfloat16()
    fc2 = (torch.randn(3, 64, 64) / 8).bfloat16()
    probs = torch.rand(48)
    got = grouped_swiglu_mlp(x, counts, probs, fc1, fc2)
    want = per_expert_loop(x, counts, probs, fc1, fc2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_spec_swap_changes_only_the_experts_class() -> None:
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    experts = partial(TEGroupedMLP, submodules="fc1/fc2 specs")
    spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        mlp=partial(MoELayer, submodules=MoESubmodules(experts=experts, shared_experts="shared"))))
    swapped = use_grouped_mm_experts(spec).submodules.mlp
    new = swapped.keywords["submodules"]
    assert swapped.func is MoELayer and new.shared_experts == "shared"
    assert issubclass(new.experts.func, TEGroupedMLP) and new.experts.func is not TEGroupedMLP
    assert new.experts.keywords == {"submodules": "fc1/fc2 specs"}


def test_forward_pre_hooks_of_the_bypassed_modules_run() -> None:
    """Megatron's DDP all-gathers parameters in a module's forward pre-hook (overlap_param_gather); the weights
    are read without calling the module, so its pre-hooks must still run."""
    from mcorekit.models.grouped_mm_experts import run_forward_pre_hooks

    linear, seen = torch.nn.Linear(2, 2), []
    linear.register_forward_pre_hook(lambda m, args: seen.append(("plain", m, len(args))))
    linear.register_forward_pre_hook(lambda m, args, kwargs: seen.append(("kwargs", m, kwargs)), with_kwargs=True)
    run_forward_pre_hooks(linear, torch.zeros(1, 2))
    assert seen == [("plain", linear, 1), ("kwargs", linear, {})]


# --- gradient-accumulation fusion (GroupedLinear with fuse_wgrad) against today's path, with Megatron's DDP layout and
# hook. Megatron's _ParamAndGradBuffer allocates on CUDA, so its main_grads are rebuilt here from Megatron's own
# layout functions the way _ParamAndGradBuffer._get slices them; the hook is DDP's own _make_backward_post_hook.

EXPERTS = 4


class _Grouped(torch.nn.Module):
    """TE GroupedLinear's parameters: weight0..weight{E-1}, registered in order."""

    def __init__(self, out: int, inp: int, weights: torch.Tensor) -> None:
        super().__init__()
        for i in range(weights.shape[0]):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(weights[i].clone()))

    def weights(self) -> list[torch.nn.Parameter]:
        return [getattr(self, f"weight{i}") for i in range(len(self._parameters))]


class _Experts(torch.nn.Module):
    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor) -> None:
        super().__init__()
        self.linear_fc1 = _Grouped(*fc1.shape[1:], fc1)
        self.linear_fc2 = _Grouped(*fc2.shape[1:], fc2)


def _layout(params, kind: str):
    """{param: (start, end)} in one fp32 grad buffer, and the buffer's numel, as Megatron would lay them out."""
    from types import SimpleNamespace

    from megatron.core.distributed.param_and_grad_buffer import _compute_default_per_buffer_param_layout
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if kind == "ddp":
        layout = _compute_default_per_buffer_param_layout(params, None)
    elif kind == "ddp-buckets":  # a bucket boundary inside the experts: no padding without the distributed optimizer
        layout = _compute_default_per_buffer_param_layout(params, 2 * params[0].numel())
    elif kind in ("distopt", "distopt-small-buckets"):  # pads param starts to 64 elements, bucket ends to
        # lcm(dp, 128). An expert weight's numel is a multiple of 64 (grouped_mm needs rows of 16 bytes: both dims
        # multiples of 8), so only a bucket end can leave a gap: "small-buckets" closes one after every fc2 weight
        bucket = params[-1].numel() if kind == "distopt-small-buckets" else 3 * params[0].numel()
        layout = DistributedOptimizer._compute_per_buffer_param_layout(
            params, bucket, 1, SimpleNamespace(pad_buckets_for_high_nccl_busbw=False))
    elif kind == "shuffled":  # no known order: [2, 0, 3, 1, ...] of each GroupedLinear
        starts, pos = {}, 0
        for group in (params[:EXPERTS], params[EXPERTS:]):
            for p in [group[i] for i in (2, 0, 3, 1)]:
                starts[p] = (pos, pos + p.numel())
                pos += p.numel()
        return starts, pos
    else:
        raise ValueError(kind)
    spans = {p: layout.param_index_map[p][:2] for p in params}
    return spans, layout.bucket_indices[-1][1]


def _ddp_like(model: torch.nn.Module, kind: str, prefill: torch.Tensor | None):
    """main_grad views into one fp32 buffer (pre-filled), grad_added_to_main_grad, and DDP's hook on each param."""
    from types import SimpleNamespace

    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    params = [p for p in model.parameters() if p.requires_grad]  # DDP's order (named_parameters)
    spans, numel = _layout(params, kind)
    buffer = prefill.clone() if prefill is not None else torch.randn(numel) + 3.0  # non-zero: checks accumulation
    fake_ddp = SimpleNamespace(param_to_bucket_group={p: None for p in params},
                               ddp_config=SimpleNamespace(overlap_grad_reduce=False))
    grad_accs = []
    for p in params:
        start, end = spans[p]
        p.main_grad = buffer[start:end].view(p.shape)
        p.grad_added_to_main_grad = False
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(DistributedDataParallel._make_backward_post_hook(fake_ddp, p))
        grad_accs.append(acc)
    return buffer, grad_accs


def _experts_step(kind: str, fuse_wgrad: bool, activation, seed: int = 0, hidden: int = 32, ffn: int = 48,
                  prefill: torch.Tensor | None = None):
    torch.manual_seed(seed)
    counts = torch.tensor([7, 0, 12, 5])  # expert 1 gets no token
    x = torch.randn(int(counts.sum()), hidden, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(x.shape[0], requires_grad=True)
    fc1 = (torch.randn(EXPERTS, 2 * ffn, hidden) / hidden**0.5).bfloat16()
    fc2 = (torch.randn(EXPERTS, hidden, ffn) / ffn**0.5).bfloat16()
    grad_out = torch.randn(x.shape[0], hidden, dtype=torch.bfloat16)
    model = _Experts(fc1, fc2)
    buffer, keep = _ddp_like(model, kind, prefill)
    start = buffer.clone()
    out = grouped_swiglu_mlp(x, counts, probs, model.linear_fc1.weights(), model.linear_fc2.weights(), activation,
                             fuse_wgrad=fuse_wgrad)
    out.backward(grad_out)
    del keep
    return out, x.grad, probs.grad, buffer, start, model


def _fused_swiglu(h, p):
    """Megatron's fused weighted SwiGLU (an autograd.Function of its own), as the module uses it. Its kernels are
    torch.compile'd; the tests run them eagerly (_eager: compiling them on CPU takes a minute)."""
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
    return weighted_bias_swiglu_impl(h, None, p, False)


def _eager():
    return torch._dynamo.config.patch(disable=True)


def test_megatron_lays_out_a_grouped_linear_reversed_and_adjacent() -> None:
    """What the one-add path relies on, read from Megatron's own layout code: weight{E-1} first, weight0 last, no
    gap between them (also across a bucket boundary); the distributed optimizer pads a bucket's end to a
    multiple of 128 elements, a gap where a bucket ends after an expert weight whose numel is an odd multiple of 64
    (the 8x2048x1408 shape's are multiples of 128: no gap)."""
    from mcorekit.models.grouped_mm_experts import main_grad_region

    for kind, hidden, ffn, want in [("ddp", 32, 48, (True, True)), ("ddp-buckets", 32, 48, (True, True)),
                                    ("distopt", 32, 48, (True, True)), ("distopt", 24, 40, (True, True)),
                                    ("distopt-small-buckets", 24, 40, (True, None)),
                                    ("shuffled", 32, 48, (None, None))]:
        model = _Experts(torch.zeros(EXPERTS, 2 * ffn, hidden), torch.zeros(EXPERTS, hidden, ffn))
        _ddp_like(model, kind, None)
        for linear, want in zip((model.linear_fc1, model.linear_fc2), want):
            region = main_grad_region([w.main_grad for w in linear.weights()])
            if want is None:
                assert region is None, (kind, hidden, ffn)
                continue
            view, reverse = region
            assert reverse is want, kind
            for i, w in enumerate(linear.weights()):
                assert view[EXPERTS - 1 - i].data_ptr() == w.main_grad.data_ptr()
            view.fill_(i)  # one view over exactly the experts' main_grads
            assert all((w.main_grad == i).all() for w in linear.weights())


def test_main_grad_region_in_registration_order_and_separate_allocations() -> None:
    from mcorekit.models.grouped_mm_experts import main_grad_region

    flat = torch.zeros(EXPERTS * 6)
    in_order = [flat[6 * i:6 * i + 6].view(2, 3) for i in range(EXPERTS)]
    view, reverse = main_grad_region(in_order)
    assert not reverse and view.shape == (EXPERTS, 2, 3) and view.data_ptr() == flat.data_ptr()
    assert main_grad_region([torch.zeros(2, 3) for _ in range(EXPERTS)]) is None
    assert main_grad_region([t.t() for t in in_order]) is None  # not contiguous


def _check_fused_equals_today(kind: str, activation, hidden: int = 32, ffn: int = 48) -> None:
    out, gx, gp, buf, start, model = _experts_step(kind, True, activation, hidden=hidden, ffn=ffn)
    ref_out, ref_gx, ref_gp, ref_buf, ref_start, _ = _experts_step(kind, False, activation, hidden=hidden, ffn=ffn,
                                                                   prefill=start)
    assert torch.equal(start, ref_start)
    # forward, input and probs gradients: the same grouped_mm calls on the same operands -> bit-identical
    assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx) and torch.equal(gp, ref_gp)
    # main_grad: today's path = prefill + bf16 weight gradient added by DDP's hook; the fused one adds the same
    # bf16 gradient in one kernel (or per expert): identical here, and a gap (padding) stays untouched
    assert not torch.equal(buf, start)
    torch.testing.assert_close(buf, ref_buf, rtol=0, atol=0)
    for w in model.parameters():
        assert w.grad_added_to_main_grad is True and w.grad is None  # DDP's hook saw the dummy and dropped it


def test_fused_wgrad_equals_todays_path_contiguous_reversed() -> None:
    _check_fused_equals_today("ddp", None)
    with _eager():
        _check_fused_equals_today("ddp-buckets", _fused_swiglu)
        _check_fused_equals_today("distopt", _fused_swiglu)


def test_fused_wgrad_equals_todays_path_non_contiguous() -> None:
    _check_fused_equals_today("shuffled", None)
    with _eager():  # fc2's experts padded apart (per-expert adds), fc1's adjacent (one region)
        _check_fused_equals_today("distopt-small-buckets", _fused_swiglu, hidden=24, ffn=40)


def test_fused_wgrad_against_plain_autograd_in_fp32() -> None:
    """Independent of today's code: main_grad gains exactly d(loss)/d(weight) of the per-expert loop."""
    torch.manual_seed(3)
    counts = torch.tensor([3, 6, 0, 4])
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)
    probs = torch.rand(x.shape[0])
    fc1, fc2 = torch.randn(EXPERTS, 40, 16) / 4, torch.randn(EXPERTS, 16, 20) / 4
    model = _Experts(fc1, fc2)
    buffer, keep = _ddp_like(model, "ddp", None)
    start = buffer.clone()
    grouped_swiglu_mlp(x, counts, probs, model.linear_fc1.weights(), model.linear_fc2.weights(),
                       fuse_wgrad=True).square().sum().backward()
    ref = [t.clone().requires_grad_() for t in (fc1, fc2)]
    per_expert_loop(x.detach(), counts, probs, *ref).square().sum().backward()
    for linear, g in zip((model.linear_fc1, model.linear_fc2), ref):
        for i, w in enumerate(linear.weights()):
            gained = w.main_grad - start[w.main_grad.storage_offset():][:w.numel()].view(w.shape)
            torch.testing.assert_close(gained, g.grad[i], rtol=1e-4, atol=1e-5)


def test_zero_out_wgrad_gets_zeros_and_without_ddp_no_dummy() -> None:
    from mcorekit.models.grouped_mm_experts import dummy_wgrads

    w = torch.nn.Parameter(torch.ones(2, 3))
    assert dummy_wgrads([w]) == [None]  # no DDP flag: nothing for a hook to see
    w.grad_added_to_main_grad, w.zero_out_wgrad = False, True
    (d,) = dummy_wgrads([w])
    assert w.grad_added_to_main_grad and torch.equal(d, torch.zeros(2, 3))


def _count_backward_ops(fuse_wgrad: bool) -> tuple[int, int]:
    """aten ops run by the backward of one expert layer (8 experts, DDP's hook included): (all, non-view)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "_unsafe_view", "transpose", "t", "select", "detach", "alias", "as_strided", "expand",
             "unsqueeze", "squeeze", "slice", "split", "split_with_sizes", "chunk", "unbind", "permute", "reshape"}

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    n, hidden, ffn = 8, 32, 48
    torch.manual_seed(0)
    counts = torch.tensor([3, 5, 0, 7, 2, 4, 6, 1])
    x = torch.randn(int(counts.sum()), hidden, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(x.shape[0], requires_grad=True)
    model = _Experts((torch.randn(n, 2 * ffn, hidden) / 8).bfloat16(), (torch.randn(n, hidden, ffn) / 8).bfloat16())
    model.linear_fc1.weights = lambda: [getattr(model.linear_fc1, f"weight{i}") for i in range(n)]
    model.linear_fc2.weights = lambda: [getattr(model.linear_fc2, f"weight{i}") for i in range(n)]
    keep = _ddp_like(model, "ddp", None)
    out = grouped_swiglu_mlp(x, counts, probs, model.linear_fc1.weights(), model.linear_fc2.weights(),
                             _fused_swiglu, fuse_wgrad=fuse_wgrad)
    grad = torch.randn_like(out)
    with Count() as c:
        out.backward(grad)
    del keep
    return len(c.ops), sum(op not in views for op in c.ops)


def test_fused_backward_runs_fewer_ops() -> None:
    with _eager():
        today, fused = _count_backward_ops(False), _count_backward_ops(True)
    print(f"\nbackward of one 8-expert layer, aten ops (all, non-view): today {today}, fused {fused}")
    assert fused[1] < today[1] and fused[0] < today[0]


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_expert_counts_stay_on_gpu_only_where_nothing_needs_them_on_the_host(
        model_parallel: None, monkeypatch: pytest.MonkeyPatch, capacity: float | None) -> None:
    """Megatron-Core's own alltoall dispatcher (one rank, on CPU: its side stream is stood in for, since there is no
    CUDA here): dropless with fused permutation, its only host sync is "before_finish", for the counts that
    GroupedMMExperts reads on the GPU; keep_expert_counts_on_gpu then hands them back untouched without calling
    the copy. With a capacity factor the dispatcher needs the host value before permutation, and keeps its copy."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from mcorekit.models import grouped_mm_experts as gmm
    from mcorekit.models.megatron import transformer_config
    from mcorekit.models.spec import resolve

    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())  # set: __init__ makes none
    config = transformer_config(resolve("mixtral-tiny", None, {}), cpu_init=True, moe_expert_capacity_factor=capacity)
    experts = config.num_moe_experts
    dispatcher = MoEAlltoAllTokenDispatcher(experts, list(range(experts)), config, get_default_pg_collection())
    config.moe_permute_fusion = True  # TE's fused permutation, our default with TE (set late: it needs CUDA and TE)
    layer = torch.nn.Module()
    layer.token_dispatcher, layer.experts = dispatcher, type("GroupedMMExperts", (torch.nn.Module,), {})()
    copies: list[str] = []
    dispatcher._maybe_dtoh_and_synchronize = lambda point, counts=None: copies.append(point) or counts
    assert gmm.keep_expert_counts_on_gpu(layer) == 1

    routing = torch.zeros(16, experts, dtype=torch.bool)
    routing[torch.arange(16), torch.arange(16) % experts] = True
    counts = dispatcher.preprocess(routing)
    for point in ("before_permutation_1", "before_finish"):
        assert dispatcher._maybe_dtoh_and_synchronize(point, counts) is counts
    if capacity is None:
        assert dispatcher.cuda_sync_point == "before_finish" and copies == []
    else:
        assert dispatcher.cuda_sync_point == "before_permutation_1"
        assert copies == ["before_permutation_1", "before_finish"]


def test_identity_sort_is_skipped_with_one_rank_and_the_tokens_are_the_same(
        model_parallel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one EP and one TP rank Megatron-Core's sort by local expert (and its inverse before the combine) is the
    identity; skip_identity_sort leaves it out. The same routed tokens, counts and probabilities come out of
    Megatron-Core's own dispatcher and the changed one, bit for bit, through dispatch and combine (on CPU, with
    Megatron-Core's unfused sort)."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from mcorekit.models import grouped_mm_experts as gmm
    from mcorekit.models.megatron import transformer_config
    from mcorekit.models.spec import resolve

    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())  # set: __init__ makes none
    config = transformer_config(resolve("mixtral-tiny", None, {}), cpu_init=True)
    experts = config.num_moe_experts
    megatron, ours = (MoEAlltoAllTokenDispatcher(experts, list(range(experts)), config, get_default_pg_collection())
                      for _ in range(2))
    for d in (megatron, ours):  # no CUDA stream to copy on: the counts are already host tensors here
        d._maybe_dtoh_and_synchronize = lambda point, counts=None: counts
    layer = torch.nn.Module()
    layer.token_dispatcher = ours
    assert gmm.skip_identity_sort(layer) == 1 and gmm.skip_identity_sort(torch.nn.Module()) == 0

    torch.manual_seed(0)
    tokens, top = 24, 2
    scores = torch.rand(tokens, experts)
    chosen = scores.topk(top, dim=1).indices
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.where(routing, scores, torch.zeros(()))
    hidden = torch.randn(tokens, config.hidden_size)
    results = []
    for d in (megatron, ours):
        x, p = d.dispatch_preprocess(hidden, routing, probs)
        x, p = d.token_dispatch(x, p)
        x, counts, p = d.dispatch_postprocess(x, p)
        combined = d.combine_preprocess(x * 3)
        results.append((x, torch.as_tensor(counts), p, combined))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert results[0][1].tolist() == routing.sum(0).tolist()
