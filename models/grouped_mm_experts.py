"""Experts as two `torch._grouped_mm` calls: one kernel per grouped GEMM instead of one per expert.

Megatron-Core's TEGroupedMLP runs each expert's GEMM through Transformer Engine's GroupedLinear, whose host-side
work per call (splitting inputs, one cuBLAS launch and one output per expert, per-weight gradient bookkeeping)
made the 8-expert benchmark host-bound on an H200: the GPU was busy 19% of a step (docs/train.md). This module
keeps TEGroupedMLP's parameters, checkpoint keys and sharding (it subclasses it) and replaces only the
computation, for bf16 and for FP8 with bf16 weights (models/fp8_grouped_mm.py); anything else goes to
TEGroupedMLP's own forward.
Expert tensor parallelism needs nothing here: the experts' fc1 is split by columns, fc2 by rows, and the
dispatcher's combine step reduces the partial outputs, as it does for TEGroupedMLP.

With `gradient_accumulation_fusion` (and DDP's `main_grad` on the weights) the grouped GEMMs run through
GroupedLinear, which does for the experts what TE's linear layers do for theirs: the backward computes
the weight gradient of all experts in one grouped GEMM and adds it into their `main_grad` in one kernel (two when
DDP laid the experts out in reverse, its usual order), sets `grad_added_to_main_grad` and returns dummy
gradients, so DDP's per-parameter hooks still fire but skip their add. Without it, autograd splits the stacked
weight gradient into one `.grad` per expert and DDP's hooks add each into `main_grad`: 2*experts adds per layer
and micro-batch.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from mcorekit.models.fp8_grouped_mm import FP8_RECIPES, GPUS as FP8_GROUPED_GEMM_GPUS
from mcorekit.models.fp8_grouped_mm import Fp8Weights, alignment_problem, fp8_grouped_mm, fp8_grouped_mm_dgrad, quantize_weights

def grouped_swiglu_mlp(x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                       fc1: torch.Tensor | Sequence[torch.Tensor], fc2: torch.Tensor | Sequence[torch.Tensor],
                       activation: Any = None, fuse_wgrad: bool = False,
                       fp8: tuple[Fp8Weights, Fp8Weights] | None = None) -> torch.Tensor:
    """Tokens sorted by expert -> fc2(act(fc1(x)) * prob) per expert.

    x: [tokens, hidden]; tokens_per_expert: [experts] (rows of x per expert, in order); probs: [tokens] router
    weights; fc1: [experts, 2*ffn, hidden] (gate rows, then up rows); fc2: [experts, hidden, ffn], each also as a
    sequence of per-expert weights (what `fuse_wgrad` needs, see grouped_linear).
    `activation(h, probs)` computes the weighted SwiGLU (default: silu(gate) * up, times probs in fp32 and cast
    back, as Megatron's unfused path does). `fp8`: fc1's and fc2's weights quantized (models/fp8_grouped_mm.py):
    forward and input-gradient GEMMs in FP8, weight gradients in bf16."""
    ends = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int32), dim=0, dtype=torch.int32)
    fp8_fc1, fp8_fc2 = fp8 if fp8 is not None else (None, None)
    h = grouped_linear(x, ends, fc1, fuse_wgrad, fp8_fc1)
    if activation is None:
        gate, up = torch.chunk(h, 2, dim=-1)
        a = (F.silu(gate) * up * probs.unsqueeze(-1)).to(x.dtype)
    else:
        a = activation(h, probs.unsqueeze(-1))
    return grouped_linear(a, ends, fc2, fuse_wgrad, fp8_fc2)


def grouped_linear(x: torch.Tensor, ends: torch.Tensor, weights: torch.Tensor | Sequence[torch.Tensor],
                   fuse_wgrad: bool = False, fp8: Fp8Weights | None = None) -> torch.Tensor:
    """Rows of x sorted by expert (`ends`: cumulative row counts, int32) -> rows times their expert's weight.T.

    weights: [experts, out, in], or a sequence of [out, in] that is stacked here (autograd then hands each its
    slice of the gradient). `fuse_wgrad` (a sequence of weights with `main_grad`) or `fp8` (those weights
    quantized): GroupedLinear."""
    if fuse_wgrad or fp8 is not None:
        return GroupedLinear.apply(x, ends, fuse_wgrad, fp8, *weights)
    w = weights if isinstance(weights, torch.Tensor) else torch.stack(list(weights))
    return torch._grouped_mm(x, w.transpose(1, 2), offs=ends)


class GroupedLinear(torch.autograd.Function):
    """grouped_linear with its weight gradient straight into the weights' `main_grad` (`fuse_wgrad`:
    gradient-accumulation fusion, the contract of TE's `fuse_wgrad_accumulation` with Megatron's DDP), and/or its
    forward and input-gradient GEMMs in FP8 (`fp8`: the weights already quantized, see models/fp8_grouped_mm.py).

    Without fp8, forward and input gradient are the ops autograd runs for the stacked path (same
    `torch._grouped_mm` calls, same operands and layouts), so both are bit-identical to it. The weight gradient
    is that path's too ([experts, out, in] from one grouped GEMM, in the weights' dtype), with fp8 as well.
    With fuse_wgrad it is added into main_grad as DDP's hooks would add it (`main_grad.add_(grad)`), but in one
    add over the experts' contiguous main_grad region when DDP placed them next to each other (see
    main_grad_region; reversed, its usual order, costs a flip of the gradient first), else one add per expert.
    Each weight then gets `grad_added_to_main_grad = True` and a dummy gradient, so DDP's hook fires (bucket
    bookkeeping, overlapped reduce) and skips its add; a weight with `zero_out_wgrad` gets zeros, which the hook
    does add. Without fuse_wgrad each weight gets its slice of the stacked gradient, as autograd would give it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ends: torch.Tensor, fuse_wgrad: bool, fp8: Fp8Weights | None,
                *weights: torch.Tensor) -> torch.Tensor:
        ctx.weights, ctx.fuse_wgrad, ctx.fp8 = weights, fuse_wgrad, fp8
        if fp8 is not None:  # the input gradient reads fp8.cols: no bf16 copy of the weights is kept
            ctx.save_for_backward(x, ends)
            return fp8_grouped_mm(x, ends, fp8)
        w = torch.stack(weights)
        ctx.save_for_backward(x, ends, w)
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, ends, *w = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            # autograd's formulas for _grouped_mm(x, w.transpose(1, 2)): the same calls, operands and layouts
            grad_x = fp8_grouped_mm_dgrad(grad, ends, ctx.fp8) if ctx.fp8 is not None \
                else torch._grouped_mm(grad, w[0], offs=ends)
        if not any(ctx.needs_input_grad[4:]):  # frozen experts (LoRA): no weight gradient to compute
            return (grad_x, None, None, None, *([None] * len(ctx.weights)))
        grad_w = torch._grouped_mm(grad.transpose(-2, -1), x, offs=ends)  # [experts, out, in]
        if ctx.fuse_wgrad:
            accumulate_main_grads(ctx.weights, grad_w)
            wgrads = dummy_wgrads(ctx.weights)
        else:
            wgrads = list(grad_w.unbind(0))
        return (grad_x, None, None, None, *wgrads)


