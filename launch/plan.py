"""Before queueing: every problem of the experiment on the profile's nodes (mcorekit.config.rules, raised as one
error), then whether it fits in GPU memory; and `mcorekit launch plan`, which proposes layouts that fit.

The memory estimate stays in the launcher rather than among the rules in config/: it is a planning aid for
choosing a layout and a node count, an approximation that warns and never refuses, and nothing on the ranks
consults it (there the GPU itself says when memory runs out).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from mcorekit.config.cluster import ClusterProfile, world_size
from mcorekit.config.experiment import Experiment, layout_of
from mcorekit.config.rules import Nodes, layout_problems, listed, model_of, problems
from mcorekit.errors import LayoutError
from mcorekit.models.parallel import Layout
from mcorekit.models.spec import ModelSpec

GiB = 1024**3


def check(exp: Experiment, profile: ClusterProfile) -> tuple[ModelSpec, list[str]]:
    """Raise LayoutError listing every problem (ModelError for an unsound model); return the model and warnings
    (memory) otherwise."""
    model = model_of(exp)
    world = world_size(profile, exp.resources.nodes)
    if bad := problems(exp, world, Nodes.of(profile), model):
        raise LayoutError(listed("invalid layout", bad))
    warnings: list[str] = []
    if profile.gpus_per_node > 0:
        mem = estimate_memory(model, layout_of(exp), world, exp.data.seq_length, exp.schedule.micro_batch_size,
                              exp.recompute.granularity, exp.optimizer.distributed, fp8=exp.precision.fp8_params)
        if mem.total > profile.gpu_memory_gb * GiB * 0.95:
            warnings.append(
                f"estimated memory {mem.describe()} is above 95% of the {profile.gpu_memory_gb:.0f} GiB GPUs: raise TP/PP, lower "
                f"micro_batch_size, or set recompute.granularity=selective/full (`mcorekit launch plan` proposes layouts)"
            )
    return model, warnings


# ---------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    grads: float
    optimizer: float
    activations: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.overhead

    def describe(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k) / GiB:.1f}" for k in ("weights", "grads", "optimizer", "activations", "overhead"))
        return f"{self.total / GiB:.1f} GiB per GPU ({parts})"


def estimate_memory(model: ModelSpec, lay: Layout, world: int, seq: int, mbs: int, recompute: str = "none",
                    distributed_optimizer: bool = True, fp8: bool = False) -> MemoryEstimate:
    """Bytes per GPU on the busiest rank (first pipeline stage): bf16 weights, fp32 grads, fp32 Adam states +
    master weights (sharded over DP with the distributed optimizer), activations of one 1F1B pipeline fill."""
    h, L = model.hidden_size, model.num_layers
    expert_params = 0
    if model.is_moe:
        expert_params = L * model.num_experts * 3 * h * (model.moe_ffn_hidden_size or model.ffn_hidden_size)
    dense_params = model.num_parameters() - expert_params
    dp = max(1, lay.dp(world))
    edp = max(1, world // (lay.pp * lay.ep * lay.etp))
    dense_local = dense_params / (lay.tp * lay.pp)
    expert_local = expert_params / (lay.ep * lay.etp * lay.pp)
    params_local = dense_local + expert_local
    weights = params_local * (1 if fp8 else 2)
    grads = params_local * 4
    opt_bytes = 12  # fp32 master weights + Adam m and v
    if distributed_optimizer:
        optimizer = dense_local * opt_bytes / dp + expert_local * opt_bytes / edp
    else:
        optimizer = params_local * opt_bytes
    # Activations per layer for one micro-batch (Korthikanti et al. 2022) with fused attention (no s^2 term):
    # ~34*s*b*h bytes, split over TP (with SP) and CP; full recompute keeps only each layer's input (2*s*b*h).
    tokens = seq * mbs / lay.cp
    split = lay.tp if (lay.sequence_parallel or lay.tp == 1) else 1
    if recompute == "full":
        per_layer = 2 * tokens * h / split
    elif split == lay.tp:
        per_layer = 34 * tokens * h / lay.tp
    else:  # TP without SP: layer norms and dropouts are replicated
        per_layer = (10 + 24 / lay.tp) * tokens * h
    if model.is_moe:
        per_layer += tokens * model.moe_router_topk * (model.moe_ffn_hidden_size or model.ffn_hidden_size) * 6 / lay.etp
    # 1F1B: the first stage holds PP micro-batches of L/PP layers, i.e. L layers' worth; interleaving adds a fraction.
    in_flight = L * (1 + (lay.pp - 1) / (lay.pp * lay.vpp) if lay.vpp else 1)
    activations = per_layer * in_flight
    logits = tokens * model.vocab_size * 4 / lay.tp  # fp32 logits on the last stage
    activations = max(activations, logits)
    return MemoryEstimate(weights, grads, optimizer, activations, overhead=3 * GiB)


# ---------------------------------------------------------------- plans


def plan(model: ModelSpec, gpus: int, gpus_per_node: int, seq: int, mbs: int, gpu_memory_gb: float,
         top: int = 5) -> list[tuple[Layout, MemoryEstimate]]:
    """Valid layouts that fit, smallest model-parallel first (TP inside a node before PP, then EP for MoE)."""
    found = []
    tps = [t for t in (1, 2, 4, 8) if t <= gpus_per_node]
    pps = [p for p in _divisors(model.num_layers, 64)]
    eps = _divisors(model.num_experts, 64) if model.is_moe else [1]
    for tp, pp, ep in itertools.product(tps, pps, eps):
        lay = Layout(tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1)
        if layout_problems(model, lay, gpus):
            continue
        mem = estimate_memory(model, lay, gpus, seq, mbs, "selective" if tp > 1 else "none")
        if mem.total <= gpu_memory_gb * GiB * 0.9:
            found.append((lay, mem))
    found.sort(key=lambda lm: (lm[0].tp * lm[0].pp, lm[0].pp, -lm[0].ep, lm[1].total))
    return found[:top]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]
