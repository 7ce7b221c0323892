"""How a checkpoint's tensors reach the disk: Megatron-Core's torch_dist writer (save_strategy), fed one tensor at a
time from the GPU for a save written now (stage_per_tensor), or on a thread of this process for a background save
(WriterThread, in Megatron-Core's queue of async saves: background_writes), staged first on the GPU where it has room
(room_on_gpu, snapshot_on_gpu) or in pinned host memory. train/checkpoint.Saver decides which, and when."""

from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from mcorekit.outputs import WRITEBACK_BYTES, start_writeback, without_crc32


@contextmanager
def stage_per_tensor(request: Any, writeback: bool = True, after: Any = None) -> Iterator[Any]:
    """A synchronous save's request with each tensor copied to host memory as the writer reaches it, instead of
    Megatron-Core's staging of the whole checkpoint in pinned host memory first (which on one H200 took longer than
    writing: pinning 37 GB of pages, then unpinning them at exit, 13 s after the save had ended). The copy of the next
    tensor runs on a side stream while the writer writes this one (copied_ahead), so the disk is not left idle during
    the copies. Host memory holds a few tensors per writer thread, not the checkpoint. Same files, same bytes.

    With `writeback`, what the writer has written so far is handed to the kernel's writeback every WRITEBACK_BYTES
    (between two tensors), so the disk writes while the next tensors are copied and serialized rather than at the
    writer's closing fsync, as convert/'s writers do; a file that cannot be opened for the hint is written without.
    On leaving the block every stager is closed (a write that failed half-way leaves one paused, holding its file
    and the tensors it was given, until the garbage collector, which the writer disables, would find it). `after`:
    see copied_ahead."""
    stage = request.preload_fn  # partial(FileSystemWriterAsync.preload_tensors, write_buckets, non_blocking)
    if stage is None:
        yield request
        return
    buckets, stagers = stage.args[0], []

    def one_at_a_time(file_name: str, tensors: list[Any]) -> Iterator[Any]:
        fd, handed = -1, 0
        copies = copied_ahead(tensors, after)
        try:
            for item, tensor in copies:
                if writeback and fd < 0:
                    try:  # the writer has opened (created) it before it asks for its first tensor
                        fd = os.open(file_name, os.O_RDONLY)
                    except OSError:
                        pass
                elif fd >= 0 and (size := os.fstat(fd).st_size) - handed >= WRITEBACK_BYTES:
                    start_writeback(fd, handed, size - handed)
                    handed = size
                yield item, tensor
        finally:
            copies.close()
            if fd >= 0:
                os.close(fd)

    def preload() -> list[Any]:
        staged = [(file, key, (blobs, one_at_a_time(file, tensors))) for file, key, (blobs, tensors) in buckets]
        stagers.extend(tensors for _, _, (_, tensors) in staged)
        return staged

    try:
        yield request._replace(preload_fn=preload)
    finally:
        for stager in stagers:
            stager.close()


COPY_STREAMS: dict[Any, Any] = {}


def copy_stream(device: Any) -> Any:
    """This process's stream for the copies to host memory on `device`, made once, at high priority. torch hands
    out its streams from pools of 32 in turn: a stream made for every save would sooner or later be the one training
    runs on (train/step_graph's capture stream, default priority), and the copies would queue behind the steps (on
    one H200, 64 copies of 64 MB took 5.3 s behind training work against 0.17 s on a stream of their own) or break
    a graph capture under way."""
    import torch

    if device not in COPY_STREAMS:
        COPY_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return COPY_STREAMS[device]


