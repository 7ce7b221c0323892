"""Distributed (torch_dist) checkpoints: iter_N/ directories, a latest tracker written atomically after the
checkpoint is complete (every rank's part, also for asynchronous saves), keep-last-N retention. Loading an HF-converted checkpoint (tracker `release`) for
fine-tuning takes the weights only.

A LoRA run (train/lora.py) saves and resumes only its adapters (`<layer>.adapter.lora_a/b`), their optimizer state,
the scheduler and the step, with `lora.json` (rank, alpha, targets, the base checkpoint) in each iteration
directory; the frozen base comes from checkpoint.load at every start (load_base), the iteration the run's first
start pinned (pinned_sources).

Under Megatron-FSDP (parallel.fsdp) Megatron-Core 0.19 writes model and optimizer only as `fsdp_dtensor` (each
parameter a DTensor of Megatron-FSDP's uneven shards, written with torch.distributed.checkpoint), as Megatron-LM's
`--ckpt-format fsdp_dtensor` does. Such an iteration directory holds DCP's files plus `fsdp_dtensor.json` (written
last: the format marker, the step, the scheduler, the optimizer's non-tensor state and the layout), so nothing in it
is unpickled but DCP's own .metadata. Across formats (see format_of):
- FSDP checkpoint -> FSDP run: everything (same TP/ETP; DCP reshards DP).
- FSDP checkpoint -> run without FSDP: the weights (the fp32 main weights, read whole by key), scheduler and step;
  the optimizer starts fresh (a loud warning). checkpoint.finetune=true: the weights only, step 0.
- torch_dist checkpoint -> FSDP run: the weights, loaded into the unwrapped model before Megatron-FSDP copies them
  into its buffers (train/build.py: weights_before_wrap); from the run's own checkpoint also scheduler and step,
  with a fresh optimizer (a loud warning)."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch.distributed as dist

from mcorekit.config.values import shown
from mcorekit.errors import ConfigError, MCoreKitError, first_line, one_line
from mcorekit.outputs import without_crc32, write_atomic
from mcorekit.runtime.ranks import any_rank, rank_zero_choice
from mcorekit.train.checkpoint_writer import background_writes, results_queue, save_strategy, stage_per_tensor
from mcorekit.train.fsdp import is_fsdp
from mcorekit.train.lora import is_adapter_key

log = logging.getLogger("mcorekit.train")

TRACKER = "latest_checkpointed_iteration.txt"
SOURCES = "sources.json"  # in a run's checkpoints folder: the iterations its first start pinned (pinned_sources)
SOURCE_KEYS = ("checkpoint.load", "peft.lora.load")  # what pinned_sources pins, in its order
LORA_JSON = "lora.json"  # in a LoRA checkpoint's iteration directory: what convert/lora.py needs to export it
RELEASE = "release"  # Megatron-LM's name for a checkpoint that did not come from a training step (weights only)
# fully_reshardable: the optimizer state is stored per model parameter, so a checkpoint resumes at another
# TP/PP/DP layout (saving gathers it over DP; dp_reshardable would be faster but fixes the layout).
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False}
FSDP_SHARDING = {"distrib_optim_sharding_type": "fsdp_dtensor"}  # the only one Megatron-FSDP's optimizer writes
FSDP_JSON = "fsdp_dtensor.json"  # an fsdp_dtensor checkpoint's marker, written once DCP's files are complete
TORCH_DIST, FSDP_DTENSOR = "torch_dist", "fsdp_dtensor"
DELETING = ".deleting-"  # a superseded checkpoint, renamed out of iter_* while a thread deletes it (prune)
PINS = "pins"  # in a checkpoints folder: ITER.KEY files, an iteration another run reads at every start (pin)


def iter_dir(root: Path, step: int) -> Path:
    return root / f"iter_{step:07d}"


def step_of(path: Path) -> int | None:
    """N of an iter_N directory (None for release or any other name)."""
    digits = path.name.removeprefix("iter_")
    return int(digits) if path.name.startswith("iter_") and digits.isascii() and digits.isdigit() else None


def tracked(root: Path) -> Path | None:
    """The iteration directory a checkpoint root's tracker names (iter_N or release); None without a tracker, or with
    one that holds neither (a warning: latest() then looks for the checkpoints themselves)."""
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    value = tracker.read_bytes()[:64].decode("utf-8", "replace").strip()
    if value == RELEASE or (value.isascii() and value.isdigit()):
        return root / value if value == RELEASE else iter_dir(root, int(value))
    log.warning("%s holds %r, not a step number or %s: ignored", tracker, value, RELEASE)
    return None


def format_of(path: Path) -> str | None:
    """torch_dist (Megatron's metadata.json), fsdp_dtensor (our marker), or None: not a complete checkpoint."""
    if (path / FSDP_JSON).is_file():
        return FSDP_DTENSOR
    if (path / "metadata.json").is_file():
        return TORCH_DIST
    return None


def start_of(path: str | Path) -> Path:
    """A checkpoint named by a path: the folder itself if it is one (an iteration, a release: never a folder inside
    it, which was not checked), else the latest complete iteration under a checkpoints root, as rank 0 sees it."""
    return rank_zero_choice(lambda: _start_on_disk(Path(path))) or Path(path)


def complete_steps(root: Path) -> list[Path]:
    """The complete iter_N checkpoints under root (torch_dist or fsdp_dtensor), oldest first."""
    found = [p for p in root.glob("iter_*") if step_of(p) is not None and format_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0)


def latest(root: Path) -> Path | None:
    """The checkpoint to resume from: the one the tracker names, if complete on disk; else (no tracker, one that
    holds no step, or one that names a checkpoint that is not complete: a kill between a save and its tracker, a
    damaged folder) the newest complete iter_N, with a warning. Starting afresh beside complete checkpoints would
    resume none of them, and its first save would prune them. Rank 0 looks and every rank takes its answer: ranks
    on other nodes may see the folder differently (NFS caches), and each must load the same checkpoint."""
    return rank_zero_choice(lambda: _latest_on_disk(root))


def _latest_on_disk(root: Path) -> Path | None:
    path = tracked(root)
    if path is not None and format_of(path) is not None:
        return path
    if path is not None:
        log.warning("%s names %s, which is not a complete checkpoint (no metadata.json or %s)", root / TRACKER,
                    path, FSDP_JSON)
    complete = complete_steps(root) if root.is_dir() else []
    if not complete:
        return None
    log.warning("taking %s, the newest complete checkpoint under %s (its tracker %s)", complete[-1], root,
                "names another" if path is not None else "is missing or unreadable")
    return complete[-1]


def unwrap(model: Any) -> Any:
    """The GPTModel inside DDP / Float16Module: its keys are the checkpoint's (and convert/'s) keys."""
    while hasattr(model, "module"):
        model = model.module
    return model


class Saver:
    """Saves iter_N/ checkpoints; with async_save the write happens on a background thread while training continues
    (WriterThread), and the tracker is updated only once every rank's part is on disk (one save in flight).
    Saves the loop waits for (the end-of-run save, the save before a requeue) are written at once (see write).
    `signal_lead_s`: how long before the time limit Slurm signals the job (the cluster profile's signal_seconds; None
    outside `mcorekit launch`), against which each save's time is checked (lead_check)."""

    def __init__(self, root: Path, keep_last: int, async_save: bool, signal_lead_s: int | None = None) -> None:
        self.root, self.keep_last, self.signal_lead_s = root, keep_last, signal_lead_s
        self.queue = background_writes() if async_save else None
        self.strategy: Any = None  # built at the first save (the process groups exist by then)
        self.lead_warned = False

    def save(self, step: int, chunks: list[Any], optimizer: Any, scheduler: Any, wait: bool = False) -> Path:
        from megatron.core import dist_checkpointing

        waited = time.perf_counter()
        self.wait()  # one save in flight: a save due before the last background write ends waits for it here
        started = time.perf_counter()
        waited = started - waited
        path = iter_dir(self.root, step)
        # rank 0 alone prepares the folder; the broadcast is the barrier, and carries its failure to every rank (a
        # rank 0 that raised alone left the others waiting for NCCL's timeout)
        rank_zero_choice(lambda: self.new_folder(path, step, lora_info(chunks)))
        sync_params(chunks)
        if is_fsdp(chunks):  # Megatron-FSDP: fsdp_dtensor through torch.distributed.checkpoint, synchronous
            _save_fsdp(path, step, chunks, optimizer, scheduler)
            dist.barrier()
            self._finalize(path, step, started, waited, background=False)
            return path
        background = self.in_background(wait)
        if self.strategy is None:
            self.strategy = save_strategy()
        model_sd = _model_state(chunks, ADAPTERS if lora_info(chunks) else ALL)
        with optimizer_state_in_place(optimizer):
            optimizer_sd = optimizer.sharded_state_dict(model_sd, metadata=SHARDING)
        state = {**model_sd, "optimizer": optimizer_sd, "scheduler": scheduler.state_dict(), "iteration": step}
        # Megatron-Core's writer as an AsyncRequest ("mcore"; the default "nvrx" needs nvidia-resiliency-ext), written
        # here (write) or on the background thread
        with without_crc32(), results_queue():
            request = dist_checkpointing.save(state, str(path), sharded_strategy=self.strategy,
                                              async_sharded_save=True, async_strategy="mcore")
            request.add_finalize_fn(lambda: self._finalize(path, step, started, waited, background))
            self.write(request, background)
        if background:
            _report({"event": "scheduled", "step": step, "blocking_s": round(time.perf_counter() - started, 2),
                     "staged_on": self.queue.staged_on, "waited_for_previous_s": round(waited, 2)})
        return path

    def in_background(self, wait: bool) -> bool:
        """Whether a save is handed to the background writer: with async_save, unless the loop waits for it."""
        return self.queue is not None and not wait

    def write(self, request: Any, background: bool) -> None:
        """A save request written now, each tensor copied to host memory one ahead of the writer (stage_per_tensor),
        or scheduled on the background thread, staged first on the GPU or in pinned memory (WriterThread). A save the
        loop waits for is written now even with async_save: nothing overlaps it, and on one H200 (3B shape,
        2026-12-02, `916c1d7`) the end-of-run save took 22.3 s written now and 29.7 s in the background."""
        if background:
            self.queue.schedule_async_request(request)
            return
        with stage_per_tensor(request) as staged:
            staged.execute_sync()

    def poll(self) -> None:
        """Before each step: finish a background save that is complete everywhere (never blocks)."""
        if self.queue is not None:
            self.queue.between_steps()
            self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        if self.queue is not None:
            self.wait()
            self.queue.close()

    def new_folder(self, path: Path, step: int, lora: dict[str, Any] | None) -> None:
        """Rank 0: an empty `path` for the save of `step` (a half-written one from an interrupted save removed), with
        lora.json for a LoRA run. A folder that cannot be emptied or made is one error line."""
        try:
            if path.exists() or path.is_symlink():
                shutil.rmtree(path)  # not ignore_errors: a leftover metadata.json would pass for a complete save
            path.mkdir(parents=True)
            if lora is not None:
                (path / LORA_JSON).write_text(json.dumps(lora, indent=2) + "\n")
        except OSError as e:
            raise MCoreKitError(f"cannot prepare {path} for the checkpoint of step {step}: {one_line(e)}; check the "
                                f"file system under {self.root} (space, permissions, a file in the way), then resume "
                                f"the run") from None

    def _finalize(self, path: Path, step: int, started: float, waited: float, background: bool) -> None:
        """Every rank, once the save is complete: rank 0 makes it the latest (finish); a failure there is one error
        line on every rank (the broadcast is also the barrier every rank waits at for rank 0)."""
        rank_zero_choice(lambda: self.finish(path, step, started, waited, background))

    def finish(self, path: Path, step: int, started: float, waited: float, background: bool) -> None:
        """Rank 0: the save's line, then the checkpoint made durable (durable: what Megatron-Core wrote last and the
        folder), the tracker moved to it and made durable, and only then the older checkpoints pruned: with
        keep_last=1 a crash in between must still leave one complete checkpoint. `seconds` from the save's start to
        its end; `waited_for_previous_s` before it, for the previous background write to end (a save the loop
        waits for, such as the end-of-run save, holds it that long too)."""
        try:
            seconds, size = time.perf_counter() - started, _bytes_on_disk(path)
            _report({"event": "saved", "step": step, "async": background, "seconds": round(seconds, 2),
                     "gb": round(size / 1e9, 3), "gb_per_s": round(size / 1e9 / seconds, 3),
                     "waited_for_previous_s": round(waited, 2), "end": time.time()})
            durable(path)
            tmp = self.root / (TRACKER + ".tmp")
            with open(tmp, "w") as f:  # on disk before it replaces the tracker: a crash leaves the old or the new
                f.write(str(step))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / TRACKER)  # only now is this the latest checkpoint
            fsync_path(self.root)  # the rename itself, before prune renames the older ones away
        except OSError as e:
            raise MCoreKitError(f"checkpoint {path} was written but could not be made the latest: {one_line(e)}; "
                                f"check the file system under {self.root} (its {TRACKER} names the previous "
                                f"checkpoint, which a resume takes)") from None
        if (path / LORA_JSON).is_file():
            log.warning("saved LoRA checkpoint %s: %.2f MB (adapters, their optimizer state, scheduler, step)",
                        path, size / 1e6)
        self.lead_check(step, seconds, background)
        prune(self.root, path, self.keep_last)

    def lead_check(self, step: int, seconds: float, background: bool) -> None:
        """Once per process: a save written at once that took more than half the signal lead. The save before a
        requeue is written at once (with async_save too), after the rest of the step the signal came in, and
        `scontrol requeue` follows: all of it must end before the time limit, or the job is killed and its restart
        resumes from an older checkpoint (RestartGuard then stops a loop)."""
        lead = self.signal_lead_s
        # a background save's time runs to the step boundary that finds it done: not the time of a save written at once
        if lead is None or background or self.lead_warned or seconds <= lead / 2:
            return
        self.lead_warned = True
        log.warning("the checkpoint save of step %d took %.1f s, more than half of the %d s the job gets between "
                    "Slurm's time-limit signal and the time limit (the cluster profile's signal_seconds): the save "
                    "before a requeue may not end in time; raise signal_seconds to %d or more (in the run folder's "
                    "cluster.yaml for `mcorekit launch --resume`, or `--set signal_seconds=N` at launch)",
                    step, seconds, lead, 2 * math.ceil(seconds) + 30)


