"""The training loop: one screen. The machinery lives in build.py, checkpoint.py, data/, metrics.py and flops.py."""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from mcorekit.launch.config import Experiment
from mcorekit.launch.layout import layout_of
from mcorekit.launch.requeue import RestartGuard, StopSignal, requeue_and_exit
from mcorekit.train import checkpoint
from mcorekit.train.build import Trainer, build
from mcorekit.train.data import batches, build_dataset
from mcorekit.train.flops import train_flops_per_token
from mcorekit.train.metrics import ExpertLoad, MetricsWriter

log = logging.getLogger("mcorekit.train")


def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    from megatron.core import parallel_state as ps

    batch = next(data_iterator)
    packed = None
    if "cu_seqlens" in batch:  # packed SFT: attention stays within each example
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, n = batch["cu_seqlens"], batch["max_seqlen"]
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)
    cp = ps.get_context_parallel_world_size()
    if cp > 1:  # this rank's two of the 2*CP sequence chunks (load-balanced for causal attention)
        from megatron.core.utils import get_batch_on_this_cp_rank

        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group())
    per_token = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"],
                      packed_seq_params=packed)
    mask = batch["loss_mask"]

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        total = torch.stack([(output.float() * mask).sum(), mask.sum()])
        if cp > 1:  # the mean over the whole sequence; no gradient flows through the all-reduce
            torch.distributed.all_reduce(total, group=ps.get_context_parallel_group())
        loss = total[0] / total[1].clamp(min=1)
        # The schedule scales the first value in place: by 1 / micro-batches, and by CP (DDP averages gradients over
        # DP x CP ranks while each CP rank holds only its chunks' part of the gradient), so it is returned unscaled.
        return loss, {"lm loss": loss.detach().clone()}

    return per_token, loss_func


def experts_note(model_chunks: list[Any]) -> str:
    """Which class computes the MoE experts in the built model (TE's GroupedLinear or torch._grouped_mm)."""
    names = sorted({type(m.experts).__name__ for c in model_chunks for m in c.modules() if hasattr(m, "experts")
                    and isinstance(m.experts, torch.nn.Module)})
    return f", MoE experts: {', '.join(names)}" if names else ""