def copied_ahead(tensors: list[Any], after: Any = None) -> Iterator[Any]:
    """(item, tensor in host memory) for each (item, tensor), in order. A GPU tensor's copy is started on a side
    stream (copy_stream) when the tensor before it is handed out, into pinned memory from torch's caching host
    allocator: the copy engine copies tensor i+1 while the writer writes tensor i. Three blocks are alive at a time (the
    one being written, the one being copied, the next one's), each rounded up to a power of two by the allocator, which
    keeps them for later tensors and later saves (pinned once per size, not per save; handed back at exit, shutdown.py).
    A tensor's layout is the GPU tensor's (empty_like), as `tensor.to("cpu")` gives. Host tensors are handed out as they
    are. The first copy starts after everything queued on the GPU so far (the tensors' last writes, on any stream), or,
    given the CUDA event `after`, once that has happened (a snapshot's copies, snapshot_on_gpu)."""
    import torch

    stream = None

    def start(item: Any, tensor: Any) -> tuple[Any, Any, Any]:
        nonlocal stream
        if not tensor.is_cuda:
            return item, tensor, None
        if stream is None:
            torch.cuda.set_device(tensor.device)  # a writer thread of its own starts on GPU 0 (a context there)
            if after is None:
                torch.cuda.synchronize()
            stream = copy_stream(tensor.device)
            if after is not None:
                stream.wait_event(after)
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return item, host, done

    def finish(item: Any, host: Any, done: Any) -> tuple[Any, Any]:
        if done is not None:
            done.synchronize()
        return item, host

    ahead = None  # the copy started and not yet handed out
    try:
        for item, tensor in tensors:
            started = start(item, tensor)
            if ahead is not None:
                ready, ahead = ahead, started
                yield finish(*ready)
            else:
                ahead = started
        if ahead is not None:
            ready, ahead = ahead, None
            yield finish(*ready)
    finally:  # closed early (a failed write): the copy under way ends before its source may be reused
        if ahead is not None and ahead[2] is not None:
            ahead[2].synchronize()


@contextmanager
def results_queue() -> Iterator[None]:
    """Where Megatron-Core's writer hands a save's results back: a module-level queue that each save's writer keeps,
    which Megatron-Core makes a multiprocessing Manager's queue (for a writer in a forked process; it spawns the
    Manager's server process for it, and multiprocessing stops that at exit: 0.79 s of a finished run's exit on one
    H200 at `9a56802`). Our writers are threads of this process, so an ordinary queue."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    before, filesystem_async._results_queue = filesystem_async._results_queue, queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = before


def background_writes() -> Any:
    """Megatron-Core's queue of background saves (one in flight: a save is finalized once every rank's writer is
    done, checked with one all-reduce per poll), each save written by a WriterThread; between_steps() is called
    before every step. It keeps what room_on_gpu judges by, and where the last save was staged ("gpu", "host")."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    class ThreadWrites(AsyncCallsQueue):
        steps_run = 0  # by this process
        steps_peak = 0  # the most GPU memory the steps have reserved, as far as it is known (room_on_gpu)
        copy_bytes = 0  # the largest copy staged on the GPU so far
        allocated_between_steps = 0
        staged_on: str | None = None

        def _get_async_caller(self) -> Any:
            return WriterThread(self)

        def between_steps(self) -> None:
            import torch

            self.steps_run += 1
            if torch.cuda.is_available():
                self.allocated_between_steps = torch.cuda.memory_allocated()

    return ThreadWrites()