def prune(root: Path, latest: Path, keep_last: int) -> threading.Thread | None:
    """Keep the newest `keep_last` checkpoints under root, `latest` among them. The others are renamed out of iter_*
    at once (from then on they are not checkpoints: nothing lists or loads them) and deleted on a thread, with any
    that a process stopped mid-deletion left behind. Every rank waits for rank 0 after a save, and deleting a 36.6 GB
    checkpoint took 10.2 s on an H200 machine's disk (bench/start_save.py, 2026-12-02). Not a daemon thread: the
    process ends only when it is done (a normal exit and train/shutdown.shut_down join it). Returns the thread."""
    newest = step_of(latest)
    older = [p for p in root.glob("iter_*") if newest is not None and (n := step_of(p)) is not None and n < newest]
    complete = sorted((p for p in older if format_of(p) is not None), key=step_of)
    # the complete ones beyond keep_last, and what saves that never completed left; never one newer than `latest`
    superseded = complete[: max(0, len(complete) - (keep_last - 1))] + [p for p in older if p not in complete]
    superseded = [p for p in superseded if not _kept_for(p)]
    doomed, mine = [], f".{os.getpid()}."
    for p in superseded:
        try:
            doomed.append(p.rename(p.with_name(f"{DELETING}{p.name}{mine}{time.time_ns()}")))
        except OSError as e:  # keeping too many checkpoints must not fail a save (nor hang the other ranks' barrier)
            log.warning("could not remove the superseded checkpoint %s: %s", p, e)
    # left by a process that stopped while deleting; this process's own are being deleted by its earlier threads
    doomed += [p for p in root.glob(f"{DELETING}*") if mine not in p.name]
    if not doomed:
        return None
    thread = threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in doomed],
                              name="mcorekit-prune-checkpoints")
    thread.start()
    return thread


