"""The training loop, the same for every task: train() reads top to bottom; one optimizer step is train_step(),
logging is StepLog, validation evaluate(), checkpoints checkpoint.py. What is optimised comes from tasks/."""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from mcorekit.config.cluster import gpu_peak_tflops, load_profile
from mcorekit.config.experiment import Experiment, layout_of
from mcorekit.errors import MCoreKitError, first_line
from mcorekit.runtime.ranks import any_rank, collective_device
from mcorekit.runtime.requeue import RestartGuard, StopSignal, stop_and_exit
from mcorekit.train import checkpoint
from mcorekit.train.build import Trainer, build, mtp_weights_check, seed_step
from mcorekit.train.flops import train_flops_per_token
from mcorekit.train.metrics import ExpertLoad, MetricsWriter, mtp_losses, startup
from mcorekit.train.shutdown import stop_compile_workers
from mcorekit.train.tasks import Task, task_for

log = logging.getLogger("mcorekit.train")


def experts_note(model_chunks: list[Any]) -> str:
    """Which class computes the MoE experts in the built model (TE's GroupedLinear or torch._grouped_mm)."""
    names = sorted({type(m.experts).__name__ for c in model_chunks for m in c.modules() if hasattr(m, "experts")
                    and isinstance(m.experts, torch.nn.Module)})
    return f", MoE experts: {', '.join(names)}" if names else ""


def train(exp: Experiment, run_dir: Path, peak_tflops: float | None = None, on_step: Any = None) -> list[float]:
    """Build, resume, then one train_step per iteration until schedule.train_iters: logging, validation and saving
    at their intervals, a save and requeue when Slurm signals. Returns this process's losses. MFU is against
    `peak_tflops`, by default the run folder's cluster profile's (config.cluster.gpu_peak_tflops)."""
    peak_tflops = peak_tflops or gpu_peak_tflops(run_dir)
    root = Path(exp.checkpoint.dir or run_dir / "checkpoints")
    t = build(exp, checkpoints=root)
    exp = t.exp  # checkpoint.load and peft.lora.load pinned to the iterations checked (checkpoint.pinned_sources)
    announce(t, exp)
    task = task_for(exp, t.spec, run_dir)
    stop = StopSignal()
    saver = checkpoint.Saver(root, exp.checkpoint.keep_last, exp.checkpoint.async_save, signal_lead_s(run_dir))
    step, saved = _resume(t, saver.root, exp)  # saved: this run's own checkpoint holds `step`
    startup.mark("resume")
    refused, guard = None, RestartGuard(run_dir, exp.resources.max_restarts, saver.root)
    if dist.get_rank() == 0:
        try:
            guard.check(step)
        except Exception as e:  # noqa: BLE001 - a refusal, or restarts.json unwritable: every rank must stop
            refused = e
    if any_rank(refused is not None):  # every rank stops, not only rank 0 (the others would wait for it)
        raise refused or MCoreKitError("rank 0 refused this restart (its log says why)")
    s = exp.schedule
    dataset = task.dataset()
    valid = task.dataset(validation=True) if s.eval_interval else None
    # one iterator per virtual pipeline stage: each model chunk reads the same micro-batches
    data = [task.batches(dataset, step * s.global_batch_size, t.dp_rank, t.dp_size) for _ in t.model]
    log = StepLog(t, exp, run_dir, peak_tflops, on_step, task, step)
    losses: list[float] = []
    while step < s.train_iters:
        if stop.requested():  # USR2 before the time limit (requeue), or TERM (scancel, preemption): save together
            save_before_stop(saver, step, t, saved, dist.get_rank())
            stop_and_exit(stop, guard, dist.get_rank(), step, close=log.close)
        saver.poll()
        seed_step(t, step)  # LoRA's dropout after a resume as without one
        metrics = train_step(t, task, data)
        step, saved = step + 1, False
        stop_on_nan(metrics, step)
        losses.append(metrics["loss"])
        log.step(step, metrics)
        if len(losses) == 1:  # this process's first step: where its start-up time went
            startup.report(run_dir)
        if valid is not None and validation_due(step, s.eval_interval, s.train_iters, stop, dist.get_rank()):
            log.validation(step, lambda: evaluate(t, task, valid))
        if step == s.train_iters:
            stop_compile_workers()  # beside the final save, not after it
        if step % exp.checkpoint.save_interval == 0 or step == s.train_iters:
            with log.paused():  # the save's time is not training throughput
                saver.save(step, t.model, t.optimizer, t.scheduler, wait=step == s.train_iters)
            saved = True
    saver.close()
    stop.work_done()
    if dist.get_rank() == 0:
        checkpoint.release_sources(exp, saver.root)
    log.close()
    return losses