def has_main_grad(weight: torch.Tensor) -> bool:
    """DDP's fp32 gradient buffer on the weight (Megatron-FSDP's parameters hand theirs out differently: they keep
    the plain path)."""
    return getattr(weight, "main_grad", None) is not None and not hasattr(weight, "__fsdp_param__")


def main_grad_region(main_grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool] | None:
    """One [experts, *shape] view over the experts' main_grads when they lie back to back in one storage:
    (view, reversed), where reversed means view[j] is expert experts-1-j's main_grad. Megatron's DDP buffer
    places parameters in reverse registration order (weight{E-1} first, weight0 last) with no gap between
    equal-sized expert weights unless the distributed optimizer pads (param starts to 64 elements, bucket ends
    to lcm(dp, 128)); a separate fp32 copy (param_name_patterns_for_fp32_local_accumulation) or Megatron-FSDP
    breaks adjacency. Checked from data_ptr arithmetic on every call; None: not one region."""
    m0 = main_grads[0]
    n = len(main_grads)
    if n < 2 or not all(m.shape == m0.shape and m.dtype == m0.dtype and m.device == m0.device
                        and m.is_contiguous() for m in main_grads):
        return None
    step = m0.numel() * m0.element_size()
    ptrs = [m.data_ptr() for m in main_grads]
    if all(p == ptrs[0] + i * step for i, p in enumerate(ptrs)):
        first, reverse = m0, False
    elif all(p == ptrs[0] - i * step for i, p in enumerate(ptrs)):
        first, reverse = main_grads[-1], True
    else:
        return None
    storage = first.untyped_storage().data_ptr()
    if any(m.untyped_storage().data_ptr() != storage for m in main_grads):
        return None  # adjacent by chance (separate allocations): one view cannot span them
    return first.as_strided((n, *m0.shape), (m0.numel(), *m0.stride()), first.storage_offset()), reverse


