"""Everything the loop needs, built from an experiment: process groups, model (DDP-wrapped, distributed
optimizer with overlapped communication), scheduler. Megatron-Core does the work; this maps our config onto it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcorekit.config import megatron as margs
from mcorekit.config.experiment import Experiment, layout_of
from mcorekit.config.rules import Nodes, listed, model_of, problems, use_full_graph, use_torch_expert_gemm, uses_te
from mcorekit.errors import LayoutError
from mcorekit.models.megatron import DTYPES, build_gpt, padded_vocab_size
from mcorekit.models.spec import ModelSpec
from mcorekit.runtime.env import DistEnv, from_environ, init_process_group
from mcorekit.runtime.ranks import collective_device
from mcorekit.train import checkpoint
from mcorekit.train.fsdp import wrap_chunk
from mcorekit.train.lora import apply_lora, is_lora
from mcorekit.train.metrics import startup
from mcorekit.train.step_graph import StepGraph, forward_backward, use_capture_stream


@dataclass
class Trainer:
    exp: Experiment
    spec: ModelSpec
    env: DistEnv
    model: list[Any]  # one DDP-wrapped chunk per virtual pipeline stage (one without interleaving)
    optimizer: Any
    scheduler: Any
    padded_vocab: int
    dp_size: int
    dp_rank: int
    weights_from: Any = None  # parallel.fsdp: the checkpoint whose weights went into the model before wrapping
    forward_backward: Any = None  # Megatron-Core's schedule, or train/step_graph.StepGraph around it

    @property
    def full_graph(self) -> bool:
        """Each training step runs as one CUDA graph (schedule.cuda_graph)."""
        return isinstance(self.forward_backward, StepGraph)


def init_distributed(exp: Experiment, graph_safe_rng: bool = False) -> DistEnv:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    env = init_process_group("nccl")
    torch.cuda.set_device(env.local_rank)
    p = exp.parallel
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp, virtual_pipeline_model_parallel_size=p.vpp,
        context_parallel_size=p.cp, expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp)
    # One seed per pipeline stage, as Megatron-LM does: otherwise every stage draws its initial weights from the
    # same random stream. TP/EP ranks get their own offsets inside model_parallel_cuda_manual_seed.
    seed = exp.data.seed + 100 * ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    # a step captured as a CUDA graph replays the random streams it draws from: they must be generators the graph
    # can register (same seeds, same streams)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=graph_safe_rng)
    connect_step_end_groups(p.pp)
    return env


def connect_step_end_groups(pp: int) -> None:
    """One tiny all-reduce on each group a training step's end reduces over, so that NCCL creates their
    communicators now, while the GPU is empty: the loop's metrics (loop._mean_metrics: data-parallel; pipeline with
    pp > 1), DDP's gradient reduction (data-parallel with context parallel) and the optimizer's gradient norm
    (model-parallel). NCCL allocates GPU memory of its own (outside torch's cache) at a group's first collective;
    left to the end of step 1, that is the fullest moment of a run continuing from a checkpoint (its optimizer state
    loaded, torch's cache at the step's peak): a 3B run on one 80 GB H100 failed there, NCCL unable to allocate 4
    bytes in the metrics' all-reduce (2026-12-05, docs/gpu-runs.md). Every rank makes the same calls in the same
    order."""
    from megatron.core import parallel_state as ps

    groups = [ps.get_data_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True),
              ps.get_model_parallel_group()] + ([ps.get_pipeline_model_parallel_group()] if pp > 1 else [])
    for group in dict.fromkeys(groups):  # a group named twice once
        torch.distributed.all_reduce(torch.zeros(1, device=collective_device()), group=group)


def seed_step(t: Trainer, step: int) -> None:
    """The random streams of the step after `step` seeded from data.seed, the pipeline stage and the step, where a
    step draws random numbers (LoRA's dropout; the model's own dropout is 0): a resumed run then draws the masks the
    run that was not interrupted drew, where checkpoints hold no RNG state. Never under a step graph, whose replays
    keep the generators they registered (the rules keep LoRA out of it: this says so again)."""
    exp = t.exp
    if exp.peft.lora is None or exp.peft.lora.dropout == 0 or t.full_graph:
        return
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # far from the start's seeds (data.seed + 100 per stage), and a stream of its own for every step and stage
    model_parallel_cuda_manual_seed(exp.data.seed + 100 * ps.get_pipeline_model_parallel_rank()
                                    + 1_000_003 * (step + 1))


def check(exp: Experiment, spec: ModelSpec, world: int, nodes: Nodes) -> None:
    """The rules the launcher checked before queueing, against the ranks actually started and what this node has
    (a torchrun start skips the launcher; a profile can be wrong), before any process group exists."""
    if bad := problems(exp, world, nodes, spec):
        raise LayoutError(listed(f"cannot train on {world} ranks", bad))


def build(exp: Experiment, checkpoints: Any = None) -> Trainer:
    """`checkpoints`: the run's checkpoint folder (parallel.fsdp loads weights before wrapping: see checkpoint.py)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    spec = model_of(exp)
    ranks = from_environ()
    nodes = Nodes.here(ranks.local_rank)
    check(exp, spec, ranks.world_size, nodes)
    use_te = uses_te(exp, nodes)
    full_graph = use_full_graph(exp, spec, use_te, nodes.gpus, layout_of(exp).dp(ranks.world_size), nodes.capability)
    startup.mark("checks")  # Megatron-Core's and TE's imports happen here: the rules build Megatron-Core's configs
    env = init_distributed(exp, graph_safe_rng=full_graph)
    exp = checkpoint.pinned_sources(exp, checkpoints)  # before anything reads checkpoint.load or peft.lora.load
    if full_graph:
        use_capture_stream()
    startup.mark("dist_init")
    config = margs.transformer_config(exp, spec, use_te, full_graph=full_graph)
    if config.tp_comm_overlap:
        _init_tp_comm_overlap(exp, spec)
    padded_vocab = padded_vocab_size(spec.vocab_size, 128 * exp.parallel.tp)
    ddp_config = margs.ddp_config(exp, full_graph)
    torch_expert_gemm = use_torch_expert_gemm(exp, use_te, nodes.capability)
    weights_from = _weights_before_wrap(exp, ddp_config, checkpoints)
    chunks = []
    for vp in range(exp.parallel.vpp or 1):
        vp_stage = vp if exp.parallel.vpp else None
        chunk = build_gpt(spec, config, padded_vocab, use_te=use_te, grouped_gemm=config.moe_grouped_gemm,
                          pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                          post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                          vp_stage=vp_stage, torch_expert_gemm=torch_expert_gemm).cuda()
        if is_lora(exp):  # before the wrappers: DDP and the optimizer then see only the adapters as trainable
            _add_lora(exp, spec, chunk)
        if config.params_dtype != torch.float32:
            chunk = Float16Module(config, chunk)
        if weights_from is not None:  # Megatron-FSDP copies the whole weights into its buffers when it wraps
            _load_before_wrap(weights_from, chunk)
        chunks.append(wrap_chunk(config, ddp_config, chunk, first=vp == 0))  # DDP, or Megatron-FSDP (parallel.fsdp)
    # The schedule calls these: grad sync hooks of the overlapped DDP and the loss scale of the optimizer.
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_config.overlap_param_gather:
        config.param_sync_func = [c.start_param_sync for c in chunks] if len(chunks) > 1 else chunks[0].start_param_sync
    startup.mark("model")
    if is_lora(exp):
        _load_lora_start(exp, chunks)
    optimizer = get_megatron_optimizer(margs.optimizer_config(exp, full_graph), chunks)
    config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(optimizer, **margs.scheduler_kwargs(exp))
    startup.mark("optimizer")
    return Trainer(exp, spec, env, chunks, optimizer, scheduler, padded_vocab,
                   ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), weights_from,
                   forward_backward(full_graph))