def signal_lead_s(run_dir: Path) -> int | None:
    """How long before the time limit Slurm signals the job: the run folder's cluster profile's signal_seconds (the
    profile `mcorekit launch` submitted it with); None without one (a run outside the launcher asks for no signal)."""
    profile = run_dir / "cluster.yaml"
    return load_profile(profile).signal_seconds if profile.is_file() else None


def validation_due(step: int, interval: int, train_iters: int, stop: StopSignal, rank: int) -> bool:
    """Validation at its interval and after the last step, unless a stop is pending (any rank's signal: every rank
    skips it together): the signal's lead time is for the save, which comes first."""
    if step % interval and step != train_iters:
        return False
    if stop.requested():
        if rank == 0:
            log.warning("step %d: validation skipped, a stop signal is pending and the checkpoint is saved first (a "
                        "restart validates at the next interval, not at this step)", step)
        return False
    return True


def save_before_stop(saver: checkpoint.Saver, step: int, t: Trainer, saved: bool, rank: int) -> None:
    """The save a stop signal asks for, on every rank. A background write still in flight is waited for: with
    `saved` it holds this step (a signal right after a save or a resume: that checkpoint is never rewritten). If that
    write failed (raised on every rank: Megatron-Core broadcasts the failure), this step is saved once more, written
    at once, before giving up: a failure of that save ends the job."""
    from torch.distributed.checkpoint.api import CheckpointException

    from mcorekit.train.checkpoint_reader import dcp_cause

    try:
        saver.wait()
    except CheckpointException as e:
        if rank == 0:
            log.warning("step %d: the background checkpoint save failed (%s); saving step %d now instead", step,
                        first_line(dcp_cause(e)), step)
        saved = False
    if not saved:
        saver.save(step, t.model, t.optimizer, t.scheduler, wait=True)


def announce(t: Trainer, exp: Experiment) -> None:
    """Rank 0 says where its ranks came from and what it built: a wrong environment shows here, not as a hang."""
    if dist.get_rank() == 0:
        print(f"mcorekit.train: {dist.get_world_size()} ranks from the {t.env.source} environment, rendezvous "
              f"{t.env.master_addr}:{t.env.master_port}, layout {layout_of(exp)} x DP{t.dp_size}"
              f"{experts_note(t.model)}{', each step one CUDA graph' if t.full_graph else ''}", flush=True)


def train_step(t: Trainer, task: Task, data: list[Any]) -> dict[str, Any]:
    """One optimizer step over a global batch: forward and backward of every micro-batch through Megatron's
    (pipeline) schedule, then the optimizer and the learning-rate schedule; returns the task's metrics, grad norm
    and whether the optimizer updated (fp16 skips a step whose gradients overflowed)."""
    s = t.exp.schedule
    step_data = task.prepare_step(t, data, micro_batches(t))  # DPO: the reference model's log-probs, before the pass
    for chunk in t.model:
        chunk.zero_grad_buffer()
    t.optimizer.zero_grad()
    out = t.forward_backward(
        forward_step_func=task.forward_step, data_iterator=step_data if len(step_data) > 1 else step_data[0],
        model=t.model, num_microbatches=micro_batches(t), seq_length=t.exp.data.seq_length,
        micro_batch_size=s.micro_batch_size * task.rows_per_sample, forward_only=False)
    updated, grad_norm, _ = t.optimizer.step()
    if updated:
        t.scheduler.step(increment=s.global_batch_size)
    metrics: dict[str, Any] = {**_mean_metrics(out, task.metrics), "updated": bool(updated)}
    if t.spec.mtp_layers:
        metrics.update(mtp_losses(t.spec.mtp_layers, micro_batches(t)))
    if not t.exp.optimizer.clip_grad and not grad_norm:  # no clipping: an unchained optimizer (FSDP's) gives 0.0
        grad_norm = None
    metrics["grad_norm"] = None if grad_norm is None else float(grad_norm)
    return metrics


def stop_on_nan(metrics: dict[str, Any], step: int) -> None:
    loss, norm = metrics["loss"], metrics["grad_norm"]
    if not math.isfinite(loss) or (metrics["updated"] and norm is not None and not math.isfinite(norm)):
        raise FloatingPointError(f"NaN or Inf in loss ({loss}) or grad norm ({norm}) at step {step}: lower "
                                 f"optimizer.lr, lengthen warmup, check the data")