def pin(iteration: Path, by: Path) -> None:
    """Marks `iteration` (another run's iter_N) as read at every start of the run whose checkpoints folder is `by` (its
    LoRA base, its DPO or GRPO reference), so that its own run's keep_last keeps it while `by` goes on: pruned, `by`
    could not restart (_kept_source refuses). unpin() at `by`'s end takes the mark back. A folder this run cannot
    write in is a warning; a release (no iter_N) is never pruned."""
    iteration = iteration.resolve()  # where its own run prunes it, not a link to it
    if step_of(iteration) is None:
        return
    mark = _mark(iteration, by)
    try:
        mark.parent.mkdir(exist_ok=True)
        if not mark.is_file():
            write_atomic(mark, f"{by.absolute()}\n")  # its temporary name is not a mark's (MARK_RE)
    except OSError as e:
        log.warning("could not mark %s as read by this run (%s): its run's keep_last may remove it while this run "
                    "still reads it at each restart", iteration, e)


def unpin(iteration: Path, by: Path) -> None:
    """Takes back pin(iteration, by): the run whose checkpoints folder is `by` has finished."""
    mark = _mark(iteration.resolve(), by)
    try:
        mark.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not remove this run's mark on %s (%s): its run's keep_last keeps it until the file in "
                    "%s is removed", iteration, e, mark.parent)


def _key(by: str | Path) -> str:
    import hashlib

    return hashlib.blake2b(str(Path(by).absolute()).encode(), digest_size=8).hexdigest()


def _mark(iteration: Path, by: Path) -> Path:
    return iteration.parent / PINS / f"{iteration.name}.{_key(by)}"


MARK_RE = re.compile(r"(iter_\d+)\.([0-9a-f]{16})")
_reported_pins: set[Path] = set()


def _kept_for(iteration: Path) -> bool:
    """Whether marks keep `iteration` from pruning (said once per process). A mark is removed only on evidence that
    its run no longer needs it: its sources.json names another iteration now (it started again from another
    source). One that cannot be checked (the run not seen from here: deleted, or on a mount this process lacks; a
    mark that is not as pin() writes it) keeps the iteration, with a warning naming the file to delete: keeping a
    checkpoint too long costs disk, removing it stops that run at its next restart. Never raises (prune must not
    fail a save)."""
    kept: list[str] = []
    try:
        marks = sorted((iteration.parent / PINS).glob(f"{iteration.name}.*"))
    except OSError:
        marks = []
    for mark in marks:
        found = MARK_RE.fullmatch(mark.name)
        if not found or found[1] != iteration.name:
            continue
        try:
            with open(mark, "rb") as f:
                run = f.read(4096).decode("utf-8", "replace").strip()
            if _key(run) == found[2] and _names_other_source(Path(run), iteration):
                log.warning("%s: the run at %s reads another iteration now: mark removed", mark, shown(run))
                mark.unlink(missing_ok=True)
                continue
            kept.append(shown(run) if _key(run) == found[2] else f"{shown(mark)} (not as mcorekit writes a mark)")
        except OSError as e:  # unreadable, a folder by that name, or taken back meanwhile: kept if it is still there
            if mark.exists() or mark.is_symlink():
                kept.append(f"{shown(mark)} ({type(e).__name__})")
    if kept and iteration not in _reported_pins:
        _reported_pins.add(iteration)
        log.warning("keeping %s beyond checkpoint.keep_last: marked as read at every start by %s; each run takes its "
                    "mark back when it finishes (if that run is gone, delete its file in %s)", iteration,
                    ", ".join(kept), iteration.parent / PINS)
    return bool(kept)