def mtp_weights_check(path: Any, spec: ModelSpec) -> str | None:
    """A checkpoint's multi-token-prediction weights (mtp.layers.*) against the model's MTP block, before
    Megatron-Core loads it: a run with model.overrides.mtp_layers needs them (ConfigError); a run without loads the
    rest and leaves them unused (the line returned says so, for the log)."""
    from mcorekit.errors import ConfigError
    from mcorekit.train.checkpoint import TORCH_DIST, format_of
    from mcorekit.train.checkpoint_reader import checked_metadata

    if format_of(Path(path)) != TORCH_DIST:
        return None
    keys = checked_metadata(Path(path)).state_dict_metadata
    held = len({k.split(".")[2] for k in keys if k.startswith("mtp.layers.")})
    if held < spec.mtp_layers:
        raise ConfigError(f"{path} holds {held} multi-token-prediction layer(s) (mtp.layers.*), but "
                          f"model.overrides.mtp_layers={spec.mtp_layers}: convert the DeepSeek-V3 checkpoint with its "
                          f"MTP layer(s) (model.layers.<num_hidden_layers>.*, which transformers does not save), or set "
                          f"mtp_layers to {held}")
    if held > spec.mtp_layers:
        return (f"{path} holds {held} multi-token-prediction layer(s) (mtp.layers.*) that this run does not build "
                f"(model.overrides.mtp_layers={spec.mtp_layers}): the rest of the model is loaded, they stay unused")
    return None