def room_on_gpu(nbytes: int, queue: Any) -> bool:
    """Whether a copy of `nbytes` fits on this GPU beside the steps for as long as it is written: once this process
    has run the step graph's capture (the steps' peak is known then), if the memory outside torch's allocator
    (CUDA context, NCCL, cuBLAS workspaces), the steps' peak reservation, what the save holds beside the steps
    (memory allocated since the last step began: FP8 weights dequantized for the checkpoint, say), the copy and a
    margin of 1/16 of the GPU (at least 2 GiB; a validation pass or a new communicator may come meanwhile) fit.
    The peak is the largest reservation seen less the largest copy (a copy released stays in torch's cache, where a
    step may take it back; snapshot_on_gpu refuses a copy that had to flush the cache to fit)."""
    import torch

    from mcorekit.train.step_graph import WARMUP_STEPS

    if queue.steps_run <= WARMUP_STEPS + 1:
        return False
    queue.steps_peak = max(queue.steps_peak, torch.cuda.max_memory_reserved() - queue.copy_bytes)
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    beside = max(0, torch.cuda.memory_allocated() - queue.allocated_between_steps)
    return outside + queue.steps_peak + beside + nbytes + max(2 << 30, total // 16) <= total


def snapshot_on_gpu(buckets: list[Any]) -> tuple[list[Any], Any] | None:
    """The write buckets with each GPU tensor replaced by a copy on the GPU (empty_like's layout, as clone keeps
    it), queued on the current stream behind the steps that wrote the tensors, and the CUDA event after the copies.
    The next step may change the tensors as soon as it is queued: the writer reads the copies. Host tensors are
    kept as they are, as Megatron-Core's staging keeps them. None, the copies dropped, when the allocator ran out of
    memory or had to hand back its cached blocks to find it (the steps would have to allocate theirs again beside
    the copy)."""
    import torch

    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    try:
        copied = [(file, key, (blobs, [(item, t.clone() if t.is_cuda else t) for item, t in tensors]))
                  for file, key, (blobs, tensors) in buckets]
    except torch.OutOfMemoryError:
        return None
    if torch.cuda.memory_stats().get("num_alloc_retries", 0) > retries:
        return None
    done = torch.cuda.Event()
    done.record()
    return copied, done


def gpu_bytes(buckets: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for _, _, (_, tensors) in buckets for _, t in tensors if t.is_cuda)


class WriterThread:
    """Writes one background save on a thread of this process, where Megatron-Core's TemporalAsyncCaller forks a
    process. Before training goes on, the save is staged: where the GPU has room for a copy of its GPU tensors
    (room_on_gpu), that copy is made on the GPU (snapshot_on_gpu: a device-to-device copy, queued, nothing waited
    for) and the thread copies each tensor to host memory as it writes it, as a synchronous save does
    (stage_per_tensor); otherwise the whole save is staged in pinned host memory first (Megatron-Core's staging,
    which the loop waits for). On one H200, 3B shape (36.6 GB; 2026-12-03, `397c5af`, bench/async_save.py): staged
    on the GPU the loop blocked 0.5-0.6 s per save and the process ended 0.63 s after its last save; staged in
    pinned host memory 9.5 s the first time, 1.1 s later, and 3.5 s at the end (handing back the pinned pages;
    14.0 s and 2.4 s at `0fb8253`, another machine). The GPU-staged write took longer beside the steps (43 against
    33 s for the first save); why is not known.

    The writes release the GIL. Megatron-Core's writer switches the garbage collector off while it writes (for the
    whole process now; it switches it back on). The staged copy is released by close(), on the training thread:
    the last reference dropped on the writer thread would hand the pinned blocks back there, with CUDA events
    recorded on the stream the copies ran on, possibly while the training thread captures a CUDA graph on it. The
    methods are those AsyncCallsQueue calls, each on every rank."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self.thread: threading.Thread | None = None
        self.staged: Any = None

    def schedule_async_call(self, request: Any) -> None:
        if request.async_fn is None:
            return
        args, after, stage, copy = list(request.async_fn_args), None, request.preload_fn, None
        if stage is not None and (size := gpu_bytes(stage.args[0])) and room_on_gpu(size, self.queue):
            copy = snapshot_on_gpu(stage.args[0])
        if copy is not None:
            self.staged, after = copy
            request = request._replace(preload_fn=functools.partial(stage.func, self.staged, *stage.args[1:]))
            self.queue.staged_on, self.queue.copy_bytes = "gpu", max(self.queue.copy_bytes, size)
        elif stage is not None:  # the whole checkpoint into pinned host memory, before training goes on
            args[1] = self.staged = stage()
            request = request._replace(preload_fn=None)
            self.queue.staged_on = "host"

        def write() -> None:
            with without_crc32(), stage_per_tensor(request, after=after) as staged:
                if staged.preload_fn is not None:
                    args[1] = staged.preload_fn()
                request.async_fn(*args, **request.async_fn_kwargs)

        self.thread = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCaller

        alive = self.thread is not None and self.thread.is_alive()
        if not no_dist:  # done only when done on every rank: Megatron-Core's all-reduce of the flags (self unused)
            alive = not AsyncCaller.sync_all_async_calls(self, int(alive))
        if alive and not blocking:
            return False
        self.close()
        return True

    def close(self, abort: bool = False) -> None:
        if self.thread is not None:
            self.thread.join()  # a failed write has put its exception in the results queue: finalize raises it
            self.thread = None
        self.staged = None  # a GPU copy is free to reuse now: the thread waited for each of its copies to host


def save_strategy() -> Any:
    """Megatron-Core's torch_dist writer (the format every torch_dist reader loads). With data parallelism the
    writing is spread over the data-parallel ranks (Megatron-LM's default fully parallel save): each rank writes
    its share of the replicated tensors instead of DP rank 0 writing them all. One writer thread per rank: torch.save
    holds the GIL while it copies and checksums, so more threads do not write faster (Megatron-LM's sync default)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy()
    group = ps.get_data_parallel_group(with_context_parallel=True)
    if group.size() > 1:
        return FullyParallelSaveStrategyWrapper(strategy, group)
    return strategy
