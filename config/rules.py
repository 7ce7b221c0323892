"""Every rule an experiment must follow, in one place: `problems(exp, world, nodes)` lists each one it breaks on
`world` ranks, each naming the values and a fix.

The launcher calls it before queueing, with what the cluster profile says about the nodes (`Nodes.of`); every
rank calls it again at start with what its node has (`Nodes.here`), since a torchrun start skips the launcher and
a profile can be wrong. So a config the launcher accepts is one training accepts, and no rule is written twice.
The rules are Megatron-Core's (parallel_state.initialize_model_parallel; TransformerConfig's own checks run last,
through config/megatron.py) and this toolchain's (what train/ builds, what Slurm's requeue needs).
"""

from __future__ import annotations

from dataclasses import dataclass

from mcorekit.config.cluster import ClusterProfile
from mcorekit.config.experiment import Experiment, layout_of
from mcorekit.config.model import resolve_model
from mcorekit.config.values import parse_time_minutes
from mcorekit.errors import LISTED, ModelError
from mcorekit.models.fp8_grouped_mm import FP8_RECIPES, GPUS as FP8_GROUPED_GEMM_GPUS, alignment_problem
from mcorekit.models.parallel import MEGATRON, Layout
from mcorekit.models.parallel import layout_problems as weight_split_problems
from mcorekit.models.spec import ModelSpec
from mcorekit.models.spec_checks import model_problems


@dataclass(frozen=True)
class Nodes:
    """What the rules need to know about the machines the ranks run on."""

    transformer_engine: bool  # importable there
    gpus: bool  # CUDA GPUs (the dev cluster's profile has none)
    where: str = "this node"  # the machines, as messages name them
    without_te: str = "Transformer Engine is not importable on this node (pip install mcorekit[gpu])"
    capability: tuple[int, int] | None = None  # the GPU's compute capability: known on the node itself
    time_limit: str | None = None  # the job's default time limit and the lead of Slurm's pre-timeout signal:
    signal_seconds: int | None = None  # known before queueing, from the profile
    wandb: bool | None = None  # the wandb package importable there (None: not known before queueing)

    @classmethod
    def of(cls, profile: ClusterProfile) -> Nodes:
        """Before queueing: what the profile says its nodes have."""
        return cls(profile.transformer_engine, profile.gpus_per_node > 0, f"profile {profile.name!r}",
                   f"profile {profile.name!r} says transformer_engine: false (use a profile whose nodes have it)",
                   time_limit=profile.time_limit, signal_seconds=profile.signal_seconds,
                   # the nodes run this very interpreter unless the profile names theirs
                   wandb=_importable("wandb") if profile.python is None else None)

    @classmethod
    def here(cls, device: int = 0) -> Nodes:
        """On a rank: whether Transformer Engine imports, and the compute capability of its GPU `device`."""
        import torch

        from mcorekit.models.megatron import te_available

        gpus = torch.cuda.is_available()
        return cls(te_available(), gpus, capability=torch.cuda.get_device_capability(device) if gpus else None,
                   wandb=_importable("wandb"))


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def uses_te(exp: Experiment, nodes: Nodes) -> bool:
    """Whether the model runs on Transformer Engine layers there (model.backend auto takes TE where it imports)."""
    return nodes.transformer_engine and exp.model.backend != "local"


def model_of(exp: Experiment) -> ModelSpec:
    """The experiment's model; a ModelError when it cannot be read or a field is unsound (nothing else is checkable)."""
    model = resolve_model(exp.model.preset, exp.model.hf_config, exp.model.overrides)
    if bad := model_problems(model):
        raise ModelError(listed("invalid model", bad))
    return model


def listed(what: str, problems: list[str]) -> str:
    """One problem on one line; several as a list, one per line."""
    if len(problems) == 1:
        return f"{what}: {problems[0]}"
    return f"{what} ({len(problems)} problems):{LISTED}" + LISTED.join(problems)


