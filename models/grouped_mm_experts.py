"""Experts as two `torch._grouped_mm` calls: one kernel per grouped GEMM instead of one per expert.

Megatron-Core's TEGroupedMLP runs each expert's GEMM through Transformer Engine's GroupedLinear, whose host-side
work per call (splitting inputs, one cuBLAS launch and one output per expert, per-weight gradient bookkeeping)
made the 8-expert benchmark host-bound on an H200: the GPU was busy 19% of a step (docs/train.md). This module
keeps TEGroupedMLP's parameters, checkpoint keys and sharding (it subclasses it) and replaces only the
computation, for bf16 without FP8; anything else goes to TEGroupedMLP's own forward.
Expert tensor parallelism needs nothing here: the experts' fc1 is split by columns, fc2 by rows, and the
dispatcher's combine step reduces the partial outputs, as it does for TEGroupedMLP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def grouped_swiglu_mlp(x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor, fc1: torch.Tensor,
                       fc2: torch.Tensor, activation: Any = None) -> torch.Tensor:
    """Tokens sorted by expert -> fc2(act(fc1(x)) * prob) per expert.

    x: [tokens, hidden]; tokens_per_expert: [experts] (rows of x per expert, in order); probs: [tokens] router
    weights; fc1: [experts, 2*ffn, hidden] (gate rows, then up rows); fc2: [experts, hidden, ffn].
    `activation(h, probs)` computes the weighted SwiGLU (default: silu(gate) * up, times probs in fp32 and cast
    back, as Megatron's unfused path does)."""
    ends = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int32), dim=0, dtype=torch.int32)
    h = torch._grouped_mm(x, fc1.transpose(1, 2), offs=ends)
    if activation is None:
        gate, up = torch.chunk(h, 2, dim=-1)
        a = (F.silu(gate) * up * probs.unsqueeze(-1)).to(x.dtype)
    else:
        a = activation(h, probs.unsqueeze(-1))
    return torch._grouped_mm(a, fc2.transpose(1, 2), offs=ends)


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
            return (not (c.fp8 or getattr(c, "fp4", None)) and x.dtype == torch.bfloat16
                    and x.shape[0] > 0 and c.gated_linear_unit and c.activation_func is F.silu
                    and not self.linear_fc1.use_bias and not self.linear_fc2.use_bias
                    and not c.moe_apply_probs_on_input and c.moe_mlp_glu_interleave_size is None
                    and getattr(c, "activation_func_clamp_value", None) is None
                    and not getattr(c, "glu_linear_offset", 0.0) and not getattr(self, "_with_fused_impl", False)
                    and not getattr(self, "offload_expert_fc1", False) and not getattr(self, "offload_moe_act", False)
                    # recompute of the expert activation (recompute.modules: moe_act) and delayed weight
                    # gradients are TEGroupedMLP's own machinery: leave those runs to it
                    and not getattr(self, "activation_recompute", False) and not getattr(c, "delay_wgrad_compute", False))

        def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                    permuted_probs: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            x = permuted_local_hidden_states
            if args or kwargs or not self._supported(x):
                return super().forward(x, tokens_per_expert, permuted_probs, *args, **kwargs)
            for linear in (self.linear_fc1, self.linear_fc2):
                run_forward_pre_hooks(linear, x)
            n = self.num_local_experts
            fc1 = torch.stack([getattr(self.linear_fc1, f"weight{i}") for i in range(n)])
            fc2 = torch.stack([getattr(self.linear_fc2, f"weight{i}") for i in range(n)])
            fused = self.config.bias_activation_fusion  # Megatron's fused weighted SwiGLU, as TEGroupedMLP uses
            act = (lambda h, p: weighted_bias_swiglu_impl(h, None, p, self.config.activation_func_fp8_input_store)) \
                if fused else None
            out = grouped_swiglu_mlp(x, torch.as_tensor(tokens_per_expert), permuted_probs, fc1, fc2, act)
            return out, None

    return GroupedMMExperts


def use_grouped_mm_experts(layer_spec: Any) -> Any:
    """The TE layer spec with its MoE experts computed by GroupedMMExperts (same parameters and keys)."""
    import dataclasses
    from functools import partial

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    moe = layer_spec.submodules.mlp
    experts = getattr(moe, "keywords", {}).get("submodules")
    experts = getattr(experts, "experts", None)
    if not (isinstance(experts, partial) and experts.func is TEGroupedMLP):
        raise TypeError(f"expected the TE spec's MoE experts to be TEGroupedMLP, found {experts!r}")
    submodules = dataclasses.replace(moe.keywords["submodules"],
                                     experts=partial(grouped_mm_experts_class(), *experts.args, **experts.keywords))
    layer_spec.submodules.mlp = partial(moe.func, *moe.args, **{**moe.keywords, "submodules": submodules})
    return layer_spec
