"""Our experiment schema -> Megatron-Core's config objects. Pure functions (no GPU, no process groups), so each
feature's mapping is tested on CPU, training builds from them, and the rules (rules.problems) ask Megatron-Core
itself whether it accepts a config, on the login node before queueing as on the ranks."""

from __future__ import annotations

from typing import Any

from mcorekit.config.experiment import Experiment, layout_of
from mcorekit.models.megatron import DTYPES, apex_wgrad_available, te_swiglu
from mcorekit.models.spec import ModelSpec


def transformer_kwargs(exp: Experiment, spec: ModelSpec, use_te: bool, fusions: bool = True,
                       full_graph: bool = False) -> dict[str, Any]:
    """TransformerConfig fields beyond the model shape (which models/megatron.py derives from the ModelSpec).
    `fusions=False` leaves out the fused kernels, whose checks need TE importable (the launcher's login node).
    `full_graph`: each step runs as one CUDA graph (rules.use_full_graph, train/step_graph.py)."""
    prec, moe, rc = exp.precision, exp.moe, exp.recompute
    fuse = use_te and fusions
    te_act = fuse and te_swiglu(spec)
    kw: dict[str, Any] = dict(
        # Fusions: TE's SwiGLU kernel for dense SwiGLU MLPs (models/megatron.te_swiglu: +0.5% and +0.9% tokens/s on
        # the dense 3B bf16 shape, +1.1% in FP8, one H200, 2026-12-04, and no torch.compile of it at step 1),
        # Megatron-Core's fused bias-SwiGLU elsewhere, TE's fused RoPE, Megatron's native fused cross entropy (its TE
        # variant has known stability issues, Megatron-LM rejects it). The non-TE path keeps the plain PyTorch ops.
        use_te_activation_func=te_act, bias_activation_fusion=fuse and not te_act, apply_rope_fusion=fuse,
        masked_softmax_fusion=fuse, cross_entropy_loss_fusion=fuse, cross_entropy_fusion_impl="native",
        # Dense models: weight gradients written straight into DDP's fp32 main_grad by TE's layers (one GEMM
        # accumulating in fp32, instead of a bf16 .grad that DDP's hook adds: 1,176 adds, 5% of the dense 3B FP8
        # step; bench/levers.py `no-gaf`: -2.6% tokens/s on the 3B bf16 shape, one H200, 2026-12-04). Megatron's own
        # output layer needs APEX's kernel for it; without APEX models/megatron.build_gpt gives that one layer the
        # plain weight gradient. MoE models keep it only where APEX is installed, as Megatron-LM does: under the
        # step graph it made the 8-expert shape 1.6-2.2% slower (2026-12-01, 2026-12-04). Megatron-FSDP is left out:
        # it supports the flag, but has not run with it here (it needs two GPUs).
        gradient_accumulation_fusion=fuse and not exp.parallel.fsdp and (not spec.is_moe or apex_wgrad_available()),
        tp_comm_overlap=exp.optimizer.tp_comm_overlap,
    )
    if full_graph:
        kw.update(cuda_graph_impl="full_iteration")
    if exp.parallel.vpp:
        # The interleaved schedule sends activations and gradients in both directions at once. Batched, the four
        # ops go out as [send_prev, recv_prev, send_next, recv_next]; with PP=2 prev and next are the same rank,
        # so NCCL pairs the gradient sent back with the activation expected forward: every stage then trains on
        # swapped tensors (step-1 gradients of the first chunks were ~500x too large). Separate, overlapped
        # sends are ordered by rank parity and pair correctly (Megatron-LM's default for this schedule).
        kw.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if prec.fp8:
        # delayed scaling uses the hybrid format (e4m3 forward, e5m2 gradients); the current-scaling recipes e4m3.
        kw.update(fp8="hybrid" if prec.fp8 == "delayed" else "e4m3", fp8_recipe=prec.fp8, fp8_param=prec.fp8_params)
    if spec.is_moe:
        kw.update(moe_grouped_gemm=moe.grouped_gemm and use_te, moe_token_dispatcher_type=moe.dispatcher,
                  moe_permute_fusion=moe.permute_fusion and fuse, moe_router_fusion=moe.router_fusion and fuse,
                  moe_router_dtype="fp32", moe_expert_capacity_factor=moe.capacity_factor,
                  overlap_moe_expert_parallel_comm=moe.a2a_overlap)
        if moe.capacity_factor is not None:
            kw.update(moe_token_drop_policy="probs", moe_pad_expert_input_to_capacity=moe.pad_to_capacity)
        if moe.expert_bias:  # aux-loss-free balancing (DeepSeek-V3): a per-expert bias on sigmoid scores
            kw.update(moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none",
                      moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.0)
        else:
            kw.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=moe.aux_loss_coeff)
        if moe.shared_expert_ffn:
            kw.update(moe_shared_expert_intermediate_size=moe.shared_expert_ffn,
                      moe_shared_expert_overlap=moe.shared_expert_overlap)
    if rc.granularity == "selective":
        kw.update(recompute_granularity="selective", recompute_modules=list(rc.modules))
    elif rc.granularity == "full":
        kw.update(recompute_granularity="full", recompute_method=rc.method, recompute_num_layers=rc.num_layers)
    if rc.offload_layers:
        kw.update(cpu_offloading=True, cpu_offloading_num_layers=rc.offload_layers, cpu_offloading_activations=True,
                  cpu_offloading_weights=False)
    return kw