def _weights_before_wrap(exp: Experiment, ddp_config: Any, checkpoints: Any) -> Any:
    if not ddp_config.use_megatron_fsdp:
        return None
    from pathlib import Path

    return checkpoint.weights_before_wrap(exp, Path(checkpoints) if checkpoints is not None else None)


def _load_before_wrap(path: Any, chunk: Any) -> None:
    import logging

    checkpoint.load_weights(path, [chunk])
    logging.getLogger("mcorekit.train").warning("weights from %s loaded before Megatron-FSDP wraps the model", path)


def _add_lora(exp: Experiment, spec: ModelSpec, chunk: Any) -> None:
    """Freeze the chunk and add the adapters (train/lora.py); what checkpoint.py writes beside a LoRA checkpoint."""
    apply_lora(chunk, exp.peft.lora, spec, seed=exp.data.seed)
    chunk.mcorekit_lora = lora_info(exp, spec)


def lora_info(exp: Experiment, spec: ModelSpec) -> dict[str, Any]:
    """What a LoRA checkpoint's lora.json says: the adapters' settings, the model, and the base they were trained on
    (absolute: a merge reads it from wherever it runs)."""
    lora, base = exp.peft.lora, exp.checkpoint.load
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": list(lora.target_modules), "experts": lora.experts,
            "base": str(Path(base).absolute()) if base else None, "model": spec.to_dict()}


def _load_lora_start(exp: Experiment, chunks: list[Any]) -> None:
    """The frozen base from checkpoint.load (every start: a LoRA checkpoint holds only the adapters), then the
    adapters from peft.lora.load if given (a converted PEFT adapter); a resume then loads the run's own adapters."""
    from pathlib import Path

    from mcorekit.train.lora import adapter_start

    base = Path(exp.checkpoint.load)
    start = checkpoint.start_of(base)
    if start.name != checkpoint.RELEASE and not exp.checkpoint.finetune:
        raise LayoutError(f"peft.lora adapts the model in checkpoint.load={base}, a training checkpoint: set "
                          f"checkpoint.finetune=true to take its weights as the base (or use a converted release)")
    adapters = adapter_start(exp.peft.lora) if exp.peft.lora.load else None  # checked before the base is read
    checkpoint.load_base(start, chunks)
    if adapters is not None:
        checkpoint.load_adapters(adapters, chunks)


def _init_tp_comm_overlap(exp: Experiment, spec: ModelSpec) -> None:
    """TE's userbuffers for overlapping TP all-gather/reduce-scatter with the GEMMs (TP > 1 with SP)."""
    from transformer_engine.pytorch.module.base import initialize_ub

    tokens = exp.data.seq_length * exp.schedule.micro_batch_size // exp.parallel.cp
    initialize_ub(shape=[tokens, spec.hidden_size], tp_size=exp.parallel.tp, use_fp8=exp.precision.fp8 is not None,
                  dtype=DTYPES[exp.precision.dtype])
