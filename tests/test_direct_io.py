"""convert/direct_io.py: writes around the page cache give the same bytes as plain writes, on a file system that
takes O_DIRECT (the tests check that a descriptor opened with it carried the whole blocks; skipped where pytest's
temporary folder refuses it) and where the file system refuses it, at open or at a write (simulated: EINVAL, as
file systems without O_DIRECT answer)."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import random
import threading
from pathlib import Path

import pytest

from mcorekit.convert import direct_io
from mcorekit.convert.direct_io import ALIGN, DirectFile, open_direct, pwrite_around_cache


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """pytest's temporary folder, where its file system takes O_DIRECT."""
    probe = tmp_path / "probe"
    probe.touch()
    fd = open_direct(probe)
    if fd < 0:
        pytest.skip(f"{tmp_path}: its file system does not take O_DIRECT (or is written through the page cache)")
    os.close(fd)
    return tmp_path


def refusing_direct_writes(monkeypatch: pytest.MonkeyPatch, direct: int, code: int = errno.EINVAL) -> None:
    """os.pwrite fails with `code` for the direct descriptor: EINVAL as a file system without O_DIRECT for these
    writes answers, ENOSPC as a full disk does."""
    real = os.pwrite

    def refuse(fd: int, data, offset: int) -> int:
        if fd == direct:
            raise OSError(code, os.strerror(code))
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", refuse)


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
    assert fcntl.fcntl(direct, fcntl.F_GETFL) & os.O_DIRECT
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
    refusing_direct_writes(monkeypatch, direct)
    data = random.Random(2).randbytes(5 * ALIGN + 77)
    assert pwrite_around_cache(direct, fd, memoryview(data), 100) is False
    os.close(direct)
    os.close(fd)
    assert path.read_bytes() == b"\0" * 100 + data


def test_a_short_direct_write_off_the_block_grid_ends_the_direct_path(disk_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A direct write that takes part of its bytes, not a whole number of blocks: the rest through the page cache."""
    path = disk_dir / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    direct = open_direct(path)
    real = os.pwrite

    def short(f: int, data, offset: int) -> int:  # the direct descriptor takes 5000 bytes (the test puts them there)
        return real(fd, data[:5000], offset) if f == direct else real(f, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", short)
    data = random.Random(4).randbytes(6 * ALIGN)
    assert pwrite_around_cache(direct, fd, memoryview(data), 0) is False
    os.close(direct)
    os.close(fd)
    assert path.read_bytes() == data


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
            refusing_direct_writes(monkeypatch, direct)
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


def test_a_failed_direct_write_is_raised_as_it_is_and_the_file_closed(disk_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk under DirectFile: the OSError with its errno reaches the caller (not a BufferError from closing
    the buffer a traceback still holds), and the file counts as closed."""
    f = DirectFile(disk_dir / "full.distcp")
    refusing_direct_writes(monkeypatch, f._direct, errno.ENOSPC)
    with pytest.raises(OSError) as failed:
        with io.BufferedWriter(f) as stream:
            stream.write(bytes(direct_io.DIRECT_CHUNK + 1))
    assert failed.value.errno == errno.ENOSPC and f.closed


def test_direct_file_takes_writes_through_a_buffered_writer(disk_dir: Path) -> None:
    """As DCP's stream wraps it (torch_dist._AligningStream is a BufferedWriter): small writes gathered, tell()
    right."""
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


MOUNTINFO = b"""\
22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:35 / /home rw,relatime shared:20 - nfs4 filer:/home rw,vers=4.2
41 40 0:36 / /home/scratch\\040space rw,relatime shared:21 - lustre 10.0.0.1@o2ib:/fs rw
42 22 0:37 / /dev/shm rw,nosuid shared:3 - tmpfs tmpfs rw
43 22 0:38 / /mnt/a\\134b rw,relatime shared:4 - nfs filer:/ab rw
44 22 0:39 / /media/m\xfcller rw,relatime shared:5 - vfat /dev/sdb1 rw
"""


@pytest.mark.parametrize("path, kind", [("/", "ext4"), ("/work/x", "ext4"), ("/home/me/ckpt", "nfs4"),
                                        ("/home/scratch space/run", "lustre"), ("/home/scratchy", "nfs4"),
                                        ("/dev/shm/f", "tmpfs"), ("/mnt/a\\b/ckpt", "nfs"),
                                        (os.fsdecode(b"/media/m\xfcller/x"), "vfat")])
def test_file_system_is_the_longest_mount_above_the_path(path: str, kind: str) -> None:
    from mcorekit.convert.direct_io import file_system

    assert file_system(path, MOUNTINFO) == kind


def test_an_unreadable_mount_table_leaves_the_direct_path_to_be_tried() -> None:
    from mcorekit.convert.direct_io import file_system

    assert file_system("/x", b"\xff\xfe garbage without fields\n") == ""
    assert file_system("/x", 42) == ""  # not even bytes: no exception escapes


def test_nfs_is_written_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On NFS a direct write waits for the server: open_direct says no there, though the file system would take it."""
    (tmp_path / "f").touch()
    monkeypatch.setattr(direct_io, "file_system", lambda path: "nfs4")
    assert open_direct(tmp_path / "f") == -1