def _names_other_source(run: Path, iteration: Path) -> bool:
    """Whether the run whose checkpoints folder is `run` names another iteration than `iteration` as its source now
    (its sources.json, pinned[0], an absolute path); False when that cannot be told."""
    try:
        if (run / SOURCES).stat().st_size > 1024**2:  # a few hundred bytes; a mark's text is anyone's
            return False
        pinned = json.loads((run / SOURCES).read_text())["pinned"][0]
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return False
    if pinned is not None and not (isinstance(pinned, str) and Path(pinned).is_absolute()):
        return False  # a relative path, written by a start elsewhere: not comparable here
    return pinned is None or Path(pinned).resolve() != iteration.resolve()


# what a save writes last into its folder without an fsync of its own (Megatron-Core fsyncs its .distcp files and
# .metadata, not metadata.json, the marker of a complete torch_dist checkpoint); .metadata again costs nothing
WRITTEN_LAST = ("common.pt", ".metadata", "metadata.json", FSDP_JSON, LORA_JSON)


def durable(path: Path) -> None:
    """A finished save's last files (WRITTEN_LAST, those present) and its folder's entries on disk: fsynced before
    the tracker names it and older checkpoints are pruned."""
    for name in WRITTEN_LAST:
        if (path / name).is_file():
            fsync_path(path / name)
    fsync_path(path)


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder (its entries: files created or renamed in it). A file system that cannot sync a
    folder (EINVAL: some network file systems) is left to its own guarantees."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (path.is_dir() and e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def _bytes_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _report(record: dict[str, Any]) -> None:
    """One line per save on rank 0's stdout (between the step lines): when it was written, how big, how fast."""
    print("mcorekit.train: checkpoint " + json.dumps(record), flush=True)


class _ParamRanges(dict):
    """Stands in for one flat "world" tensor of DistributedOptimizer.get_parameter_state_dp_zero at DP=1:
    [start:end] of a parameter's range is that parameter's own state tensor, which holds exactly the values the
    flat copy would hold there."""

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__((key.start, key.stop) if isinstance(key, slice) else key)


def _dp1_world_state(opt: Any) -> dict[Any, Any] | None:
    """What get_parameter_state_dp_zero returns for a one-rank data-parallel DistributedOptimizer, without its
    copies (every fp32 main weight and Adam moment copied to the host, to the GPU for the gather and back, then
    concatenated: several passes over 12 bytes per parameter, the most of a one-GPU save's time). None unless the
    parameters' own state tensors hold exactly what those copies would (fp32, one tensor per parameter at the
    position Megatron-Core's slicing reads): then the checkpoint is the same, read straight from the GPU."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(opt, DistributedOptimizer) or opt.data_parallel_group.size() != 1:
        return None
    if getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        return None  # moments in other dtypes, unscaled when read: Megatron-Core's own path
    keys = ("param", *opt.optimizer_state_keys)
    state: dict[Any, Any] = {"buckets_coalesced": True}
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        buffer, per_dtype = opt.buffers[gbuf_idx], {}
        for dtype, bucket_maps in gbuf_range_maps.items():
            world: dict[str, Any] = {k: _ParamRanges() for k in keys}
            offset, seen = 0, 0
            for bucket_idx, bucket_map in enumerate(bucket_maps):
                unpadded = buffer.buckets[bucket_idx].numel_unpadded
                for model_param, ranges in bucket_map["param_map"].items():
                    local = ranges["gbuf_local"]
                    where = (offset + local.start, offset + local.end)
                    if local.end > unpadded or where != tuple(buffer.param_index_map[model_param][:2]):
                        return None
                    tensors = opt._get_main_param_and_optimizer_states(model_param)
                    for k in keys:
                        t = tensors.get(k)
                        if t is None or t.dtype != torch.float32 or t.numel() != local.end - local.start:
                            return None  # e.g. no Adam moments before the first step: Megatron-Core's zeros
                        world[k][where] = t.detach().view(-1)
                    seen += 1
                offset += unpadded
            if seen != len(buffer.param_index_map):
                return None
            per_dtype[dtype] = {**world, "numel_unpadded": buffer.numel_unpadded}
        state[gbuf_idx] = per_dtype
    return state


@contextmanager
def optimizer_state_in_place(optimizer: Any) -> Iterator[None]:
    """While saving: each one-rank data-parallel DistributedOptimizer (of a ChainedOptimizer too) builds its
    fully_reshardable state from its GPU tensors (_dp1_world_state), which the writer then copies to pinned host
    memory once; any other keeps Megatron-Core's path. The checkpoint's keys, shapes and values are the same."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        world = _dp1_world_state(opt)
        if world is not None:
            opt.get_parameter_state_dp_zero = lambda *args, _world=world, **kwargs: _world
            patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt.get_parameter_state_dp_zero  # the class's method again


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


