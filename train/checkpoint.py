"""Distributed (torch_dist) checkpoints: iter_N/ directories, a latest tracker written atomically after the
checkpoint is complete (every rank's part, also for asynchronous saves), keep-last-N retention. Loading an HF-converted checkpoint (tracker `release`) for
fine-tuning takes the weights only.

A LoRA run (train/lora.py) saves and resumes only its adapters (`<layer>.adapter.lora_a/b`), their optimizer state,
the scheduler and the step, with `lora.json` (rank, alpha, targets, the base checkpoint) in each iteration
directory; the frozen base comes from checkpoint.load at every start (load_base)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mcorekit.train.lora import is_adapter_key

log = logging.getLogger("mcorekit.train")

TRACKER = "latest_checkpointed_iteration.txt"
LORA_JSON = "lora.json"  # in a LoRA checkpoint's iteration directory: what convert/lora.py needs to export it
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
            if (info := lora_info(chunks)) is not None:
                (path / LORA_JSON).write_text(json.dumps(info, indent=2) + "\n")
        dist.barrier()
        sync_params(chunks)
        model_sd = _model_state(chunks, ADAPTERS if lora_info(chunks) else ALL)
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
            if (path / LORA_JSON).is_file():
                size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                log.warning("saved LoRA checkpoint %s: %.2f MB (adapters, their optimizer state, scheduler, step)",
                            path, size / 1e6)
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


ALL, BASE, ADAPTERS = "all", "base", "adapters"


def lora_info(chunks: list[Any]) -> dict[str, Any] | None:
    """What train/build.py recorded on a LoRA model (None for full fine-tuning)."""
    return getattr(unwrap(chunks[0]), "mcorekit_lora", None)


def _model_state(chunks: list[Any], part: str = ALL) -> dict[str, Any]:
    """Model tensors keep their bare keys (the keys convert/ writes) with one chunk; with virtual pipeline
    stages each chunk is a sub-dict model0, model1, ... (the sharded keys inside are global either way).
    `part`: every tensor, the base model's only, or the LoRA adapters' only."""
    sds = [_part(unwrap(c).sharded_state_dict(metadata=SHARDING), part) for c in chunks]
    return sds[0] if len(sds) == 1 else {f"model{i}": sd for i, sd in enumerate(sds)}


def _part(sd: dict[str, Any], part: str) -> dict[str, Any]:
    if part == ALL:
        return sd
    return {k: v for k, v in sd.items() if is_adapter_key(k) == (part == ADAPTERS)}


def load_base(path: Path, chunks: list[Any]) -> None:
    """A LoRA run's frozen base model from a full checkpoint (a converted `release`, or a run's iteration), every
    start; no optimizer state (the base has none)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    state = dist_checkpointing.load(_model_state(chunks, BASE), str(path), strict=StrictHandling.LOG_UNEXPECTED)
    _load_model(chunks, state, BASE)


def load_adapters(path: Path, chunks: list[Any], optimizer: Any | None = None) -> None:
    """Adapter weights only (e.g. a PEFT adapter converted by `mcorekit convert hf-to-mcore --lora`): the optimizer
    starts fresh, its fp32 main copy refreshed from them."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(_model_state(chunks, ADAPTERS), str(path))
    _load_model(chunks, state, ADAPTERS)
    if optimizer is not None:
        optimizer.reload_model_params()


def load_weights(path: Path, chunks: list[Any], optimizer: Any | None = None) -> None:
    """Model weights only (e.g. converted from HF): the optimizer starts fresh. Its fp32 main copy of the
    weights was taken when it was built, so it is refreshed here; without that, the first optimizer step
    would write the random initial weights (plus one update) back into the model."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if lora_info(chunks) is not None:  # the base was loaded by build (load_base), the adapters start as built
        return
    state = dist_checkpointing.load(_model_state(chunks), str(path), strict=StrictHandling.LOG_UNEXPECTED)
    _load_model(chunks, state)
    if optimizer is not None:
        optimizer.reload_model_params()


def load(path: Path, chunks: list[Any], optimizer: Any, scheduler: Any) -> int:
    """Everything: model, optimizer (with its fp32 main weights), scheduler; returns the step to continue from.
    A LoRA model loads its adapters only (the base came from checkpoint.load in build)."""
    from megatron.core import dist_checkpointing

    part = ADAPTERS if lora_info(chunks) is not None else ALL
    if part == ADAPTERS and not (path / LORA_JSON).is_file():
        from mcorekit.errors import ConfigError

        raise ConfigError(f"{path} is not a LoRA checkpoint (no {LORA_JSON}); a peft.lora run resumes only from its "
                          f"own checkpoints: give the base model as checkpoint.load with checkpoint.finetune=true, "
                          f"or a converted `release`")
    model_sd = _model_state(chunks, part)
    sharded = {**model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=SHARDING)}
    state = dist_checkpointing.load(sharded, str(path))
    optimizer_state = state.pop("optimizer")
    _load_model(chunks, state, part)
    optimizer.load_state_dict(optimizer_state)
    common = dist_checkpointing.load_common_state_dict(str(path))
    scheduler.load_state_dict(common["scheduler"])
    return int(common["iteration"])


def _load_model(chunks: list[Any], state: dict[str, Any], part: str = ALL) -> None:
    for key in ("optimizer", "scheduler", "iteration"):  # load() also returns the checkpoint's common state
        state.pop(key, None)
    for i, c in enumerate(chunks):
        _load_part(unwrap(c), state if len(chunks) == 1 else state[f"model{i}"], part)


def _load_part(model: Any, state: dict[str, Any], part: str) -> None:
    """load_state_dict, strict for the part asked: what it leaves out must be exactly the other part."""
    if part == ALL:
        model.load_state_dict(state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    wrong = [k for k in missing if is_adapter_key(k) == (part == ADAPTERS) and not k.endswith("_extra_state")]
    if wrong or unexpected:
        raise RuntimeError(f"loading the {part} part: missing {wrong[:4]}, unexpected {list(unexpected)[:4]}")