def problems(exp: Experiment, world: int, nodes: Nodes, model: ModelSpec | None = None) -> list[str]:
    """Every rule `exp` breaks on `world` ranks of `nodes` (empty when it can run). `model` is the experiment's
    model when the caller has it already (model_of(exp) otherwise); an unreadable model raises ModelError."""
    model = model or model_of(exp)
    lay = layout_of(exp)
    te = uses_te(exp, nodes)
    out = layout_problems(model, lay, world)
    dp = None if out else lay.dp(world)
    out += schedule_problems(exp, dp)
    out += sequence_problems(exp, model, lay)
    out += precision_problems(exp, nodes)
    out += transformer_engine_problems(exp, nodes)
    out += data_problems(exp, lay)
    out += dpo_problems(exp)
    out += grpo_problems(exp, lay, world)
    out += context_parallel_problems(exp, te)
    out += moe_problems(exp, lay, te, model, nodes.capability)
    out += memory_option_problems(exp, model, lay)
    out += fsdp_problems(exp, lay)
    out += time_limit_problems(exp, nodes)
    out += lora_problems(exp)
    out += mtp_problems(exp, model)
    out += logging_problems(exp, nodes)
    out += cuda_graph_problems(exp, model, te, nodes, dp)
    if not out and nodes.gpus:  # then Megatron-Core's own checks, as the ranks will run them
        from mcorekit.config.megatron import megatron_problems

        out = megatron_problems(exp, model, use_te=te)
    return out


def logging_problems(exp: Experiment, nodes: Nodes) -> list[str]:
    """logging.wandb needs the wandb package where rank 0 runs (checked before training starts)."""
    w = exp.logging.wandb
    if w is not None and w.mode != "disabled" and nodes.wandb is False:
        return [f"logging.wandb: the wandb package is not importable on {nodes.where}: pip install 'mcorekit[wandb]' "
                f"there, or set logging.wandb.mode=disabled"]
    return []


def mtp_problems(exp: Experiment, model: ModelSpec) -> list[str]:
    """Megatron-Core's multi-token-prediction block (model.overrides.mtp_layers): for models that have MTP layers
    (DeepSeek-V3, whose checkpoints carry them and convert back with them), trained by the next-token tasks."""
    if not model.mtp_layers:
        return []
    if "nextn_predict_layers" not in model.extra:
        return [f"model.overrides.mtp_layers={model.mtp_layers}: multi-token prediction is built for DeepSeek-V3 models "
                f"only (model.hf_config of model_type deepseek_v3), not for a {model.architecture} model; set it to 0"]
    if exp.data.kind in ("dpo", "grpo"):
        return [f"model.overrides.mtp_layers={model.mtp_layers} with data.kind={exp.data.kind}: the MTP loss is a "
                f"next-token loss for pretraining and SFT data; set mtp_layers to 0"]
    return []


def lora_problems(exp: Experiment) -> list[str]:
    """What LoRA (peft.lora, train/lora.py) does not combine with."""
    lora = exp.peft.lora
    if lora is None:
        return []
    out = []
    if not exp.checkpoint.load:
        out.append("peft.lora adapts a trained model: set checkpoint.load to its checkpoint (e.g. `mcorekit convert "
                   "hf-to-mcore HF_DIR OUT`), or drop peft.lora to train all weights")
    if lora.experts:
        out.append("peft.lora.experts: LoRA on the routed MoE experts is not built; set it false (attention, dense and "
                   "shared-expert MLP layers are adapted)")
    if exp.precision.fp8_params:
        out.append("peft.lora with precision.fp8_params: the frozen base would be FP8 weights the adapters are added "
                   "beside, which is not built; keep precision.fp8 with bf16 weights (fp8_params=false)")
    if exp.optimizer.tp_comm_overlap:
        out.append("peft.lora with optimizer.tp_comm_overlap: the adapters' own TP communication is not overlapped "
                   "with TE's userbuffers and the combination is untested; set optimizer.tp_comm_overlap=false")
    if exp.parallel.fsdp is not None:
        out.append(f"peft.lora with parallel.fsdp={exp.parallel.fsdp}: the adapters are a small fraction of the "
                   f"weights (nothing to shard) and the combination is not built; drop parallel.fsdp")
    return out