def read(sharded: dict[str, Any], path: Path, metadata: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Megatron-Core's dist_checkpointing.load of a torch_dist checkpoint, its records read ahead of the
    deserializing (train/checkpoint_reader.py). A record that cannot be read (a truncated or damaged file) is one
    error line on every rank: each rank reads its own part, and one that failed alone would leave the others
    waiting in the next collective. `metadata`: its checked .metadata when the caller has read it already."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from mcorekit.train.checkpoint_reader import check_fit, checked_metadata, dcp_cause, read_ahead

    # checked before anything is read: nothing unsafe in .metadata (the load's reader unpickles it the same restricted
    # way, read_ahead), and what it describes fits
    check_fit(sharded, path, metadata or checked_metadata(path))
    state, failed = None, ""
    try:
        with read_ahead():
            state = dist_checkpointing.load(sharded, str(path), **kwargs)
    except CheckpointException as e:  # a BaseException: torch's wrapper of each rank's failure
        failed = first_line(dcp_cause(e))
    except MCoreKitError as e:  # common_state's refusal, outside DCP's wrapper: every rank must learn of it
        failed = first_line(e)
    if any_rank(bool(failed)):
        hint = (f": resume from an earlier one by setting its step in {path.parent / TRACKER}"
                if step_of(path) is not None else "")  # a run's iteration; not a release or converted adapters
        raise ConfigError(f"checkpoint {path} could not be read: {failed or 'another rank failed to read its part'} "
                          f"(a damaged or incomplete checkpoint{hint})")
    return state


def checked_sources(exp: Any) -> tuple[str | None, str | None]:
    """The checkpoints a run reads from elsewhere, checked before any loader unpickles their records
    (checkpoint_reader.checked_records): checkpoint.load as its latest iteration (a base to fine-tune or to
    continue, a LoRA base, a DPO reference) and peft.lora.load's adapters. One that is gone is left to the code
    that would read it. Returns the two as checked (pinned_sources). The launcher calls it before queueing."""
    lora = exp.peft.lora
    pinned = _pinned(exp.checkpoint.load), _pinned(lora.load if lora else None)
    for path in pinned:
        if path:
            _check(Path(path))
    return pinned


def checked_resume(path: Path) -> None:
    """The run's own checkpoint, checked as checkpoint.load's are, before it is loaded: a run folder can come from
    elsewhere (copied, shared) as a base can. Rank 0 reads; every rank takes its refusal."""
    rank_zero_choice(lambda: _check(path))


def _check(path: Path) -> None:
    from mcorekit.train.checkpoint_reader import checked_metadata, checked_records

    if (path / ".metadata").is_file():
        checked_records(path, checked_metadata(path))


def pinned_sources(exp: Any, root: Path | None = None) -> Any:
    """exp with checkpoint.load and peft.lora.load pinned to the iterations checked_sources checked, on rank 0;
    every rank takes its answer (or its refusal). Whatever the start reads afterwards (the base, the adapters, the
    DPO reference at the first step) is what was checked, even if their run saves a newer iteration meanwhile.
    `root`: the run's checkpoints folder. A run that resumes from a checkpoint of its own keeps the iterations its
    first start pinned (SOURCES there): a LoRA base and a DPO or GRPO reference are read again at every start, and
    a newer iteration of their run is not the model this run trained against. Its other inputs, settings and files,
    are checked against its first start's there too (train/run_inputs.py)."""
    load, adapters = rank_zero_choice(lambda: _run_sources(exp, root))
    lora = exp.peft.lora.model_copy(update={"load": adapters}) if exp.peft.lora else None
    return exp.model_copy(update={"checkpoint": exp.checkpoint.model_copy(update={"load": load}),
                                  "peft": exp.peft.model_copy(update={"lora": lora})})


def _run_sources(exp: Any, root: Path | None) -> tuple[str | None, str | None]:
    from mcorekit.train import run_inputs

    resuming = root is not None and _latest_on_disk(root) is not None
    run_inputs.record_or_check(exp, root, resuming)
    lora = exp.peft.lora
    given = [exp.checkpoint.load, lora.load if lora else None]
    record = root / SOURCES if root is not None else None
    if record is not None and record.is_file() and resuming:
        kept = _recorded(record, given)
        if kept is not None:
            pinned, stamps = kept
            for i, (path, what) in enumerate(zip(pinned, SOURCE_KEYS)):
                if path:
                    _kept_source(Path(path), what, stamps[i], read_again=i == 0 and _reads_base_again(exp))
            if pinned[0] and _reads_base_again(exp):
                pin(Path(pinned[0]), record.parent)
            return pinned[0], pinned[1]
    pinned = checked_sources(exp)
    for path, what in zip(pinned, SOURCE_KEYS):
        # what a start reads from a folder holding no checkpoint now would be whatever is saved there by the time it
        # reads (the DPO reference at the first step), unchecked; a resume may not read it at all
        if path and not resuming and format_of(Path(path)) is None:
            state = "does not exist" if not Path(path).exists() else "holds no complete checkpoint"
            raise ConfigError(f"{what}={path} {state} (an iter_N or release folder with metadata.json, or a "
                              f"checkpoints folder holding one): give the checkpoint to start from")
    if record is not None and any(given):
        record.parent.mkdir(parents=True, exist_ok=True)
        stamps = [_stamp(Path(p)) if p else None for p in pinned]
        absolute = [str(Path(p).absolute()) if p else p for p in pinned]  # a pruning run reads it too (_kept_for)
        write_atomic(record, json.dumps({"given": given, "pinned": absolute, "stamps": stamps}, indent=1) + "\n")
        if pinned[0] and _reads_base_again(exp):
            pin(Path(pinned[0]), record.parent)
    return pinned


def release_sources(exp: Any, root: Path) -> None:
    """At the end of a run (rank 0): the iteration it read at every start is no longer kept for it (pin)."""
    if exp.checkpoint.load and _reads_base_again(exp):
        unpin(Path(exp.checkpoint.load), root)


def _recorded(record: Path, given: list[str | None]) -> tuple[list[str | None], list[Any]] | None:
    """The iterations a run's first start pinned and their stamps, if it named the same sources as now (a run folder
    started again with other ones pins them anew, with a warning)."""
    try:
        saved = json.loads(record.read_text())
        pinned, stamps = saved["pinned"], saved.get("stamps", [None, None])
        ok = (saved["given"] == given and len(pinned) == 2 and all(p is None or isinstance(p, str) for p in pinned)
              and isinstance(stamps, list) and len(stamps) == 2)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        ok = False
    if not ok:
        log.warning("%s does not hold the sources this run names now (%s): pinning them anew", record,
                    ", ".join(str(g) for g in given if g))
        return None
    return pinned, stamps


def _kept_source(path: Path, what: str, stamp: Any, read_again: bool) -> None:
    """A source a resume keeps: checked again; gone or saved again in place since the first start, a refusal where
    the resume reads it again (read_again), else a warning."""
    if not path.exists():
        problem = "is gone"
    elif stamp is not None and _stamp(path) != stamp:
        problem = "was saved again in place since (its metadata files changed)"
    else:
        problem = None
    if problem and read_again:
        raise ConfigError(f"this run started from {what}={path}, which {problem}: a resume reads it again (a LoRA "
                          f"base, a DPO or GRPO reference), and other weights would change what it trains; restore "
                          f"it, or start a new run")
    if problem:
        log.warning("this run started from %s=%s, which %s (this resume does not read it again)", what, path, problem)
    if path.exists():
        _check(path)


def _reads_base_again(exp: Any) -> bool:
    """Whether every start reads checkpoint.load, a resume too: a LoRA base, DPO's live reference, GRPO's KL
    reference."""
    return (exp.peft.lora is not None or (exp.data.kind == "dpo" and exp.dpo.reference == "live")
            or (exp.data.kind == "grpo" and exp.grpo.kl_coeff > 0))


def _stamp(path: Path) -> list[list[int]]:
    """Size and modification time of an iteration's metadata files, which a save writes last: a checkpoint saved
    again in place (its run's tracker reset, a release converted again) has other ones."""
    files = [f for f in (path / ".metadata", path / "metadata.json", path / FSDP_JSON) if f.is_file()]
    return [[st.st_size, st.st_mtime_ns] for st in map(os.stat, files)]


def _pinned(path: str | None) -> str | None:
    """The iteration a checkpoints root names now (as latest, on this process only), else the path as given (an
    iteration or a release, which a folder inside them does not replace; a folder that is gone)."""
    found = _start_on_disk(Path(path)) if path else None
    return str(found) if found is not None else path


def _start_on_disk(path: Path) -> Path | None:
    return path if format_of(path) is not None else _latest_on_disk(path)


def load_base(path: Path, chunks: list[Any]) -> None:
    """A LoRA run's frozen base model from a full checkpoint (a converted `release`, or a run's iteration), every
    start; no optimizer state (the base has none)."""
    from megatron.core.dist_checkpointing.validation import StrictHandling

    state = read(_model_state(chunks, BASE), path, strict=StrictHandling.LOG_UNEXPECTED)
    _load_model(chunks, state, BASE)


def load_adapters(path: Path, chunks: list[Any], optimizer: Any | None = None) -> None:
    """Adapter weights only (e.g. a PEFT adapter converted by `mcorekit convert hf-to-mcore --lora`): the optimizer
    starts fresh, its fp32 main copy refreshed from them."""

    state = read(_model_state(chunks, ADAPTERS), path)
    _load_model(chunks, state, ADAPTERS)
    if optimizer is not None:
        optimizer.reload_model_params()


def load_weights(path: Path, chunks: list[Any], optimizer: Any | None = None) -> None:
    """Model weights only (e.g. converted from HF): the optimizer starts fresh. Its fp32 main copy of the
    weights was taken when it was built, so it is refreshed here; without that, the first optimizer step
    would write the random initial weights (plus one update) back into the model."""
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if lora_info(chunks) is not None:  # the base was loaded by build (load_base), the adapters start as built
        return
    if is_fsdp(chunks):
        raise RuntimeError("weights go into a Megatron-FSDP model before it is wrapped (train/build.py: "
                           "weights_before_wrap), not into the wrapped one")
    if format_of(path) == FSDP_DTENSOR:
        load_fsdp_weights(path, chunks)
    else:
        state = read(_model_state(chunks), path, strict=StrictHandling.LOG_UNEXPECTED)
        _load_model(chunks, state)
    if optimizer is not None:
        optimizer.reload_model_params()


def load(path: Path, chunks: list[Any], optimizer: Any, scheduler: Any, weights_loaded: bool = False) -> int:
    """Everything: model, optimizer (with its fp32 main weights), scheduler; returns the step to continue from.
    A LoRA model loads its adapters only (the base came from checkpoint.load in build). Across the FSDP boundary
    (see the module's docstring) the weights, scheduler and step, with a fresh optimizer; `weights_loaded`: an FSDP
    model whose weights build loaded from `path` before wrapping."""
    from mcorekit.train.checkpoint_reader import checked_metadata, common_state

    metadata = checked_metadata(path)  # refused here in one line, before any loader reads the checkpoint
    fmt, fsdp = format_of(path), is_fsdp(chunks)
    if fmt == FSDP_DTENSOR and fsdp:
        return _load_fsdp(path, chunks, optimizer, scheduler)
    if fmt == FSDP_DTENSOR:
        load_fsdp_weights(path, chunks, metadata)
        optimizer.reload_model_params()
        info = fsdp_info(path)
        load_schedule(scheduler, from_json(info["scheduler"]), path)
        _fresh_optimizer_warning(path, "a Megatron-FSDP checkpoint", "a run without parallel.fsdp")
        return int(info["iteration"])
    if fsdp:
        if not weights_loaded:
            raise RuntimeError(f"{path} is a torch_dist checkpoint: its weights go into the model before Megatron-FSDP "
                               f"wraps it (train/build.py: weights_before_wrap)")
        common = common_state(path)
        load_schedule(scheduler, common["scheduler"], path)
        _fresh_optimizer_warning(path, "a checkpoint of a run without parallel.fsdp", "parallel.fsdp")
        return int(common["iteration"])

    part = ADAPTERS if lora_info(chunks) is not None else ALL
    if part == ADAPTERS and not (path / LORA_JSON).is_file():
        raise ConfigError(f"{path} is not a LoRA checkpoint (no {LORA_JSON}); a peft.lora run resumes only from its "
                          f"own checkpoints: give the base model as checkpoint.load with checkpoint.finetune=true, "
                          f"or a converted `release`")
    model_sd = _model_state(chunks, part)
    sharded = {**model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=SHARDING)}
    state = read(sharded, path, metadata)  # with the common state (iteration, scheduler) merged in
    optimizer_state, scheduler_state, iteration = state.pop("optimizer"), state.pop("scheduler"), state["iteration"]
    _load_model(chunks, state, part)
    optimizer.load_state_dict(optimizer_state)
    load_schedule(scheduler, scheduler_state, path)
    return int(iteration)