def transformer_config(exp: Experiment, spec: ModelSpec, use_te: bool, fusions: bool = True,
                       full_graph: bool = False) -> Any:
    from mcorekit.models.megatron import transformer_config as base

    return base(spec, layout_of(exp), params_dtype=DTYPES[exp.precision.dtype],
                **transformer_kwargs(exp, spec, use_te, fusions, full_graph))


def overlaps(exp: Experiment, full_graph: bool = False) -> tuple[bool, bool]:
    """(overlap_grad_reduce, overlap_param_gather). A step captured as one CUDA graph has one data-parallel rank
    (rules.full_graph_blockers): nothing to overlap, and DDP's hooks would wait on work started outside the graph."""
    o = exp.optimizer
    if full_graph:
        return False, False
    return o.overlap_grad_reduce, o.overlap_param_gather and o.distributed


def ddp_config(exp: Experiment, full_graph: bool = False) -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    o = exp.optimizer
    grad_overlap, param_overlap = overlaps(exp, full_graph)
    kw: dict[str, Any] = dict(
        grad_reduce_in_fp32=True, overlap_grad_reduce=grad_overlap, use_distributed_optimizer=o.distributed,
        overlap_param_gather=param_overlap, average_in_collective=True,
        # a NaN check reads the gradients' norm on the host, which a captured step cannot; the loop still stops on
        # a NaN loss or gradient norm (train/loop.stop_on_nan)
        check_for_nan_in_grad=not full_graph, bucket_size=o.bucket_size,
        fp8_param_gather=exp.precision.fp8_params)  # FP8 params are all-gathered in FP8: half the bytes
    if exp.parallel.fsdp:
        kw.update(fsdp_kwargs(exp))
    return DistributedDataParallelConfig(**kw)


def fsdp_kwargs(exp: Experiment) -> dict[str, Any]:
    """parallel.fsdp -> Megatron-FSDP (megatron.core.distributed.fsdp, wrapped by train/fsdp.py), which shards over
    the data-parallel ranks: `optim` the optimizer state (fp32 main weights, Adam moments; what the distributed
    optimizer does), `optim_grads` also the gradients, `optim_grads_params` also the bf16 weights (gathered one
    transformer layer at a time). The rules (rules.fsdp_problems) refuse what does not combine with it."""
    import torch

    o, strategy = exp.optimizer, exp.parallel.fsdp
    return dict(
        use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
        use_distributed_optimizer=True,  # Megatron-FSDP's optimizer is the DistributedOptimizer in its FSDP mode
        # fp32 main weights and fp32 gradients (reduced in fp32), as grad_reduce_in_fp32 gives plain DDP; without
        # main_grads_dtype Megatron-FSDP would accumulate and reduce the gradients in bf16.
        megatron_fsdp_main_params_dtype=torch.float32, megatron_fsdp_main_grads_dtype=torch.float32,
        # Megatron-FSDP scales the gradients by 1/DP itself before a summing collective (Megatron-Bridge turns
        # average_in_collective off for it).
        average_in_collective=False,
        # Sharded gradients are reduce-scattered during the backward pass, and sharded weights all-gathered layer
        # by layer ahead of use: Megatron-FSDP requires these overlaps (rules refuse turning them off there).
        overlap_grad_reduce=o.overlap_grad_reduce or strategy != "optim",
        overlap_param_gather=o.overlap_param_gather or strategy == "optim_grads_params")


def optimizer_config(exp: Experiment, full_graph: bool = False) -> Any:
    from megatron.core.optimizer import OptimizerConfig

    o, prec = exp.optimizer, exp.precision
    return OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=prec.dtype == "bf16",
        fp16=prec.dtype == "fp16", params_dtype=DTYPES[prec.dtype], use_distributed_optimizer=o.distributed,
        overlap_param_gather=overlaps(exp, full_graph)[1],
        loss_scale=prec.loss_scale, initial_loss_scale=2.0**16, min_loss_scale=1.0, loss_scale_window=1000,
        hysteresis=2)


def scheduler_kwargs(exp: Experiment) -> dict[str, Any]:
    """OptimizerParamScheduler arguments; Megatron counts its steps in samples, so iterations x global batch. The
    schedule is this run's, also when it continues another run's state (checkpoint.load with finetune=false):
    the checkpoint gives its position only (train/checkpoint.load_schedule)."""
    s, o = exp.schedule, exp.optimizer
    gbs = s.global_batch_size
    wsd = s.decay == "wsd"
    return dict(init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=s.warmup_iters * gbs,
                lr_decay_steps=s.train_iters * gbs, lr_decay_style="WSD" if wsd else s.decay,
                start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=s.train_iters * gbs,
                wd_incr_style="constant",
                # WSD: constant after warmup, then the last fifth decays (cosine) to min_lr
                wsd_decay_steps=(s.train_iters // 5) * gbs if wsd else None,
                lr_wsd_decay_style="cosine" if wsd else None,
                use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def megatron_problems(exp: Experiment, spec: ModelSpec, use_te: bool = True) -> list[str]:
    """What Megatron-Core's own config checks reject (empty when it accepts); the last of rules.problems, so a
    config Megatron would refuse at start-up fails on the login node, before it queues."""
    try:
        transformer_config(exp, spec, use_te, fusions=False)
    except (AssertionError, ValueError) as e:
        return [f"Megatron-Core rejects the configuration: {e}"]
    return []