def accumulate_main_grads(weights: Sequence[torch.Tensor], grad_w: torch.Tensor) -> None:
    """main_grad[e] += grad_w[e] for every expert e (= grad_w[e] where Megatron-FSDP sets overwrite_main_grad)."""
    main_grads = [w.main_grad for w in weights]
    overwrite = [bool(getattr(w, "overwrite_main_grad", False)) for w in weights]
    region = main_grad_region(main_grads) if len(set(overwrite)) == 1 else None
    if region is not None:
        view, reverse = region
        src = grad_w.flip(0) if reverse else grad_w  # no negative strides in torch: one copy, then one add
        view.copy_(src) if overwrite[0] else view.add_(src)
        return
    for m, g, o in zip(main_grads, grad_w, overwrite):
        m.copy_(g) if o else m.add_(g)


_DUMMY_WGRADS: dict[tuple, torch.Tensor] = {}


def dummy_wgrads(weights: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """What TE's fused layers return as weight gradients (transformer_engine get_dummy_wgrads_for_params): for a
    weight with `grad_added_to_main_grad` (DDP's), set it and return a never-read buffer shared by all weights of
    that shape (a fresh alias each time: AccumulateGrad takes it as .grad without copying, DDP's hook drops it),
    zeros where `zero_out_wgrad`; None for others (no hook to trigger)."""
    out: list[torch.Tensor | None] = []
    for w in weights:
        if not hasattr(w, "grad_added_to_main_grad"):
            out.append(None)
            continue
        w.grad_added_to_main_grad = True
        if getattr(w, "zero_out_wgrad", False):
            out.append(torch.zeros_like(w))
            continue
        key = (tuple(w.shape), w.dtype, w.device)
        if key not in _DUMMY_WGRADS:
            _DUMMY_WGRADS[key] = torch.empty(w.shape, dtype=w.dtype, device=w.device)
        out.append(_DUMMY_WGRADS[key].detach())
    return out


def run_forward_pre_hooks(module: torch.nn.Module, x: torch.Tensor) -> None:
    """What calling `module` would run before its forward. Megatron's DDP waits there for the module's parameters
    to be all-gathered (overlap_param_gather); reading the weights without calling the module must wait too."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if key in module._forward_pre_hooks_with_kwargs:
            hook(module, (x,), {})
        else:
            hook(module, (x,))


def grouped_mm_experts_class() -> type:
    """TEGroupedMLP with the computation above (imported lazily: it needs Transformer Engine)."""
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    class GroupedMMExperts(TEGroupedMLP):
        def _supported(self, x: torch.Tensor) -> bool:
            c = self.config
            return ((not c.fp8 or self._fp8_supported(x)) and not getattr(c, "fp4", None) and x.dtype == torch.bfloat16
                    and x.shape[0] > 0 and c.gated_linear_unit and c.activation_func is F.silu
                    and not self.linear_fc1.use_bias and not self.linear_fc2.use_bias
                    and not c.moe_apply_probs_on_input and c.moe_mlp_glu_interleave_size is None
                    and getattr(c, "activation_func_clamp_value", None) is None
                    and not getattr(c, "glu_linear_offset", 0.0) and not getattr(self, "_with_fused_impl", False)
                    and not getattr(self, "offload_expert_fc1", False) and not getattr(self, "offload_moe_act", False)
                    # recompute of the expert activation (recompute.modules: moe_act) and delayed weight
                    # gradients are TEGroupedMLP's own machinery: leave those runs to it
                    and not getattr(self, "activation_recompute", False) and not getattr(c, "delay_wgrad_compute", False))

        def _fp8_supported(self, x: torch.Tensor) -> bool:
            """FP8 with bf16 weights under a per-tensor recipe (delayed or tensorwise), in widths the kernel takes
            (this rank's: expert tensor parallelism splits the FFN), on a GPU it runs on; the block-scaled recipes,
            FP8 weights and other GPUs stay with TE (config/rules.py sends those runs there)."""
            c = self.config
            hidden, ffn = self.linear_fc2.weight0.shape  # [hidden, local FFN]
            return (c.fp8_recipe in FP8_RECIPES and not c.fp8_param and alignment_problem(hidden, ffn) is None
                    and x.is_cuda and torch.cuda.get_device_capability(x.device) in FP8_GROUPED_GEMM_GPUS)

        def _forget_fp8_weights_on_a_new_step(self) -> None:
            if getattr(self.linear_fc1, "is_first_microbatch", True):  # the optimizer has changed the weights
                self.fp8_weights = None

        def _fp8_weights(self, fc1: list[torch.Tensor], fc2: list[torch.Tensor]) -> tuple[Fp8Weights, Fp8Weights]:
            """The experts' weights in FP8, quantized on each step's first micro-batch and reused by the others, as
            TE caches its layers' FP8 weights: Megatron's schedule sets `is_first_microbatch` on the bypassed
            GroupedLinear modules at the start of each step (disable_parameter_transpose_cache: every time)."""
            if self.config.disable_parameter_transpose_cache or getattr(self, "fp8_weights", None) is None:
                self.fp8_weights = (quantize_weights(torch.stack(fc1).detach()),
                                    quantize_weights(torch.stack(fc2).detach()))
            self.linear_fc1.is_first_microbatch = self.linear_fc2.is_first_microbatch = False
            return self.fp8_weights

        def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                    permuted_probs: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            x = permuted_local_hidden_states
            self._forget_fp8_weights_on_a_new_step()  # before the choice: TE's forward, below, clears the flag too
            if args or kwargs or not self._supported(x):
                return super().forward(x, tokens_per_expert, permuted_probs, *args, **kwargs)
            for linear in (self.linear_fc1, self.linear_fc2):
                run_forward_pre_hooks(linear, x)
            n = self.num_local_experts
            fc1 = [getattr(self.linear_fc1, f"weight{i}") for i in range(n)]
            fc2 = [getattr(self.linear_fc2, f"weight{i}") for i in range(n)]
            # gradient_accumulation_fusion, as TE's layers do it: the experts' weight gradients go into DDP's
            # main_grad from one grouped GEMM and one add per GEMM, not one .grad and one DDP add per expert
            fuse_wgrad = self.config.gradient_accumulation_fusion and all(map(has_main_grad, fc1 + fc2))
            fused = self.config.bias_activation_fusion  # Megatron's fused weighted SwiGLU, as TEGroupedMLP uses
            act = (lambda h, p: weighted_bias_swiglu_impl(h, None, p, self.config.activation_func_fp8_input_store)) \
                if fused else None
            fp8 = self._fp8_weights(fc1, fc2) if self.config.fp8 else None
            out = grouped_swiglu_mlp(x, torch.as_tensor(tokens_per_expert), permuted_probs, fc1, fc2, act,
                                     fuse_wgrad, fp8)
            return out, None

    return GroupedMMExperts


def keep_expert_counts_on_gpu(model: torch.nn.Module) -> int:
    """Stop the alltoall dispatcher copying each MoE layer's tokens-per-expert to the host when nothing there needs
    them. Its only host sync with one expert- and one tensor-parallel rank, dropless and fused permutation is
    "before_finish": copying the counts GroupedMMExperts then reads on the GPU anyway. That sync, once per layer
    and micro-batch, stopped the host from running ahead of the GPU (bench/levers.py `nosync`: +26% on the
    8-expert shape, 2026-12-01). Where the dispatcher needs host values earlier (splits for expert parallelism,
    dropping, unfused permutation) it keeps its own behaviour; TEGroupedMLP's fallback calls .tolist() itself.
    Returns the number of MoE layers changed."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    changed = 0
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        experts = getattr(module, "experts", None)
        if not (isinstance(dispatcher, MoEAlltoAllTokenDispatcher) and type(experts).__name__ == "GroupedMMExperts"):
            continue
        dispatcher._maybe_dtoh_and_synchronize = _counts_on_gpu(dispatcher, dispatcher._maybe_dtoh_and_synchronize)
        changed += 1
    return changed


def _counts_on_gpu(dispatcher: Any, copy_and_sync: Any) -> Any:
    def maybe_dtoh_and_synchronize(point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
        # preprocess() has set the sync point for this forward before the first call; it only moves earlier
        if dispatcher.cuda_sync_point == "before_finish" and not dispatcher.drop_and_pad:
            return tokens_per_expert
        return copy_and_sync(point, tokens_per_expert)

    return maybe_dtoh_and_synchronize


def skip_identity_sort(model: torch.nn.Module) -> int:
    """With one expert- and one tensor-parallel rank, the alltoall dispatcher's second permutation (tokens from
    (rank, expert) order into (expert, rank) order, and back before the combine) is the identity: every token
    already sits in its expert's block. Megatron-Core still runs it, a sort kernel and a copy each way per MoE
    layer and micro-batch, 512 per step of the 8-expert benchmark; here those MoE layers skip it. Token dropping
    with padding keeps Megatron-Core's own path. Returns the number of MoE layers changed."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    changed = 0
    for module in model.modules():
        d = getattr(module, "token_dispatcher", None)
        if isinstance(d, MoEAlltoAllTokenDispatcher) and d.ep_size * d.tp_size == 1 and not d.drop_and_pad:
            d.dispatch_postprocess = _unsorted_postprocess(d)
            d.combine_preprocess = lambda hidden_states: hidden_states  # with one TP rank, nothing to reduce
            changed += 1
    return changed


def _unsorted_postprocess(d: Any) -> Any:
    def dispatch_postprocess(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, Any, torch.Tensor]:
        # MoEAlltoAllTokenDispatcher.dispatch_postprocess without the all-gather (one TP rank) and the sort
        d.tokens_per_expert = d._maybe_dtoh_and_synchronize("before_permutation_2", d.tokens_per_expert)
        tokens_per_expert = d._maybe_dtoh_and_synchronize("before_finish", d.tokens_per_expert)
        d.tokens_per_expert = None
        return tokens, tokens_per_expert, probs

    return dispatch_postprocess


def use_grouped_mm_experts(layer_spec: Any) -> Any:
    """The TE layer spec with its MoE experts computed by GroupedMMExperts (same parameters and keys)."""
    from functools import partial

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from mcorekit.models.megatron import with_mlp_submodules

    experts = getattr(layer_spec.submodules.mlp, "keywords", {}).get("submodules")
    experts = getattr(experts, "experts", None)
    if not (isinstance(experts, partial) and experts.func is TEGroupedMLP):
        raise TypeError(f"expected the TE spec's MoE experts to be TEGroupedMLP, found {experts!r}")
    return with_mlp_submodules(layer_spec, experts=partial(grouped_mm_experts_class(), *experts.args,
                                                           **experts.keywords))