SCHEDULE = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd")  # as saved


def load_schedule(scheduler: Any, saved: dict[str, Any], path: Path) -> None:
    """The checkpoint's position in the schedule (samples seen), with this run's schedule (built with Megatron-Core's
    override_opt_param_scheduler: by default it would keep the checkpoint's peak and minimum lr, warmup and length,
    and a run continuing another with a longer schedule would decay to min_lr at the old end without a word). A
    checkpoint trained with another schedule is said so."""
    other = [f"{k} {saved[k]} -> {getattr(scheduler, k)}" for k in SCHEDULE
             if k in saved and saved[k] != getattr(scheduler, k, saved[k])]
    if other:
        log.warning("%s was trained with another schedule than this run's (%s): this run goes on from its position "
                    "with its own", path, ", ".join(other))
    scheduler.load_state_dict(saved)


def _load_model(chunks: list[Any], state: dict[str, Any], part: str = ALL) -> None:
    for key in ("optimizer", "scheduler", "iteration"):  # load() also returns the checkpoint's common state
        state.pop(key, None)
    for i, c in enumerate(chunks):
        _load_part(unwrap(c), state if len(chunks) == 1 else state[f"model{i}"], part)


def _load_part(model: Any, state: dict[str, Any], part: str) -> None:
    """load_state_dict, strict for the part asked: what it leaves out must be exactly the other part. TE's FP8 extra
    states in `state` were checked with the checkpoint's records (checked_sources, checked_resume)."""
    from mcorekit.train.checkpoint_reader import checked_extra_states

    with checked_extra_states():
        if part == ALL:
            model.load_state_dict(state)
            return
        missing, unexpected = model.load_state_dict(state, strict=False)
    wrong = [k for k in missing if is_adapter_key(k) == (part == ADAPTERS) and not k.endswith("_extra_state")]
    if wrong or unexpected:
        raise RuntimeError(f"loading the {part} part: missing {wrong[:4]}, unexpected {list(unexpected)[:4]}")