def layout_problems(model: ModelSpec, lay: Layout, world: int) -> list[str]:
    """Every rule the parallel layout breaks for this model on `world` ranks: whether it splits the model's weights
    (models.parallel.layout_problems, the check convert/ uses too), and whether Megatron-Core can place its groups
    on the ranks (parallel_state.initialize_model_parallel)."""
    out: list[str] = []
    mp = lay.tp * lay.pp * lay.cp
    if world % mp:
        out.append(
            f"TP*PP*CP = {lay.tp}*{lay.pp}*{lay.cp} = {mp} does not divide the world size {world} "
            f"(nodes x GPUs per node); choose sizes whose product divides {world}, or change the node count"
        )
    if model.is_moe and world % (lay.pp * lay.ep * lay.etp):
        out.append(
            f"PP*EP*ETP = {lay.pp}*{lay.ep}*{lay.etp} does not divide the world size {world} (Megatron forms expert "
            f"groups as PP x ETP x EP x expert-DP); lower EP or ETP"
        )
    out += weight_split_problems(model, lay, MEGATRON)
    if lay.sequence_parallel and lay.tp == 1:
        out.append("sequence_parallel needs TP > 1; set parallel.sequence_parallel=false or raise parallel.tp")
    return out


def schedule_problems(exp: Experiment, dp: int | None) -> list[str]:
    """`dp` (the data-parallel size) is None while the layout itself is broken."""
    s = exp.schedule
    out = []
    if dp is not None and s.global_batch_size % (s.micro_batch_size * dp):
        out.append(
            f"global_batch_size={s.global_batch_size} is not divisible by micro_batch_size*DP = {s.micro_batch_size}*{dp} "
            f"= {s.micro_batch_size * dp}; use a multiple of {s.micro_batch_size * dp}"
        )
    if s.warmup_iters >= s.train_iters:
        out.append(f"schedule.warmup_iters={s.warmup_iters} must be below train_iters={s.train_iters}")
    return out


def sequence_problems(exp: Experiment, model: ModelSpec, lay: Layout) -> list[str]:
    seq = exp.data.seq_length
    out = []
    if lay.cp > 1 and seq % (2 * lay.cp):
        out.append(f"seq_length={seq} must be divisible by 2*CP = {2 * lay.cp} (load-balanced context parallel)")
    if seq > model.max_position_embeddings and not model.rope_scaling:
        out.append(f"seq_length={seq} exceeds the model's max_position_embeddings={model.max_position_embeddings}")
    return out


def precision_problems(exp: Experiment, nodes: Nodes) -> list[str]:
    p = exp.precision
    out = []
    if p.fp8 and not nodes.gpus:
        out.append(f"precision.fp8 needs GPUs, and {nodes.where} has none")
    if p.fp8 and nodes.capability is not None:
        out += fp8_support_problems(p.fp8, nodes.capability)
    if p.fp8_params and not p.fp8:
        out.append("precision.fp8_params needs precision.fp8 set")
    if p.loss_scale is not None and p.dtype != "fp16":
        out.append("precision.loss_scale applies to fp16 only; remove it or set precision.dtype=fp16")
    return out


def fp8_support_problems(recipe: str, capability: tuple[int, int]) -> list[str]:
    """FP8 needs Ada/Hopper (sm89/sm90) or newer; MXFP8 needs Blackwell (sm100)."""
    need = (10, 0) if recipe == "mxfp8" else (8, 9)
    if capability >= need:
        return []
    gpu = "Blackwell (compute capability 10.0)" if recipe == "mxfp8" else "Ada/Hopper (8.9/9.0)"
    hint = "; on Hopper use delayed, tensorwise or blockwise" if recipe == "mxfp8" else ""
    return [f"precision.fp8={recipe} needs {gpu} or newer; this GPU is {capability[0]}.{capability[1]}{hint}"]


def transformer_engine_problems(exp: Experiment, nodes: Nodes) -> list[str]:
    """FP8, packed sequences and activation offloading exist only in Transformer Engine's layers."""
    needs = [what for what, on in ((f"precision.fp8={exp.precision.fp8}", exp.precision.fp8),
                                   ("data.packing", exp.data.packing),
                                   ("recompute.offload_layers", exp.recompute.offload_layers)) if on]
    if needs and exp.model.backend == "local":
        return [f"{_need(needs)} Transformer Engine layers; set model.backend=auto or te"]
    if exp.model.backend == "te":
        needs.insert(0, "model.backend=te")
    if needs and not nodes.transformer_engine:
        return [f"{_need(needs)} Transformer Engine, and {nodes.without_te}"]
    return []


