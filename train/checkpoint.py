"""Distributed (torch_dist) checkpoints: iter_N/ directories, a latest tracker written atomically after the
checkpoint is complete (every rank's part, also for asynchronous saves), keep-last-N retention. Loading an HF-converted checkpoint (tracker `release`) for
fine-tuning takes the weights only."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"  # Megatron-LM's name for a checkpoint that did not come from a training step (weights only)
# fully_reshardable: the optimizer state is stored per model parameter, so a checkpoint resumes at another
# TP/PP/DP layout (saving gathers it over DP; dp_reshardable would be faster but fixes the layout).
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False}


def iter_dir(root: Path, step: int) -> Path:
    return root / f"iter_{step:07d}"


def tracked(root: Path) -> Path | None:
    """The iteration directory a checkpoint root's tracker names (iter_N or release); None without a tracker."""
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    value = tracker.read_text().strip()
    return root / value if value == RELEASE else iter_dir(root, int(value))


def latest(root: Path) -> Path | None:
    """The tracked torch_dist checkpoint, if it is complete on disk."""
    path = tracked(root)
    return path if path is not None and (path / "metadata.json").is_file() else None


def unwrap(model: Any) -> Any:
    """The GPTModel inside DDP / Float16Module: its keys are the checkpoint's (and convert/'s) keys."""
    while hasattr(model, "module"):
        model = model.module
    return model


class Saver:
    """Saves iter_N/ checkpoints; with async_save the write happens in a background process while training
    continues, and the tracker is updated only once every rank's part is on disk (one save in flight)."""

    def __init__(self, root: Path, keep_last: int, async_save: bool) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.root, self.keep_last = root, keep_last
        self.queue = AsyncCallsQueue() if async_save else None

    def save(self, step: int, chunks: list[Any], optimizer: Any, scheduler: Any, wait: bool = False) -> Path:
        from megatron.core import dist_checkpointing

        self.wait()
        path = iter_dir(self.root, step)
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)  # a half-written one from an interrupted save
            path.mkdir(parents=True)
        dist.barrier()
        sync_params(chunks)
        model_sd = _model_state(chunks)
        state = {**model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=SHARDING),
                 "scheduler": scheduler.state_dict(), "iteration": step}
        if self.queue is None:
            dist_checkpointing.save(state, str(path))
            dist.barrier()
            self._finalize(path, step)
        else:
            # "mcore": Megatron-Core's own background writer (the default "nvrx" needs nvidia-resiliency-ext)
            request = dist_checkpointing.save(state, str(path), async_sharded_save=True, async_strategy="mcore")
            request.add_finalize_fn(lambda: self._finalize(path, step))
            self.queue.schedule_async_request(request)
            if wait:
                self.wait()
        return path

    def poll(self) -> None:
        """Between steps: finish a background save that is complete everywhere (never blocks)."""
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        if self.queue is not None:
            self.wait()
            self.queue.close()

    def _finalize(self, path: Path, step: int) -> None:
        if dist.get_rank() == 0:
            tmp = self.root / (TRACKER + ".tmp")
            tmp.write_text(str(step))
            os.replace(tmp, self.root / TRACKER)  # only now is this the latest checkpoint
            done = sorted(p for p in self.root.glob("iter_*") if p != path)
            for old in done[: max(0, len(done) - (self.keep_last - 1))]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()


def sync_params(chunks: list[Any]) -> None:
    """With overlap_param_gather the distributed optimizer's step updates only this rank's shard of the weights;
    the other shards arrive by an all-gather that the next forward pass starts. A checkpoint written between the
    two would hold the shards other ranks own one update behind: gather them now (what Megatron-LM's
    force_param_sync does before it saves; validation gets the same by switching DDP's pre-hooks off)."""
    for chunk in chunks:
        if getattr(getattr(chunk, "ddp_config", None), "overlap_param_gather", False):
            chunk.start_param_sync(force_sync=True)


def _model_state(chunks: list[Any]) -> dict[str, Any]:
    """Model tensors keep their bare keys (the keys convert/ writes) with one chunk; with virtual pipeline
    stages each chunk is a sub-dict model0, model1, ... (the sharded keys inside are global either way)."""
    sds = [unwrap(c).sharded_state_dict(metadata=SHARDING) for c in chunks]
    return sds[0] if len(sds) == 1 else {f"model{i}": sd for i, sd in enumerate(sds)}


def load_weights(path: Path, chunks: list[Any], optimizer: Any | None = None) -> None:
    """Model weights only (e.g. converted from HF): the optimizer starts fresh. Its fp32 main copy of the
    weights was taken when it was built, so it is refreshed here; without that, the first optimizer step
    would write the random initial weights (plus one update) back into the model."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    state = dist_checkpointing.load(_model_state(chunks), str(path), strict=StrictHandling.LOG_UNEXPECTED)
    _load_model(chunks, state)
    if optimizer is not None:
        optimizer.reload_model_params()


def load(path: Path, chunks: list[Any], optimizer: Any, scheduler: Any) -> int:
    """Everything: model, optimizer (with its fp32 main weights), scheduler; returns the step to continue from."""
    from megatron.core import dist_checkpointing

    model_sd = _model_state(chunks)
    sharded = {**model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=SHARDING)}
    state = dist_checkpointing.load(sharded, str(path))
    optimizer_state = state.pop("optimizer")
    _load_model(chunks, state)
    optimizer.load_state_dict(optimizer_state)
    common = dist_checkpointing.load_common_state_dict(str(path))
    scheduler.load_state_dict(common["scheduler"])
    return int(common["iteration"])


def _load_model(chunks: list[Any], state: dict[str, Any]) -> None:
    for key in ("optimizer", "scheduler", "iteration"):  # load() also returns the checkpoint's common state
        state.pop(key, None)
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(state)
    else:
        for i, c in enumerate(chunks):
            unwrap(c).load_state_dict(state[f"model{i}"])
