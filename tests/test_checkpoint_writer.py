"""A synchronous save as train/checkpoint.Saver writes it (no CRC-32s, each tensor staged by the writer just
before it is written) is the checkpoint Megatron-Core's own writer makes: the same files and .metadata, the same
bytes apart from the CRC fields, loaded bitwise by Megatron-Core's dist_checkpointing.load and by convert/'s reader.
On CPU with one gloo rank (the GPU copy that the staging does on a GPU node is the identity here)."""

from __future__ import annotations

import functools
import os
import re

from pathlib import Path
from typing import Any

import pytest
import torch

from mcorekit.outputs import without_crc32
from mcorekit.train.checkpoint_writer import results_queue, save_strategy, stage_per_tensor


@pytest.fixture(autouse=True)
def _finalize_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-Core's finalize broadcasts its failure flag from a tensor on torch.cuda.current_device(): without a
    GPU that one call is pointed at the CPU (the gloo rank broadcasts it from there; gloo broadcasts CUDA tensors
    too, so the GPU machine keeps the real device, which the staging's stream needs)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def _state(device: str = "cpu") -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    g = torch.Generator().manual_seed(0)
    tensors = {"w.bf16": torch.randn(64, 48, generator=g).bfloat16(), "m.fp32": torch.randn(3000, generator=g),
               "e.int": torch.arange(17, dtype=torch.int64), "view.fp32": torch.randn(8, 10, generator=g)[:, 2:7],
               "t.fp32": torch.randn(6, 9, generator=g).t()}
    state = {k: ShardedTensor.from_rank_offsets(k, t.to(device), replica_id=0) for k, t in tensors.items()}
    state["rng"] = ShardedObject("rng", {"seed": 1234, "state": torch.arange(4)}, (1,), (0,), replica_id=0)
    state["iteration"] = 7
    return state


def _save(path: Path, ours: bool, state: dict | None = None) -> None:
    from megatron.core import dist_checkpointing

    path.mkdir()
    if ours:
        with without_crc32(), results_queue():
            request = dist_checkpointing.save(state or _state(), str(path), sharded_strategy=save_strategy(),
                                              async_sharded_save=True, async_strategy="mcore")
            with stage_per_tensor(request) as staged:
                staged.execute_sync()
    else:  # Megatron-Core's own staging and writing; its copy to pinned memory needs CUDA, so a plain copy here
        request = dist_checkpointing.save(_state(), str(path), sharded_strategy=save_strategy(),
                                          async_sharded_save=True, async_strategy="mcore")
        stage = request.preload_fn
        request._replace(preload_fn=functools.partial(stage.func, stage.args[0], False)).execute_sync()


def _without_save_ids(data: bytes) -> bytes:
    """The bytes with each torch.save record's serialization id (digits unique to every save) zeroed."""
    return re.sub(rb"(\.data/serialization_id(?:FB[\s\S]{2}Z*)?)(\d+)(?=PK\x07\x08)",
                  lambda m: m[1] + b"0" * len(m[2]), data)


def _without_crcs(data: bytes) -> bytes:
    """The bytes with every zip CRC-32 field (local headers, data descriptors, central directory) zeroed."""
    out = bytearray(data)
    for sig, at in ((b"PK\x03\x04", 14), (b"PK\x07\x08", 4), (b"PK\x01\x02", 16)):
        i = out.find(sig)
        while i >= 0:
            out[i + at:i + at + 4] = b"\0\0\0\0"
            i = out.find(sig, i + 4)
    return bytes(out)


def test_saver_writer_matches_megatron_writer(model_parallel: None, tmp_path: Path) -> None:
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    _save(tmp_path / "megatron", ours=False)
    _save(tmp_path / "ours", ours=True)
    names = sorted(p.name for p in (tmp_path / "megatron").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert torch.serialization.get_crc32_options()  # restored after the save
    for name in names:
        a, b = (tmp_path / "megatron" / name).read_bytes(), (tmp_path / "ours" / name).read_bytes()
        if name.endswith(".distcp"):
            assert a != b  # Megatron-Core's has CRCs, ours has none
            assert _without_save_ids(b) != b, name  # every save's ids were found and masked
            assert _without_crcs(_without_save_ids(a)) == _without_save_ids(b), name
            assert _without_crcs(b) == b, name  # ours: every CRC field already 0
        elif name == ".metadata":  # the same apart from each save's own id and folder
            ma, mb = (FileSystemReader(str(tmp_path / d)).read_metadata() for d in ("megatron", "ours"))
            assert ma.storage_meta.save_id != mb.storage_meta.save_id
            ma.storage_meta = mb.storage_meta = None
            assert ma == mb
        elif name != "common.pt":  # common.pt is torch.save too: its CRCs differ the same way
            assert a == b, name
    template = _state()
    loaded = dist_checkpointing.load(_state(), str(tmp_path / "ours"))
    for key in ("w.bf16", "m.fp32", "e.int", "view.fp32"):
        assert torch.equal(loaded[key], template[key].data), key
        assert loaded[key].dtype == template[key].data.dtype
    assert loaded["rng"]["seed"] == 1234 and torch.equal(loaded["rng"]["state"], torch.arange(4))
    assert loaded["iteration"] == 7


def test_convert_reader_reads_crcless_checkpoint(model_parallel: None, tmp_path: Path) -> None:
    from mcorekit.convert.torch_dist import TorchDistReader

    _save(tmp_path / "ours", ours=True)
    reader = TorchDistReader(tmp_path / "ours")
    template = _state()
    for key in ("w.bf16", "m.fp32", "e.int", "view.fp32"):
        got = reader.read(key)
        assert got.dtype == template[key].data.dtype and torch.equal(got, template[key].data), key


@pytest.mark.parametrize("crc", [True, False])
def test_without_crc32_restores_the_setting(crc: bool) -> None:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        with without_crc32():
            assert torch.serialization.get_crc32_options() is False
        assert torch.serialization.get_crc32_options() is crc
    finally:
        torch.serialization.set_crc32_options(before)


def _save_with(path: Path, threads: int, writeback: bool, device: str = "cpu") -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    path.mkdir()
    with without_crc32(), results_queue():
        request = dist_checkpointing.save(_state(device), str(path), async_sharded_save=True, async_strategy="mcore",
                                          sharded_strategy=TorchDistSaveShardedStrategy(thread_count=threads))
        with stage_per_tensor(request, writeback) as staged:
            staged.execute_sync()


def _same_data_files(a: Path, b: Path) -> int:
    """Asserts two checkpoint folders hold the same files and the same .distcp bytes (save ids apart); returns how
    many .distcp files each holds."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    data = [n for n in names if n.endswith(".distcp")]
    for name in data:
        assert _without_save_ids((a / name).read_bytes()) == _without_save_ids((b / name).read_bytes()), name
    return len(data)


def _open_files(under: Path) -> set[str]:
    """The files under `under` this process holds open (on a GPU the first CUDA work opens driver files too)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (listdir's own descriptor)
            continue
        if target.startswith(str(under)):
            out.add(f"{fd} -> {target}")
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_writeback_hint_changes_no_byte_and_closes_its_files(model_parallel: None, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    from mcorekit.train import checkpoint_writer as checkpoint

    _save_with(tmp_path / "plain", threads, writeback=False)
    hints: list[tuple[int, int]] = []
    real = checkpoint.start_writeback
    monkeypatch.setattr(checkpoint, "WRITEBACK_BYTES", 1)  # a hint between every two tensors
    monkeypatch.setattr(checkpoint, "start_writeback", lambda fd, at, n: (hints.append((at, n)), real(fd, at, n)))
    _save_with(tmp_path / "hinted", threads, writeback=True)
    assert _open_files(tmp_path) == set()
    assert len(hints) >= 2 and all(n > 0 for _, n in hints)
    assert _same_data_files(tmp_path / "plain", tmp_path / "hinted") == threads


def test_failed_write_leaves_no_file_open(model_parallel: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails half-way (a full disk, say) fails the save and leaves neither its hint's file descriptor
    nor its staged tensors behind (the writer disables the garbage collector that would otherwise find them)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    real, calls = filesystem_async._write_item, []

    @functools.wraps(real)  # Megatron-Core passes serialization_format where the signature names it
    def fails_on_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(filesystem_async, "_write_item", fails_on_the_third)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="OSError"):
        _save_with(tmp_path / "full", 1, writeback=True)
    assert len(calls) == 3
    assert _open_files(tmp_path) == set()


def test_overlapping_without_crc32_blocks_restore_once_both_end() -> None:
    """Two saves' blocks that overlap (as on two threads: the first to start ends first) keep CRC-32s off until the
    last ends, then restore what was there before either."""
    before = torch.serialization.get_crc32_options()
    a, b = without_crc32(), without_crc32()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert torch.serialization.get_crc32_options() is False
    b.__exit__(None, None, None)
    assert torch.serialization.get_crc32_options() is before


def test_copies_run_one_tensor_ahead_of_the_writer() -> None:
    """copied_ahead hands the tensors out in order and takes tensor i+1 (starting its copy on a GPU) before it hands
    out tensor i: the copy of the next runs while the writer writes this one. On CPU the tensors pass through."""
    from mcorekit.train.checkpoint_writer import copied_ahead

    taken: list[int] = []
    tensors = [torch.full((3,), float(i)) for i in range(4)]

    def bucket():
        for i, t in enumerate(tensors):
            taken.append(i)
            yield f"item{i}", t

    handed = []
    for item, tensor in copied_ahead(bucket()):
        handed.append((item, len(taken)))
        assert tensor is tensors[int(item[-1])]
    assert handed == [("item0", 2), ("item1", 3), ("item2", 4), ("item3", 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [1, 2])
def test_gpu_staging_writes_what_host_tensors_write(model_parallel: None, tmp_path: Path, threads: int) -> None:
    """GPU tensors, copied ahead of the writer into pinned memory on a side stream (stage_per_tensor), give the files
    the same tensors written from host memory give (save ids apart): the copy is complete before each is written,
    and each keeps its layout (a transposed one included)."""
    from mcorekit.train.checkpoint_writer import copied_ahead

    _save_with(tmp_path / "host", threads, writeback=True, device="cpu")
    _save_with(tmp_path / "gpu", threads, writeback=True, device="cuda")
    assert _same_data_files(tmp_path / "host", tmp_path / "gpu") == threads
    big = [("a", torch.randn(4096, 4096, device="cuda")), ("b", torch.randn(4096, 4096, device="cuda").t())]
    for (_, want), (_, got) in zip(big, copied_ahead(big)):
        assert got.is_pinned() and got.stride() == want.stride() and torch.equal(got, want.cpu())


def _write(saver: Any, path: Path, background: bool, finalize: Any, before_write: Any = None,
           device: str = "cpu") -> dict:
    """What Saver.save does with its state once planned (here _state on `device`, in `path`, which exists); returns
    the state."""
    from megatron.core import dist_checkpointing

    state = _state(device)
    with without_crc32(), results_queue():
        request = dist_checkpointing.save(state, str(path), sharded_strategy=save_strategy(),
                                          async_sharded_save=True, async_strategy="mcore")
        request.add_finalize_fn(finalize)
        if before_write is not None:
            before_write()
        saver.write(request, background)
    return state


@pytest.fixture
def staging_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-Core's staging of a background save waits for its GPU copies (torch.cuda.synchronize); without a GPU
    there is nothing to wait for, and that one call is pointed away."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)


def test_a_background_save_is_written_by_a_thread(model_parallel: None, staging_on_cpu: None, tmp_path: Path) -> None:
    """With async_save a save is written by a thread of this process (train/checkpoint_writer.WriterThread;
    Megatron-Core's own caller forks a process) and finalized once written (.metadata, then the finalize functions): the
    same files as a save written at once, without CRC-32s as those (the thread keeps the setting of the save that
    scheduled it). A save the loop waits for is written at once. No process is started, and Megatron-Core's module-level
    results queue is left as it was (it would be a multiprocessing Manager, whose server process it spawns)."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from mcorekit.train.checkpoint import Saver

    before = (set(multiprocessing.active_children()), filesystem_async._results_queue)
    saver = Saver(tmp_path / "ckpts", keep_last=1, async_save=True)
    assert saver.in_background(wait=False) and not saver.in_background(wait=True)
    _save(tmp_path / "reference", ours=True)
    finalized: list[str] = []
    for name, background in (("background", True), ("now", False)):
        (tmp_path / name).mkdir()
        _write(saver, tmp_path / name, background, lambda name=name: finalized.append(name))
        if background:
            assert saver.queue.get_num_unfinalized_calls() == 1
            saver.wait()
    saver.close()
    assert finalized == ["background", "now"] and saver.queue.get_num_unfinalized_calls() == 0
    for name in ("background", "now"):
        assert _same_data_files(tmp_path / "reference", tmp_path / name) == 1
        assert (tmp_path / name / ".metadata").is_file()
    assert (set(multiprocessing.active_children()), filesystem_async._results_queue) == before


def test_training_goes_on_while_the_thread_writes(model_parallel: None, staging_on_cpu: None, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's poll between steps never waits for a background write: while the thread is held inside its first
    write the save stays unfinalized (and the garbage collector off: Megatron-Core's writer disables it), once the
    write may go on the next poll finalizes it, and the collector is on again. The staged copy is let go on this
    thread (WriterThread.close)."""
    import gc
    import threading

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from mcorekit.train.checkpoint import Saver

    real, inside, go_on = filesystem_async._write_item, threading.Event(), threading.Event()

    @functools.wraps(real)
    def held(*args, **kwargs):
        inside.set()
        assert go_on.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(filesystem_async, "_write_item", held)
    assert gc.isenabled()
    saver = Saver(tmp_path / "ckpts", keep_last=1, async_save=True)
    (tmp_path / "background").mkdir()
    finalized: list[str] = []
    _write(saver, tmp_path / "background", True, lambda: finalized.append("background"))
    caller = saver.queue.async_calls[0].async_caller
    assert inside.wait(60) and caller.thread.is_alive() and caller.staged is not None
    for _ in range(3):  # three steps' polls
        saver.poll()
    assert finalized == [] and saver.queue.get_num_unfinalized_calls() == 1 and not gc.isenabled()
    go_on.set()
    caller.thread.join(60)
    saver.poll()
    assert finalized == ["background"] and saver.queue.get_num_unfinalized_calls() == 0
    assert caller.thread is None and caller.staged is None and gc.isenabled()
    saver.close()
    assert (tmp_path / "background" / ".metadata").is_file()


def test_a_failed_background_write_fails_the_save(model_parallel: None, staging_on_cpu: None, tmp_path: Path) -> None:
    """A background write that fails (here its folder is gone before the thread writes) raises where the save is
    finalized, on the training thread, and the save's own finalize functions (the tracker update) do not run."""
    from torch.distributed.checkpoint.api import CheckpointException

    from mcorekit.train.checkpoint import Saver

    saver = Saver(tmp_path / "ckpts", keep_last=1, async_save=True)
    (tmp_path / "gone").mkdir()
    finalized: list[str] = []
    _write(saver, tmp_path / "gone", True, lambda: finalized.append("gone"), (tmp_path / "gone").rmdir)
    with pytest.raises(CheckpointException, match="FileNotFoundError"):
        saver.wait()
    assert finalized == [] and not (tmp_path / "gone").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("staged_on", ["gpu", "host"])
def test_a_background_save_holds_the_tensors_of_when_it_was_scheduled(model_parallel: None, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     staged_on: str) -> None:
    """Once a background save is scheduled the next step changes the tensors in place (the optimizer's step) while
    the thread writes. Here the thread is held before its first write until every GPU tensor has changed: the files
    hold the tensors as they were when the save was scheduled, whether it was staged on the GPU (a copy there; the
    thread copies each tensor to host memory as it writes it) or, with no room on the GPU, in pinned host memory.
    Staged on the GPU, scheduling waits for nothing on the GPU (no torch.cuda.synchronize on any thread before the
    write goes on; the copy is queued behind a second of GPU work here, which the writer's copies to host memory
    must wait for); staged in host memory it waits for the copies."""
    import threading

    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from mcorekit.train import checkpoint, checkpoint_writer
    from mcorekit.train.step_graph import WARMUP_STEPS

    _save(tmp_path / "reference", ours=True)
    real_write, real_sync, go_on, synced = filesystem_async._write_item, torch.cuda.synchronize, threading.Event(), []

    @functools.wraps(real_write)
    def held(*args, **kwargs):
        assert go_on.wait(60)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(filesystem_async, "_write_item", held)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: (synced.append(1), real_sync(*args))[1])
    if staged_on == "host":
        monkeypatch.setattr(checkpoint_writer, "room_on_gpu", lambda nbytes, queue: False)
    if staged_on == "gpu":  # the copy queued behind a second of GPU work: the writer's copies must wait for it
        snapshot = checkpoint_writer.snapshot_on_gpu
        monkeypatch.setattr(checkpoint_writer, "snapshot_on_gpu",
                            lambda buckets: (torch.cuda._sleep(2_000_000_000), snapshot(buckets))[1])
    saver = checkpoint.Saver(tmp_path / "ckpts", keep_last=1, async_save=True)
    for _ in range(WARMUP_STEPS + 2):  # as the loop polls before each step; the steps' peak is known after these
        saver.poll()
    (tmp_path / "background").mkdir()
    state = _write(saver, tmp_path / "background", True, lambda: None, device="cuda")
    assert saver.queue.staged_on == staged_on and (synced == []) == (staged_on == "gpu")
    changed = [v.data.add_(1) for v in state.values() if isinstance(v, ShardedTensor)]
    assert len(changed) == 5 and all(t.is_cuda for t in changed)
    go_on.set()
    saver.wait()
    saver.close()
    assert _same_data_files(tmp_path / "reference", tmp_path / "background") == 1


def test_gpu_room_is_judged_against_the_steps_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """room_on_gpu on a GPU of 100 GiB (its memory figures mocked: no GPU here), 5 GiB outside torch's allocator,
    the margin 1/16 of the GPU (6.25 GiB). No room before the step graph's capture has run (the steps' peak is not
    known before it). Steps that reserved 60 GiB at most leave room for a copy of 28.75 GiB, less what the save
    holds beside the steps. A later save is judged against the largest reservation less the largest copy (a
    released copy stays in torch's cache), which grows when the steps needed more while a copy was held."""
    from mcorekit.train.checkpoint_writer import background_writes, room_on_gpu
    from mcorekit.train.step_graph import WARMUP_STEPS

    gib = 2**30
    memory = {"free": 40 * gib, "reserved": 55 * gib, "peak": 60 * gib, "allocated": 30 * gib}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (memory["free"], 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: memory["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: memory["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: memory["allocated"])
    queue = background_writes()
    for _ in range(WARMUP_STEPS + 1):  # the eager warm-up steps and the capture
        queue.between_steps()
    assert not room_on_gpu(1 * gib, queue)
    queue.between_steps()
    assert queue.allocated_between_steps == 30 * gib
    assert room_on_gpu(28 * gib, queue) and not room_on_gpu(29 * gib, queue)
    memory["allocated"] += 3 * gib  # the save's own tensors beside the steps
    assert room_on_gpu(25 * gib, queue) and not room_on_gpu(26 * gib, queue)
    queue.copy_bytes = 28 * gib  # a copy of 28 GiB staged and released: cached, the peak 88 GiB
    memory.update(free=12 * gib, reserved=83 * gib, peak=88 * gib, allocated=30 * gib)
    assert room_on_gpu(28 * gib, queue) and not room_on_gpu(29 * gib, queue)
    memory["peak"] = 95 * gib  # the steps reached 67 GiB while that copy was held
    assert room_on_gpu(21 * gib, queue) and not room_on_gpu(22 * gib, queue) and queue.steps_peak == 67 * gib
    memory["free"] = 7 * gib  # 5 GiB more outside torch's allocator (a new NCCL communicator, say)
    assert room_on_gpu(16 * gib, queue) and not room_on_gpu(17 * gib, queue)
