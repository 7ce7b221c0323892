"""How a finished training process ends: torch's compile workers stopped while the final checkpoint is written,
then the run's teardown (shut_down), then an exit without the interpreter's finalization: at once (leave, for
`python -m mcorekit.train`) or once submitit's runner has saved the job's result (leave_after_runner)."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path

_stopping_compile_workers: threading.Thread | None = None
STORE_TIMEOUT_S = 60.0  # how long a rank waits for the others at the end of a run, then warns and leaves


def stop_compile_workers() -> None:
    """After the last step nothing is compiled: stop torch's compile-worker processes (Megatron-Core's torch.compile'd
    fusions and the FP8 experts' quantization start them) on a thread while the final checkpoint is written. Stopped
    at exit instead, they held finished runs 1.2-2.3 s after their final save on one H200 (2026-12-02)."""
    global _stopping_compile_workers
    if "torch._inductor.async_compile" not in sys.modules:
        return  # nothing was compiled: no workers (and no 0.5 s import to stop none)
    from torch._inductor.async_compile import shutdown_compile_workers

    _stopping_compile_workers = threading.Thread(target=shutdown_compile_workers, daemon=True)
    _stopping_compile_workers.start()
    # whoever ends this process (shut_down, a job payload calling train(), an exception): torch's own exit handler
    # must not shut the pool down while the thread does. Exit handlers run last registered first: this joins first.
    atexit.register(_stopping_compile_workers.join)


def shut_down() -> None:
    """The end of a finished run, timed (epoch seconds, as the checkpoint lines' `end`). On an H200 (3B shape) the
    process lived on 13.1 s after its final save at `12cf9e3`, mostly unpinning the host copy Megatron-Core's writer
    had staged the checkpoint in; 2.6 s at `916c1d7`, of which destroying the process groups (NCCL's graceful
    teardown of each communicator) took 1.75 s. An async save still stages in pinned memory, which is released here.
    The process groups are not destroyed: the process leaves next (leave), and its exit frees them; the ranks only
    make sure that none is still inside a collective (ranks_through). Then what the interpreter's exit would do
    first: join the non-daemon threads, run the exit handlers (atexit); leave() skips only what comes after them.
    One handler stops torch's compile workers, which hold this process's stdout and stderr, if stop_compile_workers
    has not. A process that goes on to the interpreter's exit instead (a failing submitit runner; a caller that
    does not leave) destroys its process groups there: an exit handler registered here, which leave() skips. After
    it the process is shutting down as far as Python's threading is concerned: code that still runs (submitit's
    runner saving the result) may not start thread pools."""
    import torch
    import torch.distributed as dist

    marks = {"trained": time.time()}
    if _stopping_compile_workers is not None:
        _stopping_compile_workers.join()
    release = getattr(torch._C, "_host_emptyCache", None)  # torch's cache of pinned host memory
    if release is not None:
        release()
        marks["host_cache_released"] = time.time()
    dist.barrier()
    rank = dist.get_rank()
    ranks_through()
    marks["ranks_through"] = time.time()
    threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit: non-daemon threads end first
    atexit._run_exitfuncs()
    atexit.register(destroy_process_groups)
    marks["exit_handlers"] = time.time()
    if rank == 0:
        print("mcorekit.train: shutdown " + json.dumps({k: round(v, 3) for k, v in marks.items()}), flush=True)


def ranks_through() -> None:
    """Return once every rank is through the final barrier, so that a rank may exit without destroying its process
    groups: each rank's barrier has finished on its GPU, but a peer's may still be finishing and reading this
    rank's buffers, and exiting then could fail that peer. Counted on the rendezvous store (one counter, one key
    that the last rank through sets; each rank waits for that key)."""
    _count_on_store("through", every_rank=True)


def last_out() -> None:
    """Right before a rank exits: the other ranks post that they are leaving, and rank 0 waits for them all. Rank 0's
    process serves the store of the `tcp://` rendezvous (runtime/env.init_process_group); exiting before another
    rank's last request to it (ranks_through's wait, this post) is answered would fail that rank, and torch's NCCL
    monitor threads, which poll the store until the process ends, would log that it went away."""
    _count_on_store("left", every_rank=False)


def _count_on_store(name: str, every_rank: bool) -> None:
    """Ranks count themselves on the default store under `name` (every rank, or every rank but 0); the last one in
    sets `name`/done. Every rank (every_rank) or rank 0 alone waits for it. No-op without a group of 2 ranks or more.
    A store that fails, or a rank that does not come within STORE_TIMEOUT_S (gone), only warns: the work is saved."""
    if "torch.distributed" not in sys.modules:
        return  # no process group in this process (and no torch import to find that out)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from datetime import timedelta

    rank, counted = dist.get_rank(), dist.get_world_size() - (0 if every_rank else 1)
    try:
        store = dist.distributed_c10d._get_default_store()
        if every_rank or rank:
            if store.add(f"mcorekit/{name}", 1) == counted:
                store.set(f"mcorekit/{name}/done", "1")
        if every_rank or not rank:
            store.wait([f"mcorekit/{name}/done"], timedelta(seconds=STORE_TIMEOUT_S))
    except Exception as e:  # noqa: BLE001  # the store's errors (RuntimeError, DistStoreError, DistNetworkError)
        print(f"mcorekit.train: warning: not every rank reported the end of the run ({name}: {e}); leaving anyway",
              file=sys.stderr, flush=True)


def destroy_process_groups() -> None:
    """For a process that ends through the interpreter (its finalization would otherwise meet live NCCL groups)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave(code: int) -> None:
    """Exit a finished run (after shut_down) without the interpreter's finalization: freeing every module and
    tensor and CUDA's context took most of the 4.45 s the 3B run lived on after its last save, holding the job and
    its afterok children. Nothing is lost by skipping it: the checkpoint is complete, metrics and loggers closed, no
    rank inside a collective (the process groups go with the process), non-daemon threads joined and the exit
    handlers run (shut_down, in the interpreter's order); output, Python's and the C library's, is flushed here. An
    exit handler left out (torch's compile workers, which keep our stdout open) kept a benchmark's pipe open after
    such an exit: shut_down runs them all first."""
    import ctypes

    last_out()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # what C and C++ code wrote through stdio, which os._exit does not flush
    os._exit(code)


def exit_with(code: int) -> None:
    """`python -m mcorekit.train`'s last line: a finished run (0, after shut_down) leaves; a failure exits as usual."""
    if code == 0:
        leave(code)
    sys.exit(code)


def leave_after_runner(result: Path | None) -> None:
    """Inside submitit's runner (`mcorekit launch`'s payload, train/job.py), after shut_down: the runner saves the
    job's result (`result`, its pickle) once the payload returns, so leave() runs as an exit handler, when the runner
    is done; shut_down ran the others, so only handlers registered later run before it. It leaves only if the result
    was saved and no exception is on its way out: a failing runner keeps the interpreter's exit and its code (a
    SystemExit leaves no trace for an exit handler: before the result is saved, its code is kept too).
    None (not under submitit): the ordinary exit (shut_down's exit handler destroys the process groups)."""
    if result is None:
        return

    def leave_once_saved() -> None:
        if result.exists() and getattr(sys, "last_exc", None) is None and getattr(sys, "last_value", None) is None:
            leave(0)

    atexit.register(leave_once_saved)
