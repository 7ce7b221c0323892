"""Is this parallel layout possible for this model on these GPUs, and will it fit? Checked before anything queues.

The rules are Megatron-Core's (parallel_state.initialize_model_parallel and TransformerConfig): train/ calls
the same `check()` on the nodes, so a layout the launcher accepts is one the training script accepts.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcorekit.errors import LayoutError, ModelError
from mcorekit.launch.config import ClusterProfile, Experiment, shown
from mcorekit.models.parallel import Layout
from mcorekit.models.spec import ModelSpec, resolve

GiB = 1024**3


def nodes_use_te(exp: Experiment, profile: ClusterProfile) -> bool:
    """Whether the model will run on Transformer Engine layers on this profile's nodes."""
    return profile.transformer_engine and exp.model.backend != "local"


def validation_problems(exp: Experiment) -> list[str]:
    d, s = exp.data, exp.schedule
    if d.valid_paths and d.kind == "mock":
        return ["data.valid_paths is for indexed or sft data; mock data validates on its own stream (drop valid_paths)"]
    if d.valid_paths and not s.eval_interval:
        return ["data.valid_paths is set but schedule.eval_interval=0, so it would never be used: set "
                "schedule.eval_interval (e.g. 1000) or drop data.valid_paths"]
    if s.eval_interval and d.kind != "mock" and not d.valid_paths:
        return [f"schedule.eval_interval={s.eval_interval} needs held-out data: data.valid_paths ("
                f"{'.bin/.idx prefixes' if d.kind == 'indexed' else '.jsonl files'}, like data.paths)"]
    return []


def use_torch_expert_gemm(exp: Experiment, uses_te: bool) -> bool:
    """Whether the MoE experts run as torch._grouped_mm (models/grouped_mm_experts.py): asked for, or by default
    (auto), where it applies: bf16 without FP8, TE's grouped experts, and neither the a2a-overlap schedule (which
    splits the experts' backward into TE's own steps) nor recompute of the expert activation (TEGroupedMLP's own)."""
    moe_act_recompute = exp.recompute.granularity == "selective" and "moe_act" in exp.recompute.modules
    return (exp.moe.expert_gemm != "te" and uses_te and exp.moe.grouped_gemm and exp.precision.dtype == "bf16"
            and not exp.precision.fp8 and not exp.moe.a2a_overlap and not moe_act_recompute)


def expert_gemm_problems(exp: Experiment, uses_te: bool) -> list[str]:
    if exp.moe.expert_gemm == "torch" and not use_torch_expert_gemm(exp, uses_te):
        return ["moe.expert_gemm=torch computes TE's grouped experts in bf16 (torch._grouped_mm); with precision.fp8, "
                "another dtype, moe.grouped_gemm=false, moe.a2a_overlap, recompute of moe_act or without TE use "
                "moe.expert_gemm=te or auto"]
    return []


def context_parallel_problems(exp: Experiment, uses_te: bool) -> list[str]:
    """CP runs TE's context-parallel attention. Seen on an H200 with TE 2.20: fp32 with CP>1 finds "no dot product
    attention backend" (TE's fused kernels are 16-bit only, its unfused one has no CP); Megatron's local
    attention has no CP at all."""
    if exp.parallel.cp > 1 and (exp.precision.dtype == "fp32" or not uses_te):
        return ["parallel.cp > 1 runs Transformer Engine's context-parallel attention, which needs precision.dtype "
                "bf16 or fp16 and model.backend auto or te (on a profile with transformer_engine: true)"]
    return []


# ModelSpec is a plain dataclass filled from presets, HF configs and model.overrides: check its types here, so
# that a wrong value is a message instead of a TypeError or ZeroDivisionError inside the layout arithmetic.
_MODEL_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                "ffn_hidden_size", "vocab_size", "max_position_embeddings", "moe_router_topk")
_MODEL_OPTIONAL_SIZES = ("num_experts", "moe_ffn_hidden_size")
_MODEL_POSITIVE_FLOATS = ("rope_theta", "norm_epsilon")
_MODEL_FLAGS = ("tie_word_embeddings", "qkv_bias", "qk_layernorm", "moe_norm_topk_prob")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_HF_CONFIG_BYTES = 10_000_000  # an HF config.json is a few KB


