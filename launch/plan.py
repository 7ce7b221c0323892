"""Before queueing: every problem of the experiment on the profile's nodes (mcorekit.config.rules, raised as one
error), then whether it fits in GPU memory; and `mcorekit launch plan`, which proposes layouts that fit.

The memory estimate stays in the launcher rather than among the rules in config/: it is a planning aid for
choosing a layout and a node count, an approximation that warns and never refuses, and nothing on the ranks
consults it (there the GPU itself says when memory runs out).
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from mcorekit.config.cluster import ClusterProfile, world_size
from mcorekit.config.experiment import Experiment, layout_of
from mcorekit.config.rules import Nodes, layout_problems, listed, model_of, problems
from mcorekit.errors import LayoutError, ModelError
from mcorekit.hub import is_hub_id
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
    lora = exp.peft.lora
    # a record that would run code when unpickled: refused before queueing, as at training's start (hub ids and
    # folders this machine lacks have nothing to read here)
    if any(p and Path(p).is_dir() for p in (exp.checkpoint.load, lora.load if lora else None)):
        from mcorekit.train.checkpoint import checked_sources  # imports torch (seconds): only with a folder to read

        checked_sources(exp)
    if lora and lora.load and Path(lora.load).is_dir():  # rank, alpha, targets: before queueing
        from mcorekit.train.lora import adapter_start

        adapter_start(lora)
    warnings = unseen_inputs(exp)
    if profile.gpus_per_node > 0:
        mem = estimate_memory(model, layout_of(exp), world, exp.data.seq_length, exp.schedule.micro_batch_size,
                              exp.recompute.granularity, exp.optimizer.distributed, fp8=exp.precision.fp8_params,
                              fsdp=exp.parallel.fsdp, bucket_size=exp.optimizer.bucket_size, **task_memory(exp))
        if mem.total > profile.gpu_memory_gb * GiB * 0.95:
            warnings.append(
                f"estimated memory {mem.describe()} is above 95% of the {profile.gpu_memory_gb:.0f} GiB GPUs: raise TP/PP, lower "
                f"micro_batch_size, set recompute.granularity=full, or shard more with parallel.fsdp "
                f"(`mcorekit launch plan` proposes layouts)"
            )
    return model, warnings


def unseen_inputs(exp: Experiment) -> list[str]:
    """The files a job reads that this machine cannot see. Warnings, not errors: the nodes may mount paths this
    machine lacks; but most often the path is wrong, and the job would fail at its start after waiting in the queue."""
    d, out = exp.data, []
    for key, prefixes in (("data.paths", d.paths), ("data.valid_paths", d.valid_paths)):
        for p in prefixes:
            files = [f"{p}.bin", f"{p}.idx"] if d.kind == "indexed" else [p]
            if absent := [f for f in files if not Path(f).expanduser().is_file()]:
                out.append(f"{key}: {', '.join(absent)} not found on this machine; the job fails at its start unless "
                           f"its nodes see it")
    lora = exp.peft.lora
    for key, folder in (("data.tokenizer", d.tokenizer), ("checkpoint.load", exp.checkpoint.load),
                        ("peft.lora.load", lora.load if lora else None)):
        if folder and not is_hub_id(folder) and not Path(folder).expanduser().is_dir():
            out.append(f"{key}: no folder {folder} on this machine; the job fails at its start unless its nodes see it")
    for reward in exp.grpo.rewards:  # a file is only looked for: importing it here would run the user's code
        where = reward.function.rpartition(":")[0]
        if (where.endswith(".py") or "/" in where) and not Path(where).expanduser().is_file():
            out.append(f"grpo.rewards: {reward.function}: no file {where} on this machine; the job fails at its "
                       f"start unless its nodes see it")
    return out


# ---------------------------------------------------------------- memory


def task_memory(exp: Experiment) -> dict[str, Any]:
    """What the training task and LoRA change in the estimate: DPO runs two sequences per sample (chosen and
    rejected) and, with a live reference and no LoRA, holds a frozen bf16 copy of the weights (GRPO with a KL term
    too); LoRA trains only its adapters (no gradients or optimizer state for the frozen base)."""
    lora = exp.peft.lora
    kind = exp.data.kind
    reference = ((kind == "dpo" and exp.dpo.reference == "live") or (kind == "grpo" and exp.grpo.kl_coeff > 0))
    return {"rows_per_sample": 2 if kind == "dpo" else 1, "reference_copy": reference and lora is None,
            "lora_rank": lora.rank if lora else None}

FSDP_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")  # parallel.fsdp: what is sharded over DP


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    grads: float
    optimizer: float
    activations: float
    overhead: float
    buffers: float = 0.0  # Megatron-FSDP's unsharded communication buffers (all-gathered weights, unreduced grads)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.overhead + self.buffers

    def describe(self) -> str:
        names = ("weights", "grads", "optimizer") + (("buffers",) if self.buffers else ()) + ("activations", "overhead")
        parts = ", ".join(f"{k} {getattr(self, k) / GiB:.1f}" for k in names)
        return f"{self.total / GiB:.1f} GiB per GPU ({parts})"


def estimate_memory(model: ModelSpec, lay: Layout, world: int, seq: int, mbs: int, recompute: str = "none",
                    distributed_optimizer: bool = True, fp8: bool = False, fsdp: str | None = None,
                    bucket_size: int | None = 40_000_000, rows_per_sample: int = 1, reference_copy: bool = False,
                    lora_rank: int | None = None) -> MemoryEstimate:
    """Bytes per GPU on the busiest rank (first pipeline stage): bf16 weights, fp32 grads, fp32 Adam states +
    master weights (12 bytes a parameter), activations of one 1F1B pipeline fill.

    Sharded over the data-parallel ranks (expert parameters over the expert-data-parallel ranks): the optimizer
    state with the distributed optimizer or any parallel.fsdp strategy (`optim` is the same memory as the
    distributed optimizer); also the gradients with `optim_grads`; also the weights of the transformer layers with
    `optim_grads_params` (the embedding, output layer and final norm are in no FSDP unit and stay whole).
    Megatron-FSDP's buffers on top: with sharded gradients, two buckets of fp32 gradients waiting for their
    reduce-scatter (the one filling and the one in flight; a bucket is one layer with optim_grads_params, else
    optimizer.bucket_size parameters); with sharded weights, two layers all-gathered in bf16 (the one computing and
    the next one, prefetched).

    Tasks (task_memory): `rows_per_sample` sequences per micro-batch sample (DPO: 2) scale the activations; a
    `reference_copy` adds the frozen bf16 weights of the reference model; with `lora_rank` only the adapters of the
    attention and MLP linear layers (rank x (in + out) each, every linear adapted) have gradients and optimizer state."""
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
    # One transformer layer on this rank (the FSDP unit of optim_grads_params); the rest of the dense parameters
    # (embedding, output layer, final norm) belong to no layer.
    outside = model.vocab_size * h * (1 if model.tie_word_embeddings else 2) + h
    layer_dense = (dense_params - outside) / L / lay.tp
    layer_expert = expert_params / L / (lay.ep * lay.etp)
    layer = layer_dense + layer_expert
    per_weight = 1 if fp8 else 2

    def sharded(nbytes: float, dense: float, expert: float) -> float:
        return nbytes * (dense / dp + expert / edp)

    weights = params_local * per_weight
    grads = params_local * 4
    if distributed_optimizer or fsdp:
        optimizer = sharded(12, dense_local, expert_local)
    else:
        optimizer = params_local * 12
    if reference_copy:
        weights += params_local * 2
    if lora_rank:  # the frozen base has neither gradients nor optimizer state; the adapters are replicated over DP
        q, kv = model.num_attention_heads * model.kv_channels, model.num_query_groups * model.kv_channels
        f = model.ffn_hidden_size
        per_layer_adapter = lora_rank * ((3 * h + q + 2 * kv) + (q + h) + (2 * h + 2 * f) + (f + h))
        adapters = per_layer_adapter * L / (lay.tp * lay.pp)
        weights += adapters * per_weight
        grads = adapters * 4
        optimizer = adapters * 12
    buffers = 0.0
    if fsdp in ("optim_grads", "optim_grads_params"):
        grads = sharded(4, dense_local, expert_local)
        bucket = layer if fsdp == "optim_grads_params" else min(bucket_size or params_local, params_local)
        buffers += 2 * bucket * 4
    if fsdp == "optim_grads_params":
        stage_layers = L / lay.pp
        weights = per_weight * (dense_local - layer_dense * stage_layers) + sharded(
            per_weight, layer_dense * stage_layers, layer_expert * stage_layers)
        buffers += 2 * layer * per_weight
    # Activations per layer for one micro-batch (Korthikanti et al. 2022) with fused attention (no s^2 term):
    # ~34*s*b*h bytes, split over TP (with SP) and CP; full recompute keeps only each layer's input (2*s*b*h).
    tokens = seq * mbs * rows_per_sample / lay.cp
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
    return MemoryEstimate(weights, grads, optimizer, activations, overhead=3 * GiB, buffers=buffers)


# ---------------------------------------------------------------- plans


class Proposal(NamedTuple):
    layout: Layout
    fsdp: str | None  # parallel.fsdp, None: the distributed optimizer alone
    memory: MemoryEstimate


def plan(model: ModelSpec, gpus: int, gpus_per_node: int, seq: int, mbs: int, gpu_memory_gb: float,
         recompute: str = "none", fits: float = 0.9) -> list[Proposal]:
    """Every valid layout that fits in `fits` x the GPU memory, least model parallelism first (TP inside a node
    before PP, then EP for MoE). Each with the distributed optimizer where that fits, else the least-sharding
    Megatron-FSDP strategy that does (pp=1 only): sharding more over DP is proposed before splitting the model
    over more ranks, and never where it is not needed (it adds communication)."""
    found = []
    tps = [t for t in (1, 2, 4, 8) if t <= gpus_per_node]
    pps = _divisors(model.num_layers, 64)
    eps = _divisors(model.num_experts, 64) if model.is_moe else [1]
    for tp, pp, ep in itertools.product(tps, pps, eps):
        lay = Layout(tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1)
        if layout_problems(model, lay, gpus):
            continue
        shardings = [None] + (["optim_grads", "optim_grads_params"] if pp == 1 and lay.dp(gpus) > 1 else [])
        for fsdp in shardings:
            mem = estimate_memory(model, lay, gpus, seq, mbs, recompute, fsdp=fsdp)
            if mem.total <= gpu_memory_gb * GiB * fits:
                found.append(Proposal(lay, fsdp, mem))
                break
    order = {None: 0, "optim_grads": 1, "optim_grads_params": 2}
    found.sort(key=lambda p: (p.layout.tp * p.layout.pp, p.layout.pp, -p.layout.ep, order[p.fsdp], p.memory.total))
    return found


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


# ---------------------------------------------------------------- `mcorekit launch plan`


def main(argv: list[str]) -> int:
    from mcorekit.config.cluster import load_profile
    from mcorekit.options import count, index, nonempty, positive_float

    parser = argparse.ArgumentParser(allow_abbrev=False,
        prog="mcorekit launch plan",
        description="Propose TP/PP/EP layouts (with the distributed optimizer, or Megatron-FSDP where that fits with "
        "fewer model-parallel ranks) that are valid for the model and fit in GPU memory, by the launcher's estimate.")
    parser.add_argument("--model", type=nonempty, required=True,
                        help="a preset name (e.g. llama-3b), an HF model directory / config.json, or a Hub model ID "
                             "(org/name)")
    parser.add_argument("--gpus", type=count, required=True, help="total GPUs")
    parser.add_argument("--cluster", type=nonempty, default=None,
                        help="a cluster profile (name or YAML path) for GPUs per node and memory per GPU")
    parser.add_argument("--gpus-per-node", type=count, default=None,
                        help="GPUs per node, the limit for TP (default: the profile's, else 8)")
    parser.add_argument("--gpu-memory-gb", type=positive_float, default=None,
                        help="memory per GPU in GiB (default: the profile's gpu_memory_gb, else 80)")
    parser.add_argument("--seq", type=count, default=4096, help="sequence length (default: 4096)")
    parser.add_argument("--mbs", type=count, default=1, help="micro-batch size (default: 1)")
    parser.add_argument("--recompute", choices=("none", "full"), default="none",
                        help="activation recompute to assume: full keeps only each layer's input "
                        "(recompute.granularity=full in the experiment; default: none)")
    parser.add_argument("--top", type=index, default=5, help="list at most this many layouts; 0 lists all (default: 5)")
    args = parser.parse_args(argv)

    model = _model(args.model)
    profile = load_profile(args.cluster) if args.cluster else None
    per_node = args.gpus_per_node or (profile.gpus_per_node if profile and profile.gpus_per_node > 0 else 8)
    if args.gpu_memory_gb is not None:
        memory, source = args.gpu_memory_gb, "--gpu-memory-gb"
    elif profile is not None:
        memory, source = profile.gpu_memory_gb, f"profile {profile.name!r}"
    else:
        memory, source = 80.0, "default; set --gpu-memory-gb or --cluster"
    proposals = plan(model, args.gpus, per_node, args.seq, args.mbs, memory, args.recompute)
    print(f"{model.architecture}, {model.num_parameters() / 1e9:.2f}B parameters, {args.gpus} GPU{'s' * (args.gpus > 1)} "
          f"({per_node} per node), seq {args.seq}, mbs {args.mbs}, recompute {args.recompute}")
    print(f"memory per GPU: {memory:g} GiB ({source}); a layout fits when its estimate is at most 90% of it")
    if not proposals:
        hint = "" if args.recompute == "full" else ", or assume --recompute full"
        print(f"no valid layout fits; add GPUs, lower --seq/--mbs{hint}")
        return 1
    rows = proposals if args.top == 0 else proposals[: args.top]
    for p in rows:
        fsdp = f"fsdp={p.fsdp}" if p.fsdp else "dist-opt"
        print(f"  {str(p.layout):<20} DP{p.layout.dp(args.gpus):<4} {fsdp:<24} {p.memory.describe()}")
    if len(rows) < len(proposals):
        print(f"  ... {len(proposals) - len(rows)} more of {len(proposals)} that fit (--top 0 lists all)")
    return 0


def _model(name: str) -> ModelSpec:
    """A preset, or an HF model directory / config.json; a name that is neither gets the closest presets."""
    from mcorekit.config.model import resolve_model
    from mcorekit.models.spec_checks import model_problems
    from mcorekit.config.values import shown
    from mcorekit.hub import is_hub_id
    from mcorekit.models.spec import PRESETS

    if name in PRESETS:
        model = resolve_model(name, None, None)
    elif Path(name).exists() or is_hub_id(name):  # a Hub ID (org/name): its config.json, through the HF cache
        model = resolve_model(None, name, None)
    else:
        import difflib

        close = difflib.get_close_matches(name, PRESETS, n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ModelError(f"--model {shown(name)} is neither a preset nor an HF model directory or config.json"
                         f"{hint} (presets: {', '.join(PRESETS)})")
    if bad := model_problems(model):
        raise ModelError(f"{shown(name)}: " + "; ".join(bad))
    return model
