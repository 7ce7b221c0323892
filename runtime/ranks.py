"""Decisions every rank must share: a flag any rank raises, and a choice rank 0 makes for all."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is on any rank: one tiny all-reduce (the flag itself without a process group)."""
    if not _distributed():
        return flag
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([1 if flag else 0], device=device, dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def rank_zero_choice(choose: Callable[[], T]) -> T:
    """What choose() returns on rank 0, on every rank (choose runs on rank 0 only; one small broadcast). For what is
    read from a shared file system, which the nodes may see differently (NFS caches a listing or a file's absence):
    each rank choosing for itself could resume a different checkpoint. An exception on rank 0 is raised on every
    rank instead of leaving the others waiting in the broadcast."""
    if not _distributed():
        return choose()
    import torch.distributed as dist

    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("value", choose())
        except Exception as e:  # noqa: BLE001 - handed to every rank and raised there
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]  # type: ignore[misc]
    if kind == "error":
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]