def resolve_model(preset: str | None, hf_config: str | None, overrides: dict[str, Any] | None) -> ModelSpec:
    """models.spec.resolve, with a broken HF config (not JSON, not an object, keys missing, values of the wrong
    type) reported as one ModelError naming the file instead of the parser's exception."""
    if hf_config is None:
        return resolve(preset, hf_config, overrides)
    path = Path(hf_config) / "config.json" if Path(hf_config).is_dir() else Path(hf_config)
    where = f"model.hf_config {shown(path)}"
    if path.is_file() and path.stat().st_size > MAX_HF_CONFIG_BYTES:
        raise ModelError(f"{where}: larger than {MAX_HF_CONFIG_BYTES:,} bytes, so not an HF config.json")
    try:
        return resolve(preset, hf_config, overrides)
    except UnicodeDecodeError:
        raise ModelError(f"{where}: not UTF-8 text; name an HF model directory or its config.json") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{where}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except KeyError as e:
        raise ModelError(f"{where}: has no {e.args[0]!r}, which the model needs") from None
    except (AttributeError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelError(f"{where}: not an HF model config of the expected shape ({type(e).__name__}: {e})") from None


def model_problems(model: ModelSpec) -> list[str]:
    """Each model field of the wrong type or out of range, named with its value (empty when all are sound)."""
    out = []
    for name in _MODEL_SIZES + _MODEL_OPTIONAL_SIZES:
        v = getattr(model, name)
        if v is None and name in _MODEL_OPTIONAL_SIZES:
            continue
        if not _is_int(v) or v < 1:
            out.append(f"model {name}={v!r} must be a whole number >= 1")
    for name in _MODEL_POSITIVE_FLOATS:
        v = getattr(model, name)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
            out.append(f"model {name}={v!r} must be a positive number")
    for name in _MODEL_FLAGS:
        if not isinstance(getattr(model, name), bool):
            out.append(f"model {name}={getattr(model, name)!r} must be true or false")
    if model.rope_scaling is not None and not isinstance(model.rope_scaling, dict):
        out.append(f"model rope_scaling={model.rope_scaling!r} must be a mapping or null")
    if not isinstance(model.extra, dict):
        out.append(f"model extra={model.extra!r} must be a mapping")
    return out


def layout_of(exp: Experiment) -> Layout:
    p = exp.parallel
    return Layout(p.tp, p.pp, p.cp, p.ep, p.etp, p.vpp, p.sequence_parallel)


def world_size(profile: ClusterProfile, nodes: int) -> int:
    per_node = profile.gpus_per_node if profile.gpus_per_node > 0 else (profile.tasks_per_node or 1)
    return nodes * per_node


def layout_problems(model: ModelSpec, lay: Layout, world: int) -> list[str]:
    """Every rule the layout breaks, each naming the values and a fix (empty when the layout is valid)."""
    out: list[str] = []
    mp = lay.tp * lay.pp * lay.cp
    if world % mp:
        out.append(
            f"TP*PP*CP = {lay.tp}*{lay.pp}*{lay.cp} = {mp} does not divide the world size {world} "
            f"(nodes x GPUs per node); choose sizes whose product divides {world}, or change the node count"
        )
    if model.num_attention_heads % lay.tp:
        out.append(f"TP={lay.tp} does not divide num_attention_heads={model.num_attention_heads}; use a TP from {_divisors(model.num_attention_heads, 16)}")
    if model.num_query_groups % lay.tp:
        out.append(
            f"TP={lay.tp} does not divide num_query_groups={model.num_query_groups} (KV heads), which Megatron-Core "
            f"requires; use a TP from {_divisors(model.num_query_groups, 16)}"
        )
    if model.num_layers % lay.pp:
        out.append(f"PP={lay.pp} does not divide num_layers={model.num_layers}; use a PP from {_divisors(model.num_layers, 64)}")
    if lay.vpp is not None:
        if lay.pp < 2:
            out.append(f"VPP={lay.vpp} (interleaved schedule) needs PP >= 2; set parallel.vpp=null or raise parallel.pp")
        elif model.num_layers % (lay.pp * lay.vpp):
            out.append(f"PP*VPP = {lay.pp * lay.vpp} does not divide num_layers={model.num_layers}; each virtual stage needs whole layers")
    if lay.sequence_parallel and lay.tp == 1:
        out.append("sequence_parallel needs TP > 1; set parallel.sequence_parallel=false or raise parallel.tp")
    if model.is_moe:
        if model.num_experts % lay.ep:
            out.append(f"num_experts={model.num_experts} is not divisible by EP={lay.ep}; use an EP from {_divisors(model.num_experts, 256)}")
        if world % (lay.pp * lay.ep * lay.etp):
            out.append(
                f"PP*EP*ETP = {lay.pp}*{lay.ep}*{lay.etp} does not divide the world size {world} (Megatron forms expert "
                f"groups as PP x ETP x EP x expert-DP); lower EP or ETP"
            )
        if lay.etp > 1 and lay.etp != lay.tp and model.moe_ffn_hidden_size and model.moe_ffn_hidden_size % lay.etp:
            out.append(f"ETP={lay.etp} does not divide the expert FFN size {model.moe_ffn_hidden_size}")
    else:
        if lay.ep > 1 or lay.etp > 1:
            out.append(f"EP={lay.ep} / ETP={lay.etp} set for a dense model (no experts); set parallel.ep=1 parallel.etp=1")
    return out


def experiment_problems(exp: Experiment, profile: ClusterProfile, model: ModelSpec) -> list[str]:
    world = world_size(profile, exp.resources.nodes)
    lay = layout_of(exp)
    out = layout_problems(model, lay, world)
    if not out:
        dp = lay.dp(world)
        s = exp.schedule
        if s.global_batch_size % (s.micro_batch_size * dp):
            out.append(
                f"global_batch_size={s.global_batch_size} is not divisible by micro_batch_size*DP = {s.micro_batch_size}*{dp} "
                f"= {s.micro_batch_size * dp}; use a multiple of {s.micro_batch_size * dp}"
            )
    if lay.cp > 1 and exp.data.seq_length % (2 * lay.cp):
        out.append(f"seq_length={exp.data.seq_length} must be divisible by 2*CP = {2 * lay.cp} (load-balanced context parallel)")
    if exp.data.seq_length > model.max_position_embeddings and not model.rope_scaling:
        out.append(f"seq_length={exp.data.seq_length} exceeds the model's max_position_embeddings={model.max_position_embeddings}")
    if exp.precision.fp8 and not profile.transformer_engine:
        out.append(
            f"precision.fp8={exp.precision.fp8} needs Transformer Engine on the nodes, and profile {profile.name!r} says "
            f"transformer_engine: false; drop precision.fp8 or use a profile whose nodes have TE"
        )
    if exp.precision.fp8 and profile.gpus_per_node == 0:
        out.append("precision.fp8 needs GPUs; this profile is CPU-only")
    if exp.precision.fp8_params and not exp.precision.fp8:
        out.append("precision.fp8_params needs precision.fp8 set")
    if exp.schedule.warmup_iters >= exp.schedule.train_iters:
        out.append(f"schedule.warmup_iters={exp.schedule.warmup_iters} must be below train_iters={exp.schedule.train_iters}")
    if exp.data.packing and exp.data.dynamic_batching:
        out.append("data.packing and data.dynamic_batching are mutually exclusive; choose one")
    d = exp.data
    if d.packing and d.kind != "sft":
        out.append(f"data.packing applies to SFT data (data.kind=sft), not data.kind={d.kind}")
    if d.packing and exp.schedule.micro_batch_size != 1:
        out.append("data.packing puts several examples into one sequence: set schedule.micro_batch_size=1 "
                   "(raise data.seq_length to put more tokens in a micro-batch)")
    if d.packing and (not profile.transformer_engine or exp.model.backend == "local"):
        out.append("data.packing needs Transformer Engine's attention (packed sequences): a profile with "
                   "transformer_engine: true and model.backend auto or te")
    if exp.precision.fp8 and exp.model.backend == "local":
        out.append("precision.fp8 needs Transformer Engine layers; set model.backend=auto or te")
    out += context_parallel_problems(exp, nodes_use_te(exp, profile))
    if d.packing and lay.cp > 1:
        out.append("data.packing with parallel.cp > 1 is not built (examples would need padding to 2*CP); use cp=1")
    if d.weights is not None and len(d.weights) != len(d.paths):
        out.append(f"data.weights has {len(d.weights)} entries for {len(d.paths)} data.paths; give one weight per path")
    if d.kind != "mock" and not d.paths:
        out.append(f"data.kind={d.kind} needs data.paths")
    out += validation_problems(exp)
    if exp.precision.loss_scale is not None and exp.precision.dtype != "fp16":
        out.append("precision.loss_scale applies to fp16 only; remove it or set precision.dtype=fp16")
    if exp.moe.a2a_overlap and lay.ep == 1:
        out.append("moe.a2a_overlap overlaps the expert-parallel all-to-all, so it needs parallel.ep > 1")
    out += expert_gemm_problems(exp, nodes_use_te(exp, profile))
    if exp.moe.pad_to_capacity and exp.moe.capacity_factor is None:
        out.append("moe.pad_to_capacity pads each expert to its capacity, so it needs moe.capacity_factor (e.g. 1.0)")
    if exp.recompute.offload_layers and not profile.transformer_engine:
        out.append("recompute.offload_layers needs Transformer Engine on the nodes")
    if exp.optimizer.tp_comm_overlap and not (lay.tp > 1 and lay.sequence_parallel):
        out.append("optimizer.tp_comm_overlap needs TP > 1 with parallel.sequence_parallel=true")
    if exp.optimizer.overlap_param_gather and not exp.optimizer.distributed:
        out.append("optimizer.overlap_param_gather needs optimizer.distributed=true")
    if exp.recompute.granularity == "full" and exp.recompute.num_layers > model.num_layers // lay.pp:
        out.append(f"recompute.num_layers={exp.recompute.num_layers} exceeds the {model.num_layers // lay.pp} layers per pipeline stage")
    limit_s = _time_seconds(exp.resources.time or profile.time_limit)
    if limit_s <= profile.signal_seconds + 60:
        out.append(
            f"time limit {limit_s}s leaves no room before the pre-timeout signal ({profile.signal_seconds}s lead; Slurm may "
            f"send it up to 60 s early); raise resources.time above {profile.signal_seconds + 60}s"
        )
    return out


def _time_seconds(value: str) -> int:
    from mcorekit.launch.config import parse_time_minutes

    return parse_time_minutes(value) * 60


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


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


# ---------------------------------------------------------------- the whole check, and plans


def _listed(what: str, problems: list[str]) -> str:
    """One problem on one line; several as a list, one per line."""
    if len(problems) == 1:
        return f"{what}: {problems[0]}"
    return f"{what} ({len(problems)} problems):\n  - " + "\n  - ".join(problems)


def check(exp: Experiment, profile: ClusterProfile) -> tuple[ModelSpec, list[str]]:
    """Raise LayoutError listing every violation; return the model and warnings (e.g. memory) otherwise."""
    model = resolve_model(exp.model.preset, exp.model.hf_config, exp.model.overrides)
    if bad := model_problems(model):
        raise ModelError(_listed("invalid model", bad))
    problems = experiment_problems(exp, profile, model)
    if not problems and profile.gpus_per_node > 0:  # then Megatron-Core's own checks, as the nodes will run them
        from mcorekit.train.megatron_args import megatron_problems

        problems = megatron_problems(exp, model, use_te=nodes_use_te(exp, profile))
    if problems:
        raise LayoutError(_listed("invalid layout", problems))
    warnings: list[str] = []
    if profile.gpus_per_node > 0:
        mem = estimate_memory(model, layout_of(exp), world_size(profile, exp.resources.nodes), exp.data.seq_length,
                              exp.schedule.micro_batch_size, exp.recompute.granularity, exp.optimizer.distributed,
                              fp8=exp.precision.fp8_params)
        if mem.total > profile.gpu_memory_gb * GiB * 0.95:
            warnings.append(
                f"estimated memory {mem.describe()} is above 95% of the {profile.gpu_memory_gb:.0f} GiB GPUs: raise TP/PP, lower "
                f"micro_batch_size, or set recompute.granularity=selective/full (`mcorekit launch plan` proposes layouts)"
            )
    return model, warnings


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
