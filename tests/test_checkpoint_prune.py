"""train/checkpoint.prune, as a save's finalization calls it on rank 0: the superseded checkpoints stop being
checkpoints before it returns, and are deleted on a thread the process waits for, with what an earlier process
left half-deleted."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from mcorekit.train import checkpoint


def _checkpoints(root: Path, *steps: int, complete: bool = True) -> None:
    for step in steps:
        d = checkpoint.iter_dir(root, step)
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(bytes(4096))
        if complete:  # Megatron-Core writes metadata.json once every rank's part is on disk
            (d / "metadata.json").write_text("{}")


def test_superseded_checkpoints_leave_at_once_and_are_deleted_behind(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _checkpoints(tmp_path, 10, 20, 30, 40)
    left = tmp_path / ".deleting-iter_0000005.123.456"  # a process stopped while deleting it
    left.mkdir()
    (left / "__0_0.distcp").write_bytes(bytes(10))
    release, deleting = threading.Event(), []
    rmtree = shutil.rmtree

    def slow_rmtree(path, ignore_errors=False):  # a slow disk: deletion waits until the test lets it go
        deleting.append(Path(path).name)
        release.wait(30)
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", slow_rmtree)
    thread = checkpoint.prune(tmp_path, checkpoint.iter_dir(tmp_path, 40), keep_last=2)
    assert thread is not None and not thread.daemon
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000030", "iter_0000040"]  # before any delete
    release.set()
    thread.join(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000030", "iter_0000040"]
    assert sorted(name.split(".")[1] for name in deleting) == ["deleting-iter_0000005", "deleting-iter_0000010",
                                                               "deleting-iter_0000020"]
    assert (checkpoint.iter_dir(tmp_path, 30) / "__0_0.distcp").read_bytes() == bytes(4096)


@pytest.mark.parametrize("keep_last, kept", [(1, [40]), (3, [20, 30, 40]), (9, [10, 20, 30, 40])])
def test_keep_last(tmp_path: Path, keep_last: int, kept: list[int]) -> None:
    _checkpoints(tmp_path, 10, 20, 30, 40)
    thread = checkpoint.prune(tmp_path, checkpoint.iter_dir(tmp_path, 40), keep_last)
    if thread is not None:
        thread.join(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.iter_dir(tmp_path, s).name for s in kept]
    assert (thread is None) == (keep_last >= 4)


def test_a_checkpoint_that_cannot_be_renamed_is_kept_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A rename refused (permissions, a folder removed by hand, NFS) must not fail the save: on rank 0 an exception
    there would leave the other ranks waiting at the save's barrier."""
    _checkpoints(tmp_path, 10, 20, 30)
    rename = Path.rename

    def refuse_20(self: Path, target: Path) -> Path:
        if self.name == "iter_0000020":
            raise PermissionError(13, "Permission denied", str(self))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", refuse_20)
    thread = checkpoint.prune(tmp_path, checkpoint.iter_dir(tmp_path, 30), keep_last=1)
    thread.join(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000020", "iter_0000030"]
    assert "could not remove the superseded checkpoint" in caplog.text and "iter_0000020" in caplog.text


def test_this_process_does_not_delete_twice_what_it_is_deleting(tmp_path: Path) -> None:
    import os

    _checkpoints(tmp_path, 40)
    mine = tmp_path / f".deleting-iter_0000030.{os.getpid()}.1"  # an earlier prune's thread of this process has it
    mine.mkdir()
    assert checkpoint.prune(tmp_path, checkpoint.iter_dir(tmp_path, 40), keep_last=2) is None
    assert mine.exists()


def test_only_complete_checkpoints_count_and_none_newer_than_the_latest_goes(tmp_path: Path) -> None:
    """A save that never completed (no metadata.json) is no checkpoint: it neither fills a keep_last place nor survives
    a later save, and one newer than `latest` is left alone. Before, incomplete folders counted by name: a fresh
    run's first save kept an incomplete iter_400 and deleted the complete iter_100 and iter_200."""
    _checkpoints(tmp_path, 100, 200)
    _checkpoints(tmp_path, 150, 400, complete=False)
    _checkpoints(tmp_path, 300)
    thread = checkpoint.prune(tmp_path, checkpoint.iter_dir(tmp_path, 300), keep_last=2)
    thread.join(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000200", "iter_0000300", "iter_0000400"]


@pytest.mark.parametrize("tracker", [None, "abc", "", "-1", "99999999", "20"])
def test_resume_finds_the_newest_complete_checkpoint_whatever_the_tracker_says(tmp_path: Path, tracker: str | None,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A tracker that is missing (a kill between a save and its tracker), unreadable, or names a checkpoint that is
    not complete: resume from the newest complete one, with a warning. Before: step 0 (or a traceback for `abc`)."""
    _checkpoints(tmp_path, 10, 20, 30)
    _checkpoints(tmp_path, 40, complete=False)
    if tracker is not None:
        (tmp_path / checkpoint.TRACKER).write_text(tracker)
    expected = 20 if tracker == "20" else 30  # a tracker naming a complete checkpoint is followed
    assert checkpoint.latest(tmp_path) == checkpoint.iter_dir(tmp_path, expected)
    assert ("the newest complete checkpoint under" in caplog.text) == (tracker != "20")


def _reads(run: Path, iteration: Path) -> None:
    """`run` pinned `iteration` as its source (what its start records: train/checkpoint.SOURCES)."""
    run.mkdir(parents=True, exist_ok=True)
    (run / checkpoint.SOURCES).write_text(json.dumps({"given": [str(iteration.parent), None],
                                                      "pinned": [str(iteration), None], "stamps": [None, None]}))


def test_an_iteration_another_run_reads_at_every_start_is_kept_until_that_run_ends(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A LoRA run (or a DPO or GRPO one with a reference) reads its base at every start: its run's keep_last would
    otherwise prune that iteration while the LoRA run goes on, which then refuses its next restart."""
    base, lora_run = tmp_path / "base", tmp_path / "lora" / "checkpoints"
    _checkpoints(base, 10, 20, 30, 40)
    _reads(lora_run, checkpoint.iter_dir(base, 20))
    checkpoint.pin(checkpoint.iter_dir(base, 20), lora_run)
    checkpoint.pin(checkpoint.iter_dir(base, 20), lora_run)  # every start pins again: one mark
    with caplog.at_level("WARNING", logger="mcorekit.train"):
        thread = checkpoint.prune(base, checkpoint.iter_dir(base, 40), keep_last=1)
    thread.join(30)
    assert sorted(p.name for p in base.glob("iter_*")) == ["iter_0000020", "iter_0000040"]
    assert (f"keeping {checkpoint.iter_dir(base, 20)} beyond checkpoint.keep_last: marked as read at every start by "
            f"{lora_run};") in caplog.text
    checkpoint.unpin(checkpoint.iter_dir(base, 20), lora_run)  # that run finished
    _checkpoints(base, 50)
    thread = checkpoint.prune(base, checkpoint.iter_dir(base, 50), keep_last=1)
    thread.join(30)
    assert sorted(p.name for p in base.glob("iter_*")) == ["iter_0000050"]
    assert list((base / checkpoint.PINS).iterdir()) == []


def test_a_mark_goes_when_its_run_reads_another_iteration_and_keeps_it_when_that_cannot_be_told(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run started again from another source no longer needs its mark: removed. A run not seen from here (deleted,
    or on a mount this machine lacks), a folder or a hand-made file by a mark's name: the iteration is kept, with a
    warning naming where to delete the mark (removing it wrongly would stop that run at its next restart). A name
    that is not a mark's (a copy) counts for nothing. Nothing of it fails the prune."""
    base = tmp_path / "base"
    _checkpoints(base, 10, 20, 30, 40)
    moved_on, unseen = tmp_path / "moved-on" / "checkpoints", tmp_path / "unseen" / "checkpoints"
    _reads(moved_on, checkpoint.iter_dir(base, 40))  # it reads another iteration now
    checkpoint.pin(checkpoint.iter_dir(base, 10), moved_on)
    _reads(unseen, checkpoint.iter_dir(base, 20))
    checkpoint.pin(checkpoint.iter_dir(base, 20), unseen)
    shutil.rmtree(unseen.parent)
    pins = base / checkpoint.PINS
    (pins / "iter_0000010.copy").write_text(str(unseen))
    (pins / "iter_0000030.0123456789abcdef").mkdir()
    with caplog.at_level("WARNING", logger="mcorekit.train"):
        thread = checkpoint.prune(base, checkpoint.iter_dir(base, 40), keep_last=1)
    thread.join(30)
    assert sorted(p.name for p in base.glob("iter_*")) == ["iter_0000020", "iter_0000030", "iter_0000040"]
    assert sorted(p.name for p in pins.iterdir()) == ["iter_0000010.copy", "iter_0000020." + checkpoint._key(unseen),
                                                      "iter_0000030.0123456789abcdef"]
    assert "the run at " + str(moved_on) + " reads another iteration now: mark removed" in caplog.text
    assert (f"keeping {checkpoint.iter_dir(base, 20)} beyond checkpoint.keep_last: marked as read at every start by "
            f"{unseen}; each run takes its mark back when it finishes (if that run is gone, delete its file in "
            f"{pins})") in caplog.text
    assert f"{pins / 'iter_0000030.0123456789abcdef'} (IsADirectoryError)" in caplog.text
