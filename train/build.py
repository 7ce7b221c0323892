"""Everything the loop needs, built from an experiment: process groups, model (DDP-wrapped, distributed
optimizer with overlapped communication), scheduler. Megatron-Core does the work; this maps our config onto it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcorekit.errors import NotBuiltError
from mcorekit.launch.config import Experiment
from mcorekit.launch.env import DistEnv, init_process_group
from mcorekit.models.megatron import build_gpt, te_available, transformer_config
from mcorekit.models.parallel import Layout
from mcorekit.models.spec import ModelSpec, resolve

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP8_RECIPES = {"delayed": "delayed", "tensorwise": "tensorwise", "blockwise": "blockwise", "mxfp8": "mxfp8"}


@dataclass
class Trainer:
    exp: Experiment
    spec: ModelSpec
    env: DistEnv
    model: Any
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
    model_parallel_cuda_manual_seed(exp.data.seed)
    return env


def refuse_unbuilt(exp: Experiment) -> None:
    """Options the schema accepts but this loop does not implement yet fail here instead of being ignored."""
    unbuilt = []
    if exp.data.kind != "mock":
        unbuilt.append(f"data.kind={exp.data.kind} (only mock data is built)")
    if exp.data.packing or exp.data.dynamic_batching:
        unbuilt.append("data.packing / data.dynamic_batching")
    if exp.checkpoint.async_save:
        unbuilt.append("checkpoint.async_save=true")
    if exp.logging.tensorboard:
        unbuilt.append("logging.tensorboard=true (metrics are written to <run>/metrics.jsonl)")
    if exp.moe.shared_expert_ffn:
        unbuilt.append("moe.shared_expert_ffn")
    if unbuilt:
        raise NotBuiltError("not built yet in train/: " + "; ".join(unbuilt))


def build(exp: Experiment) -> Trainer:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    refuse_unbuilt(exp)
    env = init_distributed(exp)
    spec = resolve(exp.model.preset, exp.model.hf_config, exp.model.overrides)
    p, prec, moe, opt = exp.parallel, exp.precision, exp.moe, exp.optimizer
    use_te = te_available()
    dtype = DTYPES[prec.dtype]
    extra: dict[str, Any] = {}
    if prec.fp8:
        if not use_te:
            raise RuntimeError("precision.fp8 needs Transformer Engine, which is not importable on this node")
        extra.update(fp8="hybrid" if prec.fp8 == "delayed" else "e4m3", fp8_recipe=FP8_RECIPES[prec.fp8],
                     fp8_param=prec.fp8_params)
    if spec.is_moe:
        extra.update(moe_grouped_gemm=moe.grouped_gemm and use_te, moe_token_dispatcher_type=moe.dispatcher,
                     moe_aux_loss_coeff=moe.aux_loss_coeff, moe_router_enable_expert_bias=moe.expert_bias,
                     moe_router_load_balancing_type="none" if moe.expert_bias else "aux_loss",
                     moe_expert_capacity_factor=moe.capacity_factor, moe_permute_fusion=moe.permute_fusion and use_te,
                     moe_router_dtype="fp32")
        if moe.expert_bias:
            extra["moe_router_score_function"] = "sigmoid"
    if exp.recompute.granularity != "none":
        extra.update(recompute_granularity=exp.recompute.granularity)
        if exp.recompute.granularity == "full":
            extra.update(recompute_method=exp.recompute.method, recompute_num_layers=exp.recompute.num_layers)
    par = Layout(p.tp, p.pp, p.cp, p.ep, p.etp, p.vpp, p.sequence_parallel)
    config = transformer_config(spec, par, params_dtype=dtype, tp_comm_overlap=opt.tp_comm_overlap,
                                bias_activation_fusion=use_te, apply_rope_fusion=use_te, masked_softmax_fusion=use_te,
                                **extra)
    padded_vocab = -(-spec.vocab_size // (128 * p.tp)) * 128 * p.tp
    model = build_gpt(spec, config, padded_vocab, use_te=use_te, grouped_gemm=bool(extra.get("moe_grouped_gemm")),
                      pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()).cuda()
    if dtype != torch.float32:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=opt.overlap_grad_reduce, use_distributed_optimizer=opt.distributed,
        overlap_param_gather=opt.overlap_param_gather and opt.distributed, average_in_collective=True,
        check_for_nan_in_grad=True, bucket_size=40_000_000)
    model = DistributedDataParallel(config, ddp_config, model)
    # The schedule calls these: grad sync hooks of the overlapped DDP and the loss scale of the optimizer.
    from megatron.core.distributed import finalize_model_grads

    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_config.overlap_param_gather:
        config.param_sync_func = model.start_param_sync
    opt_config = OptimizerConfig(
        optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay, adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps, clip_grad=opt.clip_grad, bf16=prec.dtype == "bf16",
        fp16=prec.dtype == "fp16", params_dtype=dtype, use_distributed_optimizer=opt.distributed,
        overlap_param_gather=opt.overlap_param_gather and opt.distributed)
    optimizer = get_megatron_optimizer(opt_config, [model])
    config.grad_scale_func = optimizer.scale_loss
    s = exp.schedule
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr, lr_warmup_steps=s.warmup_iters * s.global_batch_size,
        lr_decay_steps=s.train_iters * s.global_batch_size,
        lr_decay_style="WSD" if s.decay == "wsd" else s.decay, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
        wd_incr_steps=s.train_iters * s.global_batch_size, wd_incr_style="constant",
        wsd_decay_steps=(s.train_iters // 5) * s.global_batch_size if s.decay == "wsd" else None,
        lr_wsd_decay_style="cosine" if s.decay == "wsd" else None)
    return Trainer(exp, spec, env, model, optimizer, scheduler, padded_vocab,
                   ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