def micro_batches(t: Trainer) -> int:
    s = t.exp.schedule
    return s.global_batch_size // (s.micro_batch_size * t.dp_size)


class StepLog:
    """Metrics at logging.log_interval: loss, grad norm, lr, seconds per step, tokens/s, TFLOP/s per GPU, MFU, memory
    (and loss scale, skipped steps, expert load where they apply); validation results. The time spent validating and
    saving is left out of the rates. tokens/s counts real tokens: SFT's and DPO's rows leave their padding out
    (tasks/base.RealTokens). TFLOP/s and MFU count the FLOPs the GPU spent, on every position of every row, padding
    included (Megatron's convention); packed rows are charged the attention within each example. A GRPO step holds
    its generation: it logs its own rates instead."""

    def __init__(self, t: Trainer, exp: Experiment, run_dir: Path, peak_tflops: float, on_step: Any, task: Task,
                 start_step: int = 0) -> None:
        self.t, self.exp, self.peak_tflops, self.on_step, self.task = t, exp, peak_tflops, on_step, task
        self.writer = MetricsWriter(run_dir, exp.logging.tensorboard, dist.get_rank() == 0, exp.logging.wandb,
                                    exp.name)
        self.experts = ExpertLoad(t.model, exp.parallel.sequence_parallel) if t.spec.is_moe else None
        self.tokens_per_step = exp.schedule.global_batch_size * task.rows_per_sample * exp.data.seq_length
        self.timer, self.paused_seconds, self.skipped, self.last_step = time.perf_counter(), 0.0, 0, start_step
        if dist.get_rank() == 0 and task.loop_rates:
            print(f"mcorekit.train: MFU against {peak_tflops:g} TFLOP/s per GPU (--peak-tflops, else the cluster "
                  f"profile's gpu_peak_tflops_bf16, else an H100's); TFLOP/s and MFU count every row position, "
                  f"padding included, tokens/s {'real tokens only' if task.tokens else 'every position'}", flush=True)

    def flops_per_token(self, attended: float = 1.0) -> float:
        e = self.exp
        return train_flops_per_token(self.t.spec, e.data.seq_length, self.t.padded_vocab, e.peft.lora is not None,
                                     attended)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time in the block (validation, a checkpoint save) is left out of the next line's rates."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - started

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        if not metrics["updated"]:  # fp16: the loss scaler found Inf/NaN gradients, lowered the scale and skipped
            self.skipped += 1
        interval, total = self.exp.logging.log_interval, self.exp.schedule.train_iters
        if step % interval and step != total:
            return
        torch.cuda.synchronize()
        elapsed, self.timer = time.perf_counter() - self.timer - self.paused_seconds, time.perf_counter()
        self.paused_seconds = 0.0
        n, self.last_step = step - self.last_step, step  # steps since the last line (or since a resume)
        row = {"step": step, **{k: v for k, v in metrics.items() if k != "updated"},
               "lr": float(self.t.optimizer.param_groups[0]["lr"]), "mem_gb": peak_memory_gb()}
        if self.task.loop_rates:
            attended = self.task.packed.fraction() if self.task.packed else 1.0  # packed: within each example
            flops_per_step = self.flops_per_token(attended) * self.tokens_per_step  # every position: padding too
            tflops = flops_per_step * n / elapsed / dist.get_world_size() / 1e12
            tokens = self.task.tokens.read() if self.task.tokens else self.tokens_per_step * n  # padding left out
            row.update(step_s=elapsed / n, tokens_per_s=tokens / elapsed, tflops_per_gpu=tflops,
                       mfu=tflops / self.peak_tflops)
        if self.exp.precision.dtype == "fp16":
            row.update(loss_scale=float(self.t.optimizer.get_loss_scale()), skipped_steps=self.skipped)
        if self.experts:
            row.update(self.experts.read_and_reset())
        self.writer.write(step, total, row)
        if self.on_step:
            self.on_step(row)

    def validation(self, step: int, run: Any) -> None:
        with self.paused():
            val = run()
        row = {"step": step, **{f"val_{k}": v for k, v in val.items()}}
        if self.task.perplexity:
            row["val_ppl"] = math.exp(min(val["loss"], 30.0))
        self.writer.write(step, self.exp.schedule.train_iters, row)

    def close(self) -> None:
        self.writer.close()


