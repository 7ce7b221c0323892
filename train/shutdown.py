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
    had staged the checkpoint in; with a synchronous save staged per tensor (train/checkpoint.stage_per_tensor) 6.2 s
    at `df9f463`: nothing to release, process-group teardown 1.7 s, interpreter exit 4.45 s. An async save still
    stages in pinned memory, which is released here. Then what the interpreter's exit would do first: join the
    non-daemon threads, run the exit handlers (atexit); leave() skips only what comes after them. One handler stops
    torch's compile workers, which hold this process's stdout and stderr, if stop_compile_workers has not. After it
    the process is shutting down as far as Python's threading is concerned: code that still runs (submitit's runner
    saving the result) may not start thread pools."""
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
    dist.destroy_process_group()
    marks["destroyed"] = time.time()
    threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit: non-daemon threads end first
    atexit._run_exitfuncs()
    marks["exit_handlers"] = time.time()
    if rank == 0:
        print("mcorekit.train: shutdown " + json.dumps({k: round(v, 3) for k, v in marks.items()}), flush=True)


def leave(code: int) -> None:
    """Exit a finished run (after shut_down) without the interpreter's finalization: freeing every module and
    tensor and CUDA's context took most of the 4.45 s the 3B run lived on after its last save, holding the job and
    its afterok children. Nothing is lost by skipping it: the checkpoint is complete, metrics and loggers closed,
    non-daemon threads joined and the exit handlers run (shut_down, in the interpreter's order); output, Python's and
    the C library's, is flushed here. An exit handler left out (torch's compile workers, which keep our stdout open)
    kept a benchmark's pipe open after such an exit: shut_down runs them all first."""
    import ctypes

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
    None (not under submitit): the ordinary exit."""
    if result is None:
        return

    def leave_once_saved() -> None:
        if result.exists() and getattr(sys, "last_exc", None) is None and getattr(sys, "last_value", None) is None:
            leave(0)

    atexit.register(leave_once_saved)
