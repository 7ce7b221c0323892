"""convert/direct_io.py: writes around the page cache give the same bytes as plain writes, on this machine's ext4
(which takes O_DIRECT: the tests check that the direct descriptor carried the whole blocks) and where the file
system refuses it, at open or at a write (simulated: EINVAL, as tmpfs and some network file systems answer)."""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path
from typing import Iterator

import pytest

from mcorekit.convert import direct_io
from mcorekit.convert.direct_io import ALIGN, DirectFile, open_direct, pwrite_around_cache

HERE = Path(__file__).resolve().parent  # a disk file system, unlike a tmpfs /tmp on some machines


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder on a file system that takes O_DIRECT (pytest's tmp_path where it does, else next to the tests)."""
    probe = tmp_path / "probe"
    probe.touch()
    fd = open_direct(probe)
    if fd >= 0:
        os.close(fd)
        yield tmp_path
        return
    import tempfile

    folder = Path(tempfile.mkdtemp(dir=HERE))
    yield folder
    import shutil

    shutil.rmtree(folder)


class DirectBytes:
    """Counts the bytes os.pwrite writes through each descriptor (the test's spy on the real call)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.by_fd: dict[int, int] = {}
        self.lock = threading.Lock()
        real = os.pwrite

        def spy(fd: int, data, offset: int) -> int:
            n = real(fd, data, offset)
            with self.lock:
                self.by_fd[fd] = self.by_fd.get(fd, 0) + n
            return n

        monkeypatch.setattr(direct_io.os, "pwrite", spy)


def pieces(seed: int, count: int = 40) -> list[tuple[int, bytes]]:
    """(offset, bytes) that tile a file without gaps: sizes from 0 to a few blocks and one of several MB, starting
    at an unaligned offset."""
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 7, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN + 5, 70_000]) for _ in range(count)]
    sizes[count // 2] = direct_io.DIRECT_CHUNK + 3 * ALIGN + 11  # more than one aligned buffer's worth
    out, at = [], 123
    for n in sizes:
        out.append((at, rng.randbytes(n)))
        at += n
    return out


def test_pwrite_around_cache_writes_whole_blocks_directly_from_two_threads_in_any_order(
        disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = DirectBytes(monkeypatch)
    path = disk_dir / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    direct = open_direct(path)
    assert direct >= 0
    parts = pieces(0)
    random.Random(1).shuffle(parts)
    taken: list[bool] = []

    def writer(mine: list[tuple[int, bytes]]) -> None:
        for offset, data in mine:
            taken.append(pwrite_around_cache(direct, fd, memoryview(data), offset))

    threads = [threading.Thread(target=writer, args=(parts[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.fsync(fd)
    os.close(direct)
    os.close(fd)
    want = b"\0" * 123 + b"".join(d for _, d in sorted(parts))
    assert path.read_bytes() == want and all(taken)
    whole_blocks = sum(max(0, (o + len(d)) // ALIGN - -(-o // ALIGN)) * ALIGN for o, d in parts)
    assert spy.by_fd[direct] == whole_blocks > direct_io.DIRECT_CHUNK
    assert spy.by_fd[fd] == len(want) - 123 - whole_blocks


def test_a_refused_direct_write_goes_through_the_page_cache(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = disk_dir / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    direct = open_direct(path)
    real = os.pwrite

    def refuse_direct(f: int, data, offset: int) -> int:
        if f == direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(f, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", refuse_direct)
    data = random.Random(2).randbytes(5 * ALIGN + 77)
    assert pwrite_around_cache(direct, fd, memoryview(data), 100) is False
    os.close(direct)
    os.close(fd)
    assert path.read_bytes() == b"\0" * 100 + data


@pytest.mark.parametrize("how", ["direct", "refused at open", "refused at a write"])
def test_direct_file_holds_what_was_written_and_tells_where(disk_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                             how: str) -> None:
    spy = DirectBytes(monkeypatch)
    if how == "refused at open":
        monkeypatch.setattr(direct_io, "open_direct", lambda path: -1)
    path, parts, told = disk_dir / "f.distcp", pieces(3), []
    with DirectFile(path) as f:
        direct = f._direct
        if how == "refused at a write":
            counting = os.pwrite

            def refuse(fd: int, data, offset: int) -> int:
                if fd == direct:
                    raise OSError(errno.EINVAL, "Invalid argument")
                return counting(fd, data, offset)

            monkeypatch.setattr(direct_io.os, "pwrite", refuse)
        for _, data in parts:
            told.append(f.tell())
            assert f.write(data) == len(data)
        assert f.seek(0, os.SEEK_CUR) == f.tell()
        with pytest.raises(OSError):
            f.seek(0)
    want = b"".join(d for _, d in parts)
    assert path.read_bytes() == want
    assert told == [o - 123 for o, _ in parts]
    if how == "direct":
        assert spy.by_fd[direct] == len(want) // ALIGN * ALIGN  # all but the last partial block


def test_direct_file_takes_writes_through_a_buffered_writer(disk_dir: Path) -> None:
    """As DCP's stream wraps it (torch_dist._AligningStream is a BufferedWriter): small writes gathered, tell() right."""
    import io

    import torch

    path = disk_dir / "t.pt"
    tensor = torch.arange(300_000, dtype=torch.float32)
    with io.BufferedWriter(DirectFile(path)) as f:
        f.write(b"x" * 10)
        assert f.tell() == 10
        torch.save(tensor, f)
        end = f.tell()
    assert path.stat().st_size == end
    with open(path, "rb") as f:
        assert f.read(10) == b"x" * 10
        assert torch.equal(torch.load(f, weights_only=True), tensor)


MOUNTINFO = """\
22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:35 / /home rw,relatime shared:20 - nfs4 filer:/home rw,vers=4.2
41 40 0:36 / /home/scratch\\040space rw,relatime shared:21 - lustre 10.0.0.1@o2ib:/fs rw
42 22 0:37 / /dev/shm rw,nosuid shared:3 - tmpfs tmpfs rw
"""


@pytest.mark.parametrize("path, kind", [("/", "ext4"), ("/work/x", "ext4"), ("/home/me/ckpt", "nfs4"),
                                        ("/home/scratch space/run", "lustre"), ("/home/scratchy", "nfs4"),
                                        ("/dev/shm/f", "tmpfs")])
def test_file_system_is_the_longest_mount_above_the_path(path: str, kind: str) -> None:
    from mcorekit.convert.direct_io import file_system

    assert file_system(path, MOUNTINFO) == kind


def test_nfs_is_written_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On NFS a direct write waits for the server: open_direct says no there, though the file system would take it."""
    (tmp_path / "f").touch()
    monkeypatch.setattr(direct_io, "file_system", lambda path: "nfs4")
    assert open_direct(tmp_path / "f") == -1