# ---------------------------------------------------------------- Megatron-FSDP (fsdp_dtensor)


def weights_before_wrap(exp: Any, root: Path | None) -> Path | None:
    """For a parallel.fsdp run: the checkpoint whose weights build loads into the unwrapped model (Megatron-FSDP
    then copies them into its buffers). The run's own latest checkpoint when it is torch_dist (a run continued
    under FSDP; an fsdp_dtensor one loads whole after wrapping, so None), else checkpoint.load (weights only:
    rules.fsdp_problems asks for checkpoint.finetune=true unless it is a release)."""
    own = latest(root) if root is not None else None
    # rank 0's view of the format too: checked_resume is collective, so every rank must take the same branch
    if own is not None and rank_zero_choice(lambda: format_of(own)) == TORCH_DIST:
        checked_resume(own)  # read here, before the resume that checks it otherwise
        return own
    if own is not None:
        return None
    if exp.checkpoint.load:
        return start_of(exp.checkpoint.load)
    return None


def _fresh_optimizer_warning(path: Path, saved: str, run: str) -> None:
    log.warning("=" * 100)
    log.warning("%s is %s; this is %s. Loaded its WEIGHTS, scheduler and step only: the OPTIMIZER STARTS FRESH "
                "(Adam moments zero), so the next steps differ from an uninterrupted run", path, saved, run)
    log.warning("=" * 100)


def fsdp_info(path: Path) -> dict[str, Any]:
    """The marker of an fsdp_dtensor checkpoint: step, scheduler, the optimizer's non-tensor state, layout."""
    marker, fix = path / FSDP_JSON, "a damaged checkpoint, or one another tool wrote: resume from another iteration"
    if marker.stat().st_size > 64 * 1024**2:  # step, scheduler and the optimizer's param groups: kilobytes
        raise ConfigError(f"{marker}: {marker.stat().st_size:,} bytes, too big for an fsdp_dtensor marker; {fix}")
    try:
        info = json.loads(marker.read_bytes())
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, an integer too long to read
        raise ConfigError(f"{marker}: not valid JSON ({type(e).__name__}); {fix}") from None
    if not isinstance(info, dict) or info.get("format") != FSDP_DTENSOR:
        raise ConfigError(f"{marker} does not describe an fsdp_dtensor checkpoint; {fix}")
    layout, step = info.get("layout"), info.get("iteration")
    bad = [k for k in ("scheduler", "optimizer") if not isinstance(info.get(k), dict)]
    bad += [] if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else ["iteration"]
    bad += [] if isinstance(layout, dict) and all(type(layout.get(k)) is int for k in ("tp", "etp", "ep", "pp")) \
        else ["layout"]
    if bad:
        raise ConfigError(f"{marker}: {', '.join(bad)} missing or of the wrong type; {fix}")
    if path.name.startswith("iter_") and path != iter_dir(path.parent, step):
        raise ConfigError(f"{marker} records iteration {step}, its folder is {path.name}; {fix}")
    return info


def fsdp_model_keys(keys: list[str], num_experts: int | None) -> dict[str, str]:
    """A GPTModel's state-dict keys -> the keys an fsdp_dtensor checkpoint stores them under: this rank's local
    expert indices become global ones (Megatron-Core's handle_experts_in_state_dict, as Megatron-LM saves), the
    rest unchanged. TE's _extra_state entries are left out (Megatron-LM drops them too: FP8 scales restart)."""
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

    named = handle_experts_in_state_dict({k: k for k in keys if not k.endswith("_extra_state")}, num_experts)
    return {local: saved for saved, local in named.items()}


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "etp": ps.get_expert_tensor_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _fsdp_model_state(chunks: list[Any]) -> dict[str, Any]:
    """The model's fsdp_dtensor state: Megatron-FSDP's fp32 main weights as DTensors of its shards (its state-dict
    pre-hook puts them in place of the training weights), under fsdp_model_keys. One chunk: FSDP has no PP."""
    model = unwrap(chunks[0])
    sd = model.state_dict()
    names = fsdp_model_keys(list(sd), model.config.num_moe_experts)
    return {names[k]: v for k, v in sd.items() if k in names}


def _save_fsdp(path: Path, step: int, chunks: list[Any], optimizer: Any, scheduler: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    model_sd = _fsdp_model_state(chunks)  # first: the optimizer names its parameters by the DTensors now in place
    optim_sd = optimizer.sharded_state_dict(model_sd, metadata=FSDP_SHARDING)
    tensors, rest = split_tensors(optim_sd)
    state = {"model": model_sd, "optimizer": tensors}
    preprocess_state_dict_for_uneven_dtensor(state)  # each uneven shard's offsets in the global tensor
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))
    dist.barrier()

    def marker() -> None:  # rank 0's; its failure reaches every rank (rank_zero_choice), none waits for a timeout
        info = {"format": FSDP_DTENSOR, "iteration": step, "scheduler": to_json(scheduler.state_dict()),
                "optimizer": to_json(rest), "layout": _layout(),
                "num_moe_experts": unwrap(chunks[0]).config.num_moe_experts}
        try:
            write_atomic(path / FSDP_JSON, json.dumps(info, indent=1) + "\n")
        except OSError as e:
            raise MCoreKitError(f"checkpoint {path}: its {FSDP_JSON} could not be written: {one_line(e)}; check the "
                                f"file system under {path.parent}, then resume the run") from None

    rank_zero_choice(marker)


