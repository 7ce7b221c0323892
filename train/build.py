"""Everything the loop needs, built from an experiment: process groups, model (DDP-wrapped, distributed
optimizer with overlapped communication), scheduler. Megatron-Core does the work; this maps our config onto it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcorekit.errors import ConfigError, NotBuiltError
from mcorekit.launch.config import Experiment
from mcorekit.launch.env import DistEnv, from_environ, init_process_group
from mcorekit.launch.layout import (context_parallel_problems, expert_gemm_problems, layout_of, layout_problems,
                                    use_torch_expert_gemm)
from mcorekit.models.megatron import DTYPES, build_gpt, padded_vocab_size, te_available
from mcorekit.models.spec import ModelSpec, resolve
from mcorekit.train import megatron_args as margs


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


def init_distributed(exp: Experiment) -> DistEnv:
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
    model_parallel_cuda_manual_seed(seed)
    return env


def refuse_unbuilt(exp: Experiment) -> None:
    """Options the schema accepts but this loop does not implement yet fail here instead of being ignored."""
    unbuilt = []
    if exp.data.dynamic_batching:
        unbuilt.append("data.dynamic_batching (use data.packing for variable-length SFT data)")
    if exp.data.packing and exp.parallel.cp > 1:
        unbuilt.append("data.packing with parallel.cp > 1 (documents would need padding to 2*CP)")
    if unbuilt:
        raise NotBuiltError("not built yet in train/: " + "; ".join(unbuilt))


def use_transformer_engine(exp: Experiment) -> bool:
    backend = exp.model.backend
    if backend == "auto":
        backend = "te" if te_available() else "local"
    needs = [what for what, on in (("precision.fp8", exp.precision.fp8), ("data.packing", exp.data.packing),
                                   ("recompute.offload_layers", exp.recompute.offload_layers)) if on]
    if backend == "local" and needs:
        raise ConfigError(f"{', '.join(needs)} need{'s' if len(needs) == 1 else ''} Transformer Engine, but the model "
                          f"uses the local backend (model.backend={exp.model.backend}); use model.backend=te")
    if backend == "te" and not te_available():
        raise ConfigError("model.backend=te but Transformer Engine is not importable on this node "
                          "(pip install mcorekit[gpu]); or set model.backend=local")
    return backend == "te"


def check_layout(exp: Experiment, spec: ModelSpec, world: int, use_te: bool) -> None:
    """The launcher's layout rules against the ranks actually started, before any process group exists."""
    problems = (layout_problems(spec, layout_of(exp), world) + context_parallel_problems(exp, use_te)
                + expert_gemm_problems(exp, use_te))
    if problems:
        raise ConfigError(f"the parallel layout does not fit {world} ranks:\n  " + "\n  ".join(problems))


def check_fp8_support(recipe: str | None, capability: tuple[int, int]) -> None:
    """FP8 needs Hopper (sm90) or newer; MXFP8 needs Blackwell (sm100). Fail before building anything."""
    if recipe is None:
        return
    need = (10, 0) if recipe == "mxfp8" else (8, 9)
    if capability < need:
        gpu = "Blackwell (compute capability 10.0)" if recipe == "mxfp8" else "Ada/Hopper (8.9/9.0)"
        hint = "; on Hopper use delayed, tensorwise or blockwise" if recipe == "mxfp8" else ""
        raise ConfigError(f"precision.fp8={recipe} needs {gpu} or newer; this GPU is "
                          f"{capability[0]}.{capability[1]}{hint}")


def build(exp: Experiment) -> Trainer:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    refuse_unbuilt(exp)
    spec = resolve(exp.model.preset, exp.model.hf_config, exp.model.overrides)
    use_te = use_transformer_engine(exp)
    check_layout(exp, spec, from_environ().world_size, use_te)  # the launcher's rules, also for torchrun starts
    env = init_distributed(exp)
    check_fp8_support(exp.precision.fp8, torch.cuda.get_device_capability())
    config = margs.transformer_config(exp, spec, use_te)
    if config.tp_comm_overlap:
        _init_tp_comm_overlap(exp, spec)
    padded_vocab = padded_vocab_size(spec.vocab_size, 128 * exp.parallel.tp)
    ddp_config = margs.ddp_config(exp)
    torch_expert_gemm = use_torch_expert_gemm(exp, use_te)
    chunks = []
    for vp in range(exp.parallel.vpp or 1):
        vp_stage = vp if exp.parallel.vpp else None
        chunk = build_gpt(spec, config, padded_vocab, use_te=use_te, grouped_gemm=config.moe_grouped_gemm,
                          pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                          post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                          vp_stage=vp_stage, torch_expert_gemm=torch_expert_gemm).cuda()
        if config.params_dtype != torch.float32:
            chunk = Float16Module(config, chunk)
        # Only the first chunk's buffers are bucketed for overlap (as Megatron-LM does): the others' grads are
        # ready only at the end of the interleaved schedule anyway.
        chunks.append(DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=vp > 0))
    # The schedule calls these: grad sync hooks of the overlapped DDP and the loss scale of the optimizer.
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_config.overlap_param_gather:
        config.param_sync_func = [c.start_param_sync for c in chunks] if len(chunks) > 1 else chunks[0].start_param_sync
    optimizer = get_megatron_optimizer(margs.optimizer_config(exp), chunks)
    config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(optimizer, **margs.scheduler_kwargs(exp))
    return Trainer(exp, spec, env, chunks, optimizer, scheduler, padded_vocab,
                   ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())


def _init_tp_comm_overlap(exp: Experiment, spec: ModelSpec) -> None:
    """TE's userbuffers for overlapping TP all-gather/reduce-scatter with the GEMMs (TP > 1 with SP)."""
    from transformer_engine.pytorch.module.base import initialize_ub

    tokens = exp.data.seq_length * exp.schedule.micro_batch_size // exp.parallel.cp
    initialize_ub(shape=[tokens, spec.hidden_size], tp_size=exp.parallel.tp, use_fp8=exp.precision.fp8 is not None,
                  dtype=DTYPES[exp.precision.dtype])
