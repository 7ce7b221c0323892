"""The end of a job's steps at unit level (no GPU here): validation gives way to a pending stop's save, a failed
background save is written again at once before the job stops, a save's time is checked against the signal lead,
a finished save is fsynced before the tracker moves and older checkpoints go, and a failure of rank 0's part of a
save (its folder, the tracker) is one error on every rank (two gloo ranks) instead of a wait for NCCL's timeout."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from mcorekit.train import checkpoint
from mcorekit.train.loop import save_before_stop, signal_lead_s, validation_due


@pytest.fixture
def stop() -> Iterator[Any]:
    """A StopSignal whose handlers are this process's own again afterwards."""
    from mcorekit.runtime.requeue import StopSignal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        yield StopSignal()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_validation_gives_way_to_a_pending_stop(stop: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Validation ran with a stop pending and spent the signal's lead before the save."""
    due = [s for s in range(1, 31) if validation_due(s, 10, 25, stop, rank=0)]
    assert due == [10, 20, 25, 30] and caplog.text == ""  # its interval and the last step
    stop._handle(signal.SIGUSR2, None)
    assert [s for s in range(1, 31) if validation_due(s, 10, 25, stop, rank=0)] == []
    assert caplog.text.count("validation skipped, a stop signal is pending") == 4
    assert "step 25: validation skipped" in caplog.text


class FakeSaver:
    """Records what save_before_stop asks of a Saver; wait() fails as a background write that failed does."""

    def __init__(self, wait_fails: bool = False, save_fails: bool = False) -> None:
        self.calls: list[Any] = []
        self.wait_fails, self.save_fails = wait_fails, save_fails

    def wait(self) -> None:
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.utils import _wrap_exception

        self.calls.append("wait")
        if self.wait_fails:
            raise CheckpointException("write", {0: _wrap_exception(OSError(28, "No space left on device"))})

    def save(self, step: int, chunks: Any, optimizer: Any, scheduler: Any, wait: bool = False) -> None:
        self.calls.append(("save", step, chunks, wait))
        if self.save_fails:
            raise OSError(28, "No space left on device")


TRAINER = SimpleNamespace(model="model", optimizer="optimizer", scheduler="scheduler")


@pytest.mark.parametrize("saved, wait_fails, calls", [
    (True, False, ["wait"]),  # the checkpoint of this step is complete: never rewritten
    (False, False, ["wait", ("save", 7, "model", True)]),
    (True, True, ["wait", ("save", 7, "model", True)]),  # this step's background write failed: written again now
    (False, True, ["wait", ("save", 7, "model", True)]),  # an earlier step's failed: this one is written now
])
def test_a_failed_background_save_is_written_again_before_the_stop(saved: bool, wait_fails: bool, calls: list[Any],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A background write that failed while the job stopped failed the job with no checkpoint of its last steps."""
    saver = FakeSaver(wait_fails)
    save_before_stop(saver, 7, TRAINER, saved, rank=0)  # type: ignore[arg-type]
    assert saver.calls == calls
    assert ("step 7: the background checkpoint save failed ([Errno 28] No space left on device); saving step 7 now "
            "instead" in caplog.text) == wait_fails


def test_a_failed_save_at_the_stop_still_ends_the_job() -> None:
    saver = FakeSaver(wait_fails=True, save_fails=True)
    with pytest.raises(OSError, match="No space left"):
        save_before_stop(saver, 7, TRAINER, True, rank=0)  # type: ignore[arg-type]
    assert saver.calls == ["wait", ("save", 7, "model", True)]


def _complete(root: Path, step: int) -> Path:
    """iter_N as Megatron-Core leaves it when the save's own finalization is done."""
    path = checkpoint.iter_dir(root, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(100))
    (path / ".metadata").write_bytes(b"m")
    (path / "common.pt").write_bytes(b"c")
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return path


def test_a_save_is_on_disk_before_the_tracker_moves_and_older_ones_go(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With keep_last=1 a crash after pruning could leave no complete checkpoint: metadata.json (Megatron-Core does
    not fsync it) and the folder's entries were not synced before the tracker moved and the old one was deleted."""
    root = tmp_path / "ckpts"
    _complete(root, 10)
    path = _complete(root, 20)
    events: list[str] = []
    fsync, replace = os.fsync, os.replace

    def named(p: str | Path) -> str:
        return str(Path(p).relative_to(tmp_path))

    def recording_fsync(fd: int) -> None:
        events.append("fsync " + named(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(a: str | Path, b: str | Path) -> None:
        events.append(f"replace {named(a)} {named(b)}")
        replace(a, b)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    prune = checkpoint.prune
    monkeypatch.setattr(checkpoint, "prune", lambda *a: (events.append("prune"), prune(*a))[1])
    checkpoint.Saver(root, keep_last=1, async_save=False)._finalize(path, 20, 0.0, 0.0, background=False)
    tracker = f"ckpts/{checkpoint.TRACKER}"
    assert events == ["fsync ckpts/iter_0000020/common.pt", "fsync ckpts/iter_0000020/.metadata",
                      "fsync ckpts/iter_0000020/metadata.json", "fsync ckpts/iter_0000020",
                      f"fsync {tracker}.tmp", f"replace {tracker}.tmp {tracker}", "fsync ckpts", "prune"]
    assert (root / checkpoint.TRACKER).read_text() == "20" and not checkpoint.iter_dir(root, 10).exists()


def test_a_save_slower_than_half_the_signal_lead_is_said_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """The lead (the cluster profile's signal_seconds) was never compared with what a save takes: the save before a
    requeue, with the rest of a step and `scontrol requeue`, must end in it."""
    monkeypatch.setattr(checkpoint.time, "perf_counter", lambda: 1070.0)  # each save below: 1070 - its start
    saver = checkpoint.Saver(tmp_path / "ckpts", keep_last=9, async_save=False, signal_lead_s=120)
    saver._finalize(_complete(saver.root, 10), 10, 1011.0, 0.0, background=False)  # 59 s of 120: fine
    assert caplog.text == ""
    # a background save's 70 s run to the step boundary that found it done: not what a save at once takes
    saver._finalize(_complete(saver.root, 20), 20, 1000.0, 0.0, background=True)
    assert caplog.text == ""
    saver._finalize(_complete(saver.root, 30), 30, 990.0, 0.0, background=False)  # 80 s
    saver._finalize(_complete(saver.root, 40), 40, 980.0, 0.0, background=False)  # 90 s: said once per process
    assert caplog.text.count("more than half") == 1
    assert ("the checkpoint save of step 30 took 80.0 s, more than half of the 120 s the job gets between "
            "Slurm's time-limit signal and the time limit (the cluster profile's signal_seconds): the save before a "
            "requeue may not end in time; raise signal_seconds to 190 or more" in caplog.text)
    quiet = checkpoint.Saver(tmp_path / "local", keep_last=9, async_save=False)  # outside `mcorekit launch`
    quiet._finalize(_complete(quiet.root, 10), 10, 0.0, 0.0, background=False)
    assert caplog.text.count("more than half") == 1


def test_the_signal_lead_comes_from_the_run_folders_profile(tmp_path: Path) -> None:
    assert signal_lead_s(tmp_path) is None  # no cluster.yaml: a run outside the launcher, no signal asked for
    (tmp_path / "cluster.yaml").write_text("name: test\nsignal_seconds: 300\n")
    assert signal_lead_s(tmp_path) == 300
    (tmp_path / "cluster.yaml").write_text("name: test\n")
    assert signal_lead_s(tmp_path) == 120  # the profile's default


def _rank(rank: int, tmp: Path) -> None:
    """One of two gloo ranks: a save whose folder rank 0 cannot make (a file where the checkpoints root goes), then
    a finished save whose tracker rank 0 cannot write (a folder in its place); each rank's error, or its absence."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # a rank left waiting fails the test in a minute
    errors = []
    try:
        for act in (lambda: checkpoint.Saver(tmp / "file", 1, False).save(10, [SimpleNamespace()], None, None),
                    lambda: checkpoint.Saver(tmp / "ckpts", 1, False)._finalize(
                        checkpoint.iter_dir(tmp / "ckpts", 20), 20, 0.0, 0.0, background=False)):
            try:
                act()
                errors.append("no error")
            except Exception as e:  # noqa: BLE001 - recorded for the test
                errors.append(f"{type(e).__name__}: {e}")
        (tmp / f"rank{rank}.txt").write_text("\n".join(errors))
    finally:
        dist.destroy_process_group()


def test_rank_0s_failure_in_a_save_stops_every_rank_in_one_line(tmp_path: Path) -> None:
    """Rank 0 alone makes the iteration folder and writes the tracker; an error there left the other ranks waiting
    at a barrier until NCCL's timeout (300 s). Now every rank raises it, the others naming rank 0."""
    import torch.multiprocessing as mp

    (tmp_path / "file").write_text("")  # not a folder: iter_0000010 cannot be made inside it
    _complete(tmp_path / "ckpts", 20)
    (tmp_path / "ckpts" / checkpoint.TRACKER).mkdir()  # the tracker cannot be replaced
    mp.spawn(_rank, args=(tmp_path,), nprocs=2)
    rank0, rank1 = ((tmp_path / f"rank{r}.txt").read_text().splitlines() for r in (0, 1))
    folder = tmp_path / "file" / "iter_0000010"
    assert rank0[0] == (f"MCoreKitError: cannot prepare {folder} for the checkpoint of step 10: {folder}: Not a "
                        f"directory; check the file system under {tmp_path / 'file'} (space, permissions, a file in "
                        f"the way), then resume the run")
    tracker = tmp_path / "ckpts" / checkpoint.TRACKER
    assert rank0[1] == (f"MCoreKitError: checkpoint {tmp_path / 'ckpts' / 'iter_0000020'} was written but could not "
                        f"be made the latest: {tracker}.tmp: Is a directory; check the file system under "
                        f"{tmp_path / 'ckpts'} (its {checkpoint.TRACKER} names the previous checkpoint, which a "
                        f"resume takes)")
    assert rank1 == [line.replace("MCoreKitError: ", "MCoreKitError: rank 0: ") for line in rank0]
    assert checkpoint.iter_dir(tmp_path / "ckpts", 20).is_dir()  # nothing pruned after the failure


def test_a_half_written_folder_is_replaced(tmp_path: Path) -> None:
    """What an interrupted save left (metadata.json included) goes before the save writes into the folder."""
    saver = checkpoint.Saver(tmp_path, keep_last=1, async_save=False)
    path = _complete(tmp_path, 10)
    saver.new_folder(path, 10, {"rank": 8})
    assert sorted(p.name for p in path.iterdir()) == [checkpoint.LORA_JSON]