def _need(what: list[str]) -> str:
    """['a'] -> 'a needs'; ['a', 'b', 'c'] -> 'a, b and c need'."""
    if len(what) == 1:
        return f"{what[0]} needs"
    return f"{', '.join(what[:-1])} and {what[-1]} need"


def context_parallel_problems(exp: Experiment, uses_te: bool) -> list[str]:
    """CP runs TE's context-parallel attention. Seen on an H200 with TE 2.20: fp32 with CP>1 finds "no dot product
    attention backend" (TE's fused kernels are 16-bit only, its unfused one has no CP); Megatron's local
    attention has no CP at all."""
    if exp.parallel.cp > 1 and (exp.precision.dtype == "fp32" or not uses_te):
        return ["parallel.cp > 1 runs Transformer Engine's context-parallel attention, which needs precision.dtype "
                "bf16 or fp16 and model.backend auto or te (on nodes with Transformer Engine)"]
    return []


def data_problems(exp: Experiment, lay: Layout) -> list[str]:
    d, s = exp.data, exp.schedule
    out = []
    if d.dynamic_batching:
        out.append("data.dynamic_batching is not built yet; use data.packing for variable-length SFT data")
    if d.packing and d.kind not in ("sft", "dpo"):
        out.append(f"data.packing applies to SFT and DPO data (data.kind=sft or dpo), not data.kind={d.kind}")
    if d.packing and s.micro_batch_size != 1:
        out.append("data.packing puts several examples into one sequence: set schedule.micro_batch_size=1 "
                   "(raise data.seq_length to put more tokens in a micro-batch)")
    if d.packing and lay.cp > 1:
        out.append("data.packing with parallel.cp > 1 is not built (examples would need padding to 2*CP); use cp=1")
    if d.weights is not None and len(d.weights) != len(d.paths):
        out.append(f"data.weights has {len(d.weights)} entries for {len(d.paths)} data.paths; give one weight per path")
    if d.kind != "mock" and not d.paths:
        out.append(f"data.kind={d.kind} needs data.paths")
    out += validation_problems(exp)
    return out


def dpo_problems(exp: Experiment) -> list[str]:
    """DPO (data.kind=dpo, train/tasks/dpo.py). Its batch sizes count preference pairs (the model sees 2 x
    micro_batch_size sequences), or packed rows of whole pairs with data.packing (micro_batch_size 1, as for SFT)."""
    d, o = exp.data, exp.optimizer
    if d.kind != "dpo":
        if exp.dpo != type(exp.dpo)():  # a dpo section other than the defaults (a resolved config.yaml holds them all)
            return [f"the dpo section applies to data.kind=dpo, not data.kind={d.kind}; remove it or set data.kind=dpo"]
        return []
    out = []
    if not d.tokenizer:
        out.append("data.kind=dpo needs data.tokenizer (an HF tokenizer directory; with a chat template for chat pairs)")
    if o.tp_comm_overlap and not d.packing:
        out.append("optimizer.tp_comm_overlap with data.kind=dpo: TE's userbuffers are sized for micro_batch_size "
                   "sequences and DPO runs 2 x micro_batch_size (a chosen and a rejected one per pair); drop "
                   "tp_comm_overlap or use data.packing")
    if exp.parallel.fsdp is not None:
        out.append(f"data.kind=dpo with parallel.fsdp={exp.parallel.fsdp} is not built (the reference model would be an "
                   f"unsharded copy beside the sharded policy); drop parallel.fsdp")
    return out


