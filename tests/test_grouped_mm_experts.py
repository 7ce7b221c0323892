"""models/grouped_mm_experts.py on CPU: the grouped computation equals a loop over experts (forward and
gradients), and the layer spec swap keeps everything but the experts' class. Its speed and its agreement with
TEGroupedMLP inside a training run are GPU matters (tests/test_gpu_train.py, bench/train_bench.py)."""

from __future__ import annotations

from functools import partial

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
