"""mcorekit/outputs.py: what a command finds beside its output from killed runs. Real folders, named with a PID no
process can have (the dead run's); no conversion runs here (tests/test_faults_convert.py kills real ones)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcorekit.errors import OutputError
from mcorekit.outputs import MARKER, staged_output


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """A PID no process can have (above the kernel's limit), so no reuse can make it alive."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def folder(path: Path, text: str, marker: bool) -> Path:
    path.mkdir()
    (path / "data.txt").write_text(text)
    if marker:
        (path / MARKER).write_text("mcorekit convert\n")
    return path


def contents(path: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("marker", [False, True])
def test_an_input_named_like_a_killed_runs_leftover_is_never_removed(tmp_path: Path, dead_pid: int,
                                                                     marker: bool) -> None:
    """It was removed before the run started, without --force (an earlier output used as the input included)."""
    src = folder(tmp_path / f".out.old-{dead_pid}", "the input", marker)
    before = contents(src)
    with staged_output(tmp_path / "out", False, inputs=[src]) as stage:
        (stage / "data.txt").write_text(contents(src)["data.txt"] + ", converted")
    assert contents(src) == before
    assert (tmp_path / "out" / "data.txt").read_text() == "the input, converted"


@pytest.mark.parametrize("staged_complete", [True, False])
def test_a_kill_between_the_two_renames_loses_no_complete_output(tmp_path: Path, dead_pid: int,
                                                                 staged_complete: bool) -> None:
    """Killed after the old output was moved aside and before the staged one took its place: no `out`, the old one as
    `.out.old-PID`, the staged one as `.out.partial-PID` (complete: it holds the marker). The next run puts the
    staged one in place, or the old one if the staged one is not complete, and replaces it only with --force."""
    out = tmp_path / "out"
    folder(tmp_path / f".out.old-{dead_pid}", "previous", marker=True)
    folder(tmp_path / f".out.partial-{dead_pid}", "staged", marker=staged_complete)
    with pytest.raises(OutputError, match="exists; pass --force"):
        with staged_output(out, False):
            pass
    assert (out / "data.txt").read_text() == ("staged" if staged_complete else "previous")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with staged_output(out, True) as stage:
        (stage / "data.txt").write_text("new")
    assert (out / "data.txt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_another_hosts_leftovers_are_left_alone_and_this_hosts_cleared(tmp_path: Path, dead_pid: int) -> None:
    """On a shared file system a PID names a process of the host that wrote it: a run on another node may be alive
    with a PID that is free here. Legacy names without a host count as this host's."""
    import socket

    here = socket.gethostname()
    theirs = [folder(tmp_path / f".out.partial-{dead_pid}@node-other-17", "theirs", marker=True),
              folder(tmp_path / f".out.old-{dead_pid}@node-other-17", "theirs, old", marker=True)]
    folder(tmp_path / f".out.partial-{dead_pid}@{here}", "ours", marker=False)
    folder(tmp_path / f".out.old-{dead_pid}", "ours, old", marker=False)
    with staged_output(tmp_path / "out", False) as stage:
        assert stage.name.endswith(f"@{here}")
        (stage / "data.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *(p.name for p in theirs)])
    assert (tmp_path / "out" / "data.txt").read_text() == "new"
