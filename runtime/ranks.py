"""Decisions every rank must share: a flag any rank raises, and a choice rank 0 makes for all."""

from __future__ import annotations

import sys
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def _distributed() -> bool:
    """A process group of more than one rank is up. A process that never imported torch.distributed has none, and
    is not made to import torch here (seconds): a payload without torch stopping on TERM must exit within Slurm's
    KillWait (5 s on the dev cluster), or it is killed before it says why it stopped."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> str:
    """Where a collective's tensor lives: the GPU under NCCL, the CPU under gloo (tests, CPU tools)."""
    import torch.distributed as dist

    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def any_rank(flag: bool, group: Any = None) -> bool:
    """True on every rank (of `group`, default all) when `flag` is on any of them: one tiny all-reduce (the flag
    itself without a process group)."""
    if not _distributed():
        return flag
    import torch
    import torch.distributed as dist

    value = torch.tensor([1 if flag else 0], device=collective_device(), dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def rank_zero_choice(choose: Callable[[], T]) -> T:
    """What choose() returns on rank 0, on every rank (choose runs on rank 0 only; one small broadcast). For what is
    read from a shared file system, which the nodes may see differently (NFS caches a listing or a file's absence):
    each rank choosing for itself could resume a different checkpoint. An exception on rank 0 stops every rank
    instead of leaving the others waiting in the broadcast: rank 0 raises it, the others an MCoreKitError with its
    text (only the text travels: any exception pickles as that)."""
    if not _distributed():
        return choose()
    import torch.distributed as dist

    from mcorekit.errors import MCoreKitError

    box: list[object] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("value", choose())
        except Exception as e:  # noqa: BLE001 - every rank stops on it
            error, box[0] = e, ("error", f"rank 0: {e}")
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]  # type: ignore[misc]
    if error is not None:
        raise error
    if kind == "error":
        raise MCoreKitError(value)
    return value  # type: ignore[return-value]