def grpo_problems(exp: Experiment, lay: Layout, world: int) -> list[str]:
    """GRPO (data.kind=grpo, train/tasks/grpo.py). A step generates group_size samples for each of prompts_per_step
    prompts (each data-parallel rank its share of whole groups, so a group's advantages are computed where it was
    generated) and trains on them in one optimizer step: the global batch is those sequences."""
    d, g, s = exp.data, exp.grpo, exp.schedule
    if d.kind != "grpo":
        if exp.grpo != type(exp.grpo)():  # a grpo section other than the defaults (a resolved config.yaml holds them all)
            return [f"the grpo section applies to data.kind=grpo, not data.kind={d.kind}; remove it or set data.kind=grpo"]
        return []
    out = []
    if not d.tokenizer:
        out.append("data.kind=grpo needs data.tokenizer (an HF tokenizer directory: prompts are tokenized and "
                   "completions decoded for the rewards)")
    if not g.rewards:
        out.append("data.kind=grpo needs at least one grpo.rewards entry (function: 'module:function', weight)")
    rollouts = g.prompts_per_step * g.group_size
    if s.global_batch_size != rollouts:
        out.append(f"schedule.global_batch_size={s.global_batch_size} must equal grpo.prompts_per_step x "
                   f"grpo.group_size = {g.prompts_per_step} x {g.group_size} = {rollouts} (one optimizer step per "
                   f"generation batch); set schedule.global_batch_size={rollouts}")
    mp = lay.tp * lay.pp * lay.cp
    if world % mp == 0 and g.prompts_per_step % (world // mp):
        out.append(f"grpo.prompts_per_step={g.prompts_per_step} is not divisible by the data-parallel size "
                   f"{world // mp}: each data-parallel rank generates whole groups; use a multiple of {world // mp}")
    if g.max_new_tokens >= d.seq_length:
        out.append(f"grpo.max_new_tokens={g.max_new_tokens} leaves no room for the prompt in data.seq_length="
                   f"{d.seq_length} (a rollout, prompt and completion, is one training sequence)")
    if lay.cp > 1:
        out.append("data.kind=grpo with parallel.cp > 1 is not built (generation runs whole sequences); use cp=1")
    if lay.vpp:
        out.append("data.kind=grpo with parallel.vpp is not built (generation steps one micro-batch through the "
                   "pipeline, which the interleaved schedule does not take); drop parallel.vpp")
    if s.eval_interval:
        out.append("data.kind=grpo has no validation loss (schedule.eval_interval); measure held-out accuracy with "
                   "examples/grpo/evaluate.py instead, or set schedule.eval_interval=0")
    if exp.optimizer.tp_comm_overlap:
        out.append("optimizer.tp_comm_overlap with data.kind=grpo: TE's userbuffers are sized for the training "
                   "shapes, generation runs other shapes; drop tp_comm_overlap")
    if exp.parallel.fsdp is not None:
        out.append(f"data.kind=grpo with parallel.fsdp={exp.parallel.fsdp} is not built (generation and the reference "
                   f"model need the whole weights of each layer); drop parallel.fsdp")
    return out


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


def use_torch_expert_gemm(exp: Experiment, uses_te: bool, capability: tuple[int, int] | None = None) -> bool:
    """Whether the MoE experts run as torch._grouped_mm (models/grouped_mm_experts.py): asked for, or by default
    (auto), where it applies: bf16, or FP8 with bf16 weights under the delayed or tensorwise recipe (the experts'
    GEMMs then run torch._scaled_grouped_mm, models/fp8_grouped_mm.py), TE's grouped experts, and neither the
    a2a-overlap schedule (which splits the experts' backward into TE's own steps) nor recompute of the expert
    activation (TEGroupedMLP's own). FP8 also needs a GPU the FP8 grouped GEMM runs on (`capability`, where known:
    9.0 or 10.0; Ada and other Blackwells keep TE's experts)."""
    p = exp.precision
    moe_act_recompute = exp.recompute.granularity == "selective" and "moe_act" in exp.recompute.modules
    fp8_ok = not p.fp8 or (per_tensor_fp8(exp) and (capability is None or tuple(capability) in FP8_GROUPED_GEMM_GPUS))
    return (exp.moe.expert_gemm != "te" and uses_te and exp.moe.grouped_gemm and p.dtype == "bf16" and fp8_ok
            and not exp.moe.a2a_overlap and not moe_act_recompute)


def per_tensor_fp8(exp: Experiment) -> bool:
    """precision.fp8 with a per-tensor scaled recipe (delayed, tensorwise) and bf16 weights: what the FP8 grouped
    experts and the step graph take."""
    return exp.precision.fp8 in FP8_RECIPES and not exp.precision.fp8_params


def expert_gemm_problems(exp: Experiment, uses_te: bool, model: ModelSpec | None = None,
                         capability: tuple[int, int] | None = None) -> list[str]:
    if exp.moe.expert_gemm != "torch":
        return []
    if not use_torch_expert_gemm(exp, uses_te, capability):
        return ["moe.expert_gemm=torch computes TE's grouped experts with torch._grouped_mm (bf16, or FP8 with the "
                "delayed or tensorwise recipe and bf16 weights on a GPU of compute capability 9.0 or 10.0); with "
                "precision.fp8=blockwise/mxfp8, precision.fp8_params, another dtype or GPU, moe.grouped_gemm=false, "
                "moe.a2a_overlap, recompute of moe_act or without TE use moe.expert_gemm=te or auto"]
    misaligned = fp8_expert_alignment(exp, model)
    return [f"moe.expert_gemm=torch with precision.fp8: {misaligned}; use moe.expert_gemm=auto or te"] \
        if misaligned else []


def fp8_expert_alignment(exp: Experiment, model: ModelSpec | None) -> str | None:
    """Under FP8, what keeps each rank's expert widths out of the FP8 grouped GEMM (the experts then run TE's):
    expert tensor parallelism splits the FFN, and the kernel sees the rank's part (models/grouped_mm_experts.py)."""
    if not exp.precision.fp8 or model is None or not model.is_moe:
        return None
    ffn, etp = model.moe_ffn_hidden_size or model.ffn_hidden_size, exp.parallel.etp
    if etp == 1 or ffn % etp:  # an FFN that ETP does not divide is refused by the layout check (models/parallel.py)
        return alignment_problem(model.hidden_size, ffn)
    problem = alignment_problem(model.hidden_size, ffn // etp)
    return f"{problem} (per rank: {ffn} / parallel.etp={etp})" if problem else None


def moe_problems(exp: Experiment, lay: Layout, uses_te: bool, model: ModelSpec | None = None,
                 capability: tuple[int, int] | None = None) -> list[str]:
    out = []
    own = model.moe_shared_expert_ffn_hidden_size if model is not None else None
    if own and exp.moe.shared_expert_ffn not in (None, own):  # the checkpoint must stay convertible to its HF family
        out.append(f"moe.shared_expert_ffn={exp.moe.shared_expert_ffn}: the {model.architecture} model has a shared "
                   f"expert of {own} from its HF config; leave moe.shared_expert_ffn unset or set it to {own}")
    if not own and exp.moe.shared_expert_ffn and exp.model.hf_config and model is not None:
        # an HF family without one: the checkpoint would hold tensors its HF format cannot, found only at conversion
        out.append(f"moe.shared_expert_ffn={exp.moe.shared_expert_ffn}: the {model.architecture} HF format has no shared "
                   f"expert, so a checkpoint trained with one would not convert back to model.hf_config's family; "
                   f"train a model whose HF config has one (Qwen2-MoE's shared_expert_intermediate_size, "
                   f"DeepSeek-V3's n_shared_experts) or leave moe.shared_expert_ffn unset")
    if exp.moe.a2a_overlap and lay.ep == 1:
        out.append("moe.a2a_overlap overlaps the expert-parallel all-to-all, so it needs parallel.ep > 1")
    out += expert_gemm_problems(exp, uses_te, model, capability)
    if exp.moe.pad_to_capacity and exp.moe.capacity_factor is None:
        out.append("moe.pad_to_capacity pads each expert to its capacity, so it needs moe.capacity_factor (e.g. 1.0)")
    if exp.moe.pad_to_capacity and (exp.moe.expert_bias or (model is not None and model.moe_router_expert_bias)):
        # Megatron-Core 0.19 (TopKRouter._apply_expert_bias) counts the map after padding for the bias update
        whose = "moe.expert_bias" if exp.moe.expert_bias else f"the {model.architecture} model's own expert bias"
        out.append(f"moe.pad_to_capacity with {whose}: Megatron-Core counts each expert's tokens for the bias update "
                   f"after the padding, so every expert counts its capacity and the bias never moves (no load "
                   f"balancing); leave moe.pad_to_capacity off (moe.capacity_factor drops tokens without it)")
    return out


def full_graph_blockers(exp: Experiment, model: ModelSpec, uses_te: bool, gpus: bool, dp: int | None,
                        capability: tuple[int, int] | None = None) -> list[str]:
    """What keeps a step from running as one CUDA graph (schedule.cuda_graph; empty: it applies). A captured step
    must have the same shapes every time and no host reads inside it; what is listed here either breaks that
    (packing, EP's token splits, TE's experts' host-side counts, token dropping) or has not been checked against
    the eager step (tests/test_gpu_train.py compares them), so it keeps the eager step rather than risk it."""
    lay, p, m = layout_of(exp), exp.precision, exp.moe
    checks = [
        ("GPUs with Transformer Engine", gpus and uses_te),
        ("one model replica per GPU (tp, pp, cp, ep = 1)", (lay.tp, lay.pp, lay.cp, lay.ep, lay.vpp) == (1, 1, 1, 1, None)),
        ("one data-parallel rank", dp == 1),
        ("precision.dtype=bf16, without precision.fp8 or with its delayed or tensorwise recipe and bf16 weights",
         p.dtype == "bf16" and (not p.fp8 or per_tensor_fp8(exp))),
        ("pretraining data (data.kind mock or indexed)", exp.data.kind in ("mock", "indexed")),
        ("no data.dynamic_batching", not exp.data.dynamic_batching),
        ("no peft.lora", exp.peft.lora is None),
        ("no recompute", exp.recompute.granularity == "none" and not exp.recompute.offload_layers),
        ("no parallel.fsdp", exp.parallel.fsdp is None),
        ("no multi-token prediction", not model.mtp_layers),
        ("no optimizer.tp_comm_overlap", not exp.optimizer.tp_comm_overlap),
        # with DDP's own NaN check off in the graph, the gradient norm that clipping computes is the check
        ("optimizer.clip_grad > 0 (its gradient norm is the step's NaN check)", exp.optimizer.clip_grad > 0),
        ("a Llama/Qwen/Mixtral-style model: no multi-latent attention, sliding window, attention sinks or biases on "
         "every linear", not (model.kv_lora_rank or model.sliding_window or model.attention_sinks or model.linear_bias)),
        ("SwiGLU MLPs (activation silu, no clamp)", model.activation == "silu" and model.glu_clamp is None),
    ]
    if model.is_moe:
        checks += [
            ("MoE: the torch._grouped_mm experts (moe.expert_gemm auto or torch)",
             use_torch_expert_gemm(exp, uses_te, capability) and fp8_expert_alignment(exp, model) is None),
            ("MoE: the alltoall dispatcher with fused permutation", m.dispatcher == "alltoall" and m.permute_fusion),
            ("MoE: no token dropping (moe.capacity_factor unset)", m.capacity_factor is None),
            ("MoE: no expert bias or shared expert (moe.expert_bias, moe.shared_expert_ffn, or the model's own)",
             not (m.expert_bias or model.moe_router_expert_bias or m.shared_expert_ffn
                  or model.moe_shared_expert_ffn_hidden_size)),
            ("MoE: no moe.router_fusion, moe.shared_expert_overlap or moe.a2a_overlap",
             not (m.router_fusion or m.shared_expert_overlap or m.a2a_overlap)),
        ]
    return [what for what, ok in checks if not ok]


def use_full_graph(exp: Experiment, model: ModelSpec, uses_te: bool, gpus: bool, dp: int | None,
                   capability: tuple[int, int] | None = None) -> bool:
    return exp.schedule.cuda_graph is not False and not full_graph_blockers(exp, model, uses_te, gpus, dp, capability)


def cuda_graph_problems(exp: Experiment, model: ModelSpec, uses_te: bool, nodes: Nodes, dp: int | None) -> list[str]:
    if exp.schedule.cuda_graph is not True:
        return []
    missing = full_graph_blockers(exp, model, uses_te, nodes.gpus, dp, nodes.capability)
    if not missing:
        return []
    return [f"schedule.cuda_graph=true captures each step as one CUDA graph, which needs {'; '.join(missing)}: change "
            f"those, or set schedule.cuda_graph=auto (the graph where it applies, the eager step elsewhere)"]


def memory_option_problems(exp: Experiment, model: ModelSpec, lay: Layout) -> list[str]:
    o, r = exp.optimizer, exp.recompute
    out = []
    if o.tp_comm_overlap and not (lay.tp > 1 and lay.sequence_parallel):
        out.append("optimizer.tp_comm_overlap needs TP > 1 with parallel.sequence_parallel=true")
    if o.overlap_param_gather and not o.distributed:
        out.append("optimizer.overlap_param_gather needs optimizer.distributed=true")
    if r.granularity == "full" and r.num_layers > model.num_layers // lay.pp:
        out.append(f"recompute.num_layers={r.num_layers} exceeds the {model.num_layers // lay.pp} layers per pipeline stage")
    return out


def fsdp_problems(exp: Experiment, lay: Layout) -> list[str]:
    """What Megatron-FSDP (parallel.fsdp, Megatron-Core 0.19) does not combine with. It shards over the
    data-parallel (x context-parallel) ranks inside one device mesh of DP x EP x TP ranks, through the distributed
    optimizer in its FSDP mode, and writes checkpoints only in its own fsdp_dtensor format (train/checkpoint.py: a
    run resumes its own checkpoints of either format; checkpoint.load gives weights only)."""
    f = exp.parallel.fsdp
    if f is None:
        return []
    o = exp.optimizer
    out = []
    if lay.pp > 1 or lay.vpp:
        out.append(f"parallel.fsdp={f} with pipeline parallelism (pp={lay.pp}, vpp={lay.vpp}): Megatron-FSDP lays "
                   f"its device mesh over DP x EP x TP ranks only; use pp=1 (shard over more data-parallel ranks, "
                   f"or add TP), or drop parallel.fsdp")
    if not o.distributed:
        out.append(f"parallel.fsdp={f} runs the distributed optimizer in its FSDP mode: set optimizer.distributed=true")
    if f != "optim" and not o.overlap_grad_reduce:
        out.append(f"parallel.fsdp={f} reduce-scatters the sharded gradients during the backward pass, always "
                   f"overlapped: set optimizer.overlap_grad_reduce=true (or use parallel.fsdp=optim)")
    if f == "optim_grads_params" and not o.overlap_param_gather:
        out.append("parallel.fsdp=optim_grads_params all-gathers each layer's weights ahead of its use, always "
                   "overlapped: set optimizer.overlap_param_gather=true")
    if o.tp_comm_overlap:
        out.append(f"parallel.fsdp={f} with optimizer.tp_comm_overlap: TE's TP overlap needs one CUDA hardware queue "
                   f"(CUDA_DEVICE_MAX_CONNECTIONS=1), Megatron-FSDP's overlapped collectives need several; drop one")
    if exp.precision.fp8_params:
        out.append(f"parallel.fsdp={f} with precision.fp8_params: FP8 weights in Megatron-FSDP's buffers are not "
                   f"wired here; keep precision.fp8 with bf16 weights (fp8_params=false)")
    if exp.checkpoint.load and not exp.checkpoint.finetune and not _is_release(exp.checkpoint.load):
        out.append(f"parallel.fsdp={f} with checkpoint.load: only its weights load into Megatron-FSDP (another run's "
                   f"optimizer state does not); set checkpoint.finetune=true (weights only, fresh optimizer, step 0)")
    if exp.checkpoint.async_save:
        out.append(f"parallel.fsdp={f} with checkpoint.async_save: Megatron-FSDP checkpoints are written "
                   f"synchronously; set checkpoint.async_save=false")
    return out


def _is_release(load: str) -> bool:
    """checkpoint.load names a converted `release` checkpoint (weights only anyway): the folder itself, or a root
    whose tracker (train/checkpoint.py's TRACKER) says release. Unknown where the path is not readable here."""
    from pathlib import Path

    path = Path(load)
    tracker = path / "latest_checkpointed_iteration.txt"
    try:
        return path.name == "release" or (tracker.is_file() and tracker.read_bytes()[:64].strip() == b"release")
    except OSError:
        return False


def time_limit_problems(exp: Experiment, nodes: Nodes) -> list[str]:
    limit = exp.resources.time or nodes.time_limit
    if limit is None or nodes.signal_seconds is None:
        return []
    problem = time_limit_problem(limit, nodes.signal_seconds)
    return [f"{problem}; raise resources.time above {nodes.signal_seconds + 60}s"] if problem else []


def time_limit_problem(limit: str | int, signal_seconds: int) -> str | None:
    """Slurm may send the pre-timeout signal up to 60 s early; the job must outlive it to save and requeue."""
    limit_s = parse_time_minutes(limit) * 60
    if limit_s <= signal_seconds + 60:
        return (f"time limit {limit_s}s leaves no room before the pre-timeout signal ({signal_seconds}s lead; Slurm "
                f"may send it up to 60 s early)")
    return None