def train(exp: Experiment, run_dir: Path, peak_tflops: float = 989.0, on_step: Any = None) -> list[float]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    t = build(exp)
    rank0 = dist.get_rank() == 0
    if rank0:  # which environment the ranks came from: a wrong one shows here, not as a hang
        print(f"mcorekit.train: {dist.get_world_size()} ranks from the {t.env.source} environment, rendezvous "
              f"{t.env.master_addr}:{t.env.master_port}, layout {layout_of(exp)} x DP{t.dp_size}"
              f"{experts_note(t.model)}", flush=True)
    stop = StopSignal()
    saver = checkpoint.Saver(Path(exp.checkpoint.dir or run_dir / "checkpoints"), exp.checkpoint.keep_last,
                             exp.checkpoint.async_save)
    step = _resume(t, saver.root, exp)
    if rank0:
        RestartGuard(run_dir, exp.resources.max_restarts).check(step)
    s = exp.schedule
    micro_batches = s.global_batch_size // (s.micro_batch_size * t.dp_size)
    dataset = build_dataset(exp, t.spec, run_dir)
    valid = build_dataset(exp, t.spec, run_dir, validation=True) if s.eval_interval else None
    # one iterator per virtual pipeline stage: each model chunk reads the same micro-batches
    data = [batches(dataset, s.micro_batch_size, step * s.global_batch_size, t.dp_rank, t.dp_size) for _ in t.model]
    tokens_per_step = s.global_batch_size * exp.data.seq_length
    flops_per_step = train_flops_per_token(t.spec, exp.data.seq_length, t.padded_vocab) * tokens_per_step
    writer = MetricsWriter(run_dir, exp.logging.tensorboard, rank0)
    experts = ExpertLoad(t.model, exp.parallel.sequence_parallel) if t.spec.is_moe else None
    fwd_bwd = get_forward_backward_func()
    losses: list[float] = []
    skipped = 0
    timer, eval_seconds = time.perf_counter(), 0.0
    while step < s.train_iters:
        if stop.requested():  # USR2 before the time limit, or preemption: save together, then requeue
            saver.save(step, t.model, t.optimizer, t.scheduler, wait=True)
            requeue_and_exit(dist.get_rank())
        saver.poll()
        for chunk in t.model:
            chunk.zero_grad_buffer()
        t.optimizer.zero_grad()
        out = fwd_bwd(forward_step_func=forward_step, data_iterator=data if len(data) > 1 else data[0], model=t.model,
                      num_microbatches=micro_batches, seq_length=exp.data.seq_length,
                      micro_batch_size=s.micro_batch_size, forward_only=False)
        updated, grad_norm, _ = t.optimizer.step()
        if updated:
            t.scheduler.step(increment=s.global_batch_size)
        else:  # fp16: the loss scaler found Inf/NaN gradients, lowered the scale and skipped the update
            skipped += 1
        step += 1
        loss = _mean_loss(out)
        losses.append(loss)
        grad_norm = None if grad_norm is None else float(grad_norm)
        if not math.isfinite(loss) or (updated and grad_norm is not None and not math.isfinite(grad_norm)):
            raise FloatingPointError(f"NaN or Inf in loss ({loss}) or grad norm ({grad_norm}) at step {step}: lower "
                                     f"optimizer.lr, lengthen warmup, check the data")
        if step % exp.logging.log_interval == 0 or step == s.train_iters:
            torch.cuda.synchronize()
            elapsed, timer = time.perf_counter() - timer - eval_seconds, time.perf_counter()
            eval_seconds = 0.0  # validation time is not training throughput
            n = (step - 1) % exp.logging.log_interval + 1  # steps since the last log line
            tflops = flops_per_step * n / elapsed / dist.get_world_size() / 1e12
            metrics = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": float(t.optimizer.param_groups[0]["lr"]),
                       "tokens_per_s": tokens_per_step * n / elapsed, "tflops_per_gpu": tflops, "mfu": tflops / peak_tflops,
                       "mem_gb": torch.cuda.max_memory_allocated() / 1e9}
            if exp.precision.dtype == "fp16":
                metrics.update(loss_scale=float(t.optimizer.get_loss_scale()), skipped_steps=skipped)
            if experts:
                metrics.update(experts.read_and_reset())
            writer.write(step, s.train_iters, metrics)
            if on_step:
                on_step(metrics)
        if valid is not None and (step % s.eval_interval == 0 or step == s.train_iters):
            started = time.perf_counter()
            val_loss = evaluate(t, fwd_bwd, valid, exp, micro_batches)
            writer.write(step, s.train_iters, {"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 30.0))})
            eval_seconds += time.perf_counter() - started
        if step % exp.checkpoint.save_interval == 0 or step == s.train_iters:
            saver.save(step, t.model, t.optimizer, t.scheduler, wait=step == s.train_iters)
    saver.close()
    writer.close()
    return losses


def evaluate(t: Trainer, fwd_bwd: Any, dataset: Any, exp: Experiment, micro_batches: int) -> float:
    """Mean loss over the first schedule.eval_iters global batches of the held-out data (the same batches at
    every validation, so the values compare), forward only, dropout off."""
    s = exp.schedule
    data = [batches(dataset, s.micro_batch_size, 0, t.dp_rank, t.dp_size) for _ in t.model]
    losses = []
    for chunk in t.model:
        chunk.eval()
    with torch.no_grad(), forward_pre_hooks_off(t.model):
        for _ in range(s.eval_iters):
            out = fwd_bwd(forward_step_func=forward_step, data_iterator=data if len(data) > 1 else data[0],
                          model=t.model, num_microbatches=micro_batches, seq_length=exp.data.seq_length,
                          micro_batch_size=s.micro_batch_size, forward_only=True)
            losses.append(_mean_loss(out))
    for chunk in t.model:
        chunk.train()
    return sum(losses) / len(losses)


@contextmanager
def forward_pre_hooks_off(chunks: list[Any]) -> Iterator[None]:
    """With overlap_param_gather, DDP gathers the weights in forward pre-hooks that also start the next
    bucket's gather for the training forward that follows. Outside training (validation) they are switched
    off, which first gathers every weight synchronously, and back on afterwards (as Megatron-LM does)."""
    hooked = [c for c in chunks if getattr(c, "use_forward_hook", False)]
    for chunk in hooked:
        chunk.disable_forward_pre_hook()
    try:
        yield
    finally:
        for chunk in hooked:
            chunk.enable_forward_pre_hook()


def _resume(t: Trainer, root: Path, exp: Experiment) -> int:
    """The step to start from: this run's own latest checkpoint (everything) wins; else checkpoint.load, as
    weights only (finetune, or a converted `release` checkpoint, which has nothing else) or as a whole."""
    found = checkpoint.latest(root)
    if found is not None:
        step = checkpoint.load(found, t.model, t.optimizer, t.scheduler)
        log.warning("resumed from %s at step %d", found, step)
        return step
    if not exp.checkpoint.load:
        return 0
    start = checkpoint.latest(Path(exp.checkpoint.load)) or Path(exp.checkpoint.load)
    if exp.checkpoint.finetune or start.name == checkpoint.RELEASE:
        checkpoint.load_weights(start, t.model, t.optimizer)
        log.warning("initialised weights from %s (fresh optimizer, step 0)", start)
        return 0
    step = checkpoint.load(start, t.model, t.optimizer, t.scheduler)
    log.warning("continuing from %s at step %d (checkpoint.finetune=true would take its weights only)", start, step)
    return step


def _mean_loss(out: list[dict[str, torch.Tensor]]) -> float:
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_last_stage():
        value = torch.zeros(1, device="cuda")
    else:
        value = torch.stack([o["lm loss"] for o in out]).mean().reshape(1)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(value, group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(value, group=ps.get_data_parallel_group())
    return value.item() / ps.get_data_parallel_world_size()
