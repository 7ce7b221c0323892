"""Distributed (torch_dist) checkpoints: iter_N/ directories, a latest tracker written atomically after the
checkpoint is complete, keep-last-N retention. Loading an HF-converted checkpoint (tracker `release`) for
fine-tuning takes the weights only."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"
# fully_reshardable: the optimizer state is stored per model parameter, so a checkpoint resumes at another
# TP/PP/DP layout (saving gathers it over DP; dp_reshardable would be faster but fixes the layout).
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False}


def iter_dir(root: Path, step: int) -> Path:
    return root / f"iter_{step:07d}"


def latest(root: Path) -> Path | None:
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    value = tracker.read_text().strip()
    path = root / value if value == "release" else iter_dir(root, int(value))
    return path if (path / "metadata.json").is_file() else None


def unwrap(model: Any) -> Any:
    """The GPTModel inside DDP / Float16Module: its keys are the checkpoint's (and convert/'s) keys."""
    while hasattr(model, "module"):
        model = model.module
    return model


def save(root: Path, step: int, model: Any, optimizer: Any, scheduler: Any, keep_last: int) -> Path:
    from megatron.core import dist_checkpointing

    model = unwrap(model)

    path = iter_dir(root, step)
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # a half-written one from an interrupted save
        path.mkdir(parents=True)
    dist.barrier()
    model_sd = model.sharded_state_dict(metadata=SHARDING)
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=SHARDING),
             "scheduler": scheduler.state_dict(),
             "iteration": step}
    dist_checkpointing.save(_flatten(state), str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = root / (TRACKER + ".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, root / TRACKER)  # only now is this the latest checkpoint
        done = sorted(p for p in root.glob("iter_*") if p != path)
        for old in done[: max(0, len(done) - (keep_last - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load(path: Path, model: Any, optimizer: Any | None, scheduler: Any | None) -> int:
    """Load into the model (and optimizer/scheduler unless fine-tuning); returns the step to continue from."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    model = unwrap(model)
    model_sd = model.sharded_state_dict(metadata=SHARDING)
    if optimizer is None:  # weights only (e.g. converted from HF), fresh optimizer
        state = dist_checkpointing.load(_flatten({"model": model_sd}), str(path), strict=StrictHandling.LOG_UNEXPECTED)
        model.load_state_dict(_unflatten(state)["model"])
        return 0
    sharded = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=SHARDING)}
    state = _unflatten(dist_checkpointing.load(_flatten(sharded), str(path)))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    common = dist_checkpointing.load_common_state_dict(str(path))
    scheduler.load_state_dict(common["scheduler"])
    return int(common["iteration"])


def _flatten(state: dict[str, Any]) -> dict[str, Any]:
    """Model tensors keep their bare keys (the keys convert/ writes); other parts are namespaced."""
    out = dict(state.pop("model"))
    out.update(state)
    return out


def _unflatten(state: dict[str, Any]) -> dict[str, Any]:
    rest = {k: state.pop(k) for k in ("optimizer", "scheduler", "iteration") if k in state}
    return {"model": state, **rest}