def _load_fsdp(path: Path, chunks: list[Any], optimizer: Any, scheduler: Any) -> int:
    """An fsdp_dtensor checkpoint into a Megatron-FSDP model: DCP reads the main weights and the optimizer state in
    place (resharded over DP if that changed), the optimizer takes its non-tensor state from the marker, and the
    main weights are copied into the training weights and gathered."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    from mcorekit.train.checkpoint_reader import RestrictedReader, TensorsOnlyPlanner

    info = fsdp_info(path)
    now, saved = _layout(), info["layout"]
    if (now["tp"], now["etp"]) != (saved["tp"], saved["etp"]):
        raise ConfigError(f"{path} was saved at tp={saved['tp']}, etp={saved['etp']}; this run has tp={now['tp']}, "
                          f"etp={now['etp']}: a Megatron-FSDP checkpoint resumes under parallel.fsdp only at the same "
                          f"TP/ETP (the data-parallel size may change)")
    model_sd = _fsdp_model_state(chunks)
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=FSDP_SHARDING)
    tensors, _ = split_tensors(optim_sd)
    state = {"model": model_sd, "optimizer": tensors}
    preprocess_state_dict_for_uneven_dtensor(state)
    # in place: the DTensors are the parameters
    dcp.load(state, storage_reader=RestrictedReader(str(path)), planner=TensorsOnlyPlanner())
    optimizer.load_state_dict(merge(state["optimizer"], from_json(info["optimizer"])))
    for chunk in chunks:
        chunk.module.install_optimized_model_weights()  # main (fp32) -> training weights (Megatron-FSDP's buffers)
        chunk.start_param_sync(force_sync=True)
    load_schedule(scheduler, from_json(info["scheduler"]), path)
    return int(info["iteration"])


def load_fsdp_weights(path: Path, chunks: list[Any], metadata: Any = None) -> None:
    """The weights of an fsdp_dtensor checkpoint into a model that is not Megatron-FSDP-wrapped (unwrapped, or in
    DDP): DCP reads each tensor whole by its global shape (fp32 main weights, cast on load), this rank takes its
    TP/ETP slice. Same TP/ETP as saved (a SwiGLU fc1 is two halves per TP rank); PP=1; EP may differ. `metadata`:
    its checked .metadata when the caller has read it already."""
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core import parallel_state as ps

    info = fsdp_info(path)
    saved, now = info["layout"], _layout()
    if len(chunks) != 1 or now["pp"] != 1 or (now["tp"], now["etp"]) != (saved["tp"], saved["etp"]):
        raise ConfigError(f"{path} is a Megatron-FSDP checkpoint saved at tp={saved['tp']}, etp={saved['etp']}: its "
                          f"weights load at the same tp/etp with pp=1 (this run: tp={now['tp']}, etp={now['etp']}, "
                          f"pp={now['pp']})")
    model = unwrap(chunks[0])
    own = model.state_dict()
    names = fsdp_model_keys(list(own), model.config.num_moe_experts)
    from mcorekit.train.checkpoint_reader import RestrictedReader, TensorsOnlyPlanner, checked_metadata

    meta = (metadata or checked_metadata(path)).state_dict_metadata  # one line for a refusal, before DCP reads
    reader = RestrictedReader(str(path))
    absent = [saved_key for saved_key in names.values() if f"model.{saved_key}" not in meta]
    if absent:
        raise ConfigError(f"{path} lacks {len(absent)} of this model's tensors (e.g. {absent[:3]}): a different model")
    read = {k: torch.empty(tuple(meta[f"model.{k}"].size), dtype=meta[f"model.{k}"].properties.dtype)
            for k in names.values()}
    dcp.load({"model": read}, storage_reader=reader, planner=TensorsOnlyPlanner())
    params = dict(model.named_parameters())
    ranks = {False: (ps.get_tensor_model_parallel_rank(), now["tp"]),
             True: (ps.get_expert_tensor_parallel_rank(), now["etp"])}
    state = {}
    for local, saved_key in names.items():
        p = params.get(local)
        rank, size = ranks[p is not None and not getattr(p, "allreduce", True)]
        state[local] = local_slice(read[saved_key], p, rank, size)
        if state[local].shape != own[local].shape:
            raise ConfigError(f"{path}: {saved_key} has shape {tuple(read[saved_key].shape)}, this model's {local} "
                              f"{tuple(own[local].shape)}: a different model")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if [k for k in missing if not k.endswith("_extra_state")] or unexpected:
        raise RuntimeError(f"loading {path}: missing {list(missing)[:4]}, unexpected {list(unexpected)[:4]}")


def local_slice(full: Any, param: Any, rank: int, size: int) -> Any:
    """This TP (or expert-TP) rank's part of a tensor saved whole: a tensor-parallel parameter's chunk along its
    partition dimension (an fsdp_dtensor checkpoint's global tensor is the TP ranks' parts side by side)."""
    if param is None or size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(size, dim=param.partition_dim)[rank].contiguous()


# The optimizer's fsdp_dtensor state holds tensors (DCP writes them) and plain values (parameter-group settings,
# written as JSON in the marker, so that loading unpickles nothing of ours).
_ABSENT = object()


def split_tensors(tree: Any) -> tuple[Any, Any]:
    """(tensors, rest): nested dicts with the tensor leaves only, and with every other leaf."""
    import torch

    if isinstance(tree, torch.Tensor):
        return tree, _ABSENT
    if not isinstance(tree, dict):
        return _ABSENT, tree
    tensors, rest = {}, {}
    for k, v in tree.items():
        t, r = split_tensors(v)
        if t is not _ABSENT:
            tensors[k] = t
        if r is not _ABSENT:
            rest[k] = r
    return tensors, rest


def merge(tensors: Any, rest: Any) -> Any:
    """split_tensors undone."""
    if not isinstance(tensors, dict) or not isinstance(rest, dict):
        return tensors if rest is _ABSENT else rest
    out = dict(tensors)
    for k, v in rest.items():
        out[k] = merge(out[k], v) if k in out else v
    return out


def to_json(x: Any) -> Any:
    """Plain values as JSON, keeping what JSON would lose: tuples and non-string dict keys (a chained optimizer's
    indices)."""
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: to_json(v) for k, v in x.items()}
        return {"__items__": [[k, to_json(v)] for k, v in x.items()]}
    if isinstance(x, tuple):
        return {"__tuple__": [to_json(v) for v in x]}
    if isinstance(x, list):
        return [to_json(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot record a {type(x).__name__} of the optimizer's state in {FSDP_JSON}: {x!r}")


def from_json(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"__items__"}:
            return {k: from_json(v) for k, v in x["__items__"]}
        if set(x) == {"__tuple__"}:
            return tuple(from_json(v) for v in x["__tuple__"])
        return {k: from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [from_json(v) for v in x]
    return x