def peak_memory_gb() -> float:
    """The largest peak of allocated GPU memory over the ranks (the stage or expert group nearest its limit, not
    rank 0's), since the process started."""
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 1e9], device=collective_device())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def evaluate(t: Trainer, task: Task, dataset: Any) -> dict[str, float]:
    """Mean metrics over the first schedule.eval_iters global batches of the held-out data (the same batches at
    every validation, so the values compare), forward only, dropout off. A metric that is a mean over a step's
    tokens (pairs) is the mean over all the validation tokens (pairs), as a training step's is over its own
    (Task.mean_over_steps): a batch with few response tokens weighs less than a full one."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    s = t.exp.schedule
    data = [task.batches(dataset, 0, t.dp_rank, t.dp_size) for _ in t.model]
    results: list[dict[str, float]] = []
    counts: list[dict[str, float]] = []  # each batch's tokens (pairs) per metric, from task.step_counts
    for chunk in t.model:
        chunk.eval()
    with torch.no_grad(), forward_pre_hooks_off(t.model):
        for _ in range(s.eval_iters):
            step_data = task.prepare_step(t, data, micro_batches(t))
            out = get_forward_backward_func()(
                forward_step_func=task.forward_step, data_iterator=step_data if len(step_data) > 1 else step_data[0],
                model=t.model, num_microbatches=micro_batches(t), seq_length=t.exp.data.seq_length,
                micro_batch_size=s.micro_batch_size * task.rows_per_sample, forward_only=True)
            results.append(_mean_metrics(out, task.metrics))
            counts.append({k: float(v) for k, v in (task.step_counts or {}).items()})  # a sync, as _mean_metrics'
    for chunk in t.model:
        chunk.train()
    return task.mean_over_steps(results, counts)


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


def _resume(t: Trainer, root: Path, exp: Experiment) -> tuple[int, bool]:
    """The step to start from, and whether it is this run's own checkpoint: this run's own latest checkpoint
    (everything) wins; else checkpoint.load, as weights only (finetune, or a converted `release` checkpoint, which
    has nothing else) or as a whole."""
    found = checkpoint.latest(root)
    if found is not None:
        if t.weights_from != found:  # else build checked it, before it loaded its weights (parallel.fsdp)
            checkpoint.checked_resume(found)
        step = checkpoint.load(found, t.model, t.optimizer, t.scheduler, weights_loaded=t.weights_from == found)
        log.warning("resumed from %s at step %d", found, step)
        return step, True
    if not exp.checkpoint.load:
        return 0, False
    start = checkpoint.start_of(exp.checkpoint.load)
    if note := mtp_weights_check(start, t.spec):
        log.warning(note)
    if exp.checkpoint.finetune or start.name == checkpoint.RELEASE:
        if t.weights_from != start:  # parallel.fsdp: build loaded them before wrapping
            checkpoint.load_weights(start, t.model, t.optimizer)
        log.warning("initialised weights from %s (fresh optimizer, step 0)", start)
        return 0, False
    step = checkpoint.load(start, t.model, t.optimizer, t.scheduler)
    log.warning("continuing from %s at step %d (checkpoint.finetune=true would take its weights only)", start, step)
    _schedule_at(t, step, exp.schedule.global_batch_size, start)
    return step, False


def _schedule_at(t: Trainer, step: int, global_batch: int, start: Path) -> None:
    """The schedule counts samples (global batches x their size): another run's checkpoint saved after `step` steps
    of another global batch size puts this run elsewhere in its schedule than at `step`; set it there, said so."""
    samples = step * global_batch
    if t.scheduler.num_steps != samples:
        log.warning("%s was saved at step %d after %d samples; with this run's global batch of %d, step %d is sample "
                    "%d: the schedule goes on from there", start, step, t.scheduler.num_steps, global_batch, step,
                    samples)
        t.scheduler.num_steps = 0
        t.scheduler.step(increment=samples)


def _mean_metrics(out: list[dict[str, torch.Tensor]], names: tuple[str, ...]) -> dict[str, float]:
    """The task's metrics averaged over this step's micro-batches and data-parallel ranks. Only the last pipeline
    stage computes them; the others learn them through the pipeline group's all-reduce."""
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_last_stage():
        values = torch.zeros(len(names), device="cuda")
    else:
        values = torch.stack([torch.stack([o[k].float().reshape(()) for k in names]) for o in out]).mean(0)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(values, group=ps.get_data_parallel_group())
    return dict(zip(names, (values / ps.get_data_parallel_world_size()).tolist()))
