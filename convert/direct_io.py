"""Large writes that go around the page cache (O_DIRECT): a conversion writes every byte once and never reads it
back, and copying it into the page cache was what a conversion spent its CPU on. On the project's CPU machine
(2026-12-03) a buffered pwrite of new file pages ran at 0.31-0.38 GB/s of one core, an O_DIRECT one at 2.9-3.6
GB/s; perf showed 28% of an mcore-to-hf in the kernel's copy into the page cache.

O_DIRECT wants the file offset, the length and the memory aligned (ALIGN). So data goes through a page-aligned
buffer per thread, DIRECT_CHUNK at a time, and the partial blocks at either end of a write go through an ordinary
descriptor of the same file: no block is written both ways, and the closing fsync covers both. Where the file
system refuses O_DIRECT (some FUSE file systems, tmpfs before Linux 6.6), and on NFS and SMB, where a direct write
is a synchronous round trip to the server, everything goes through the page cache, as before."""

from __future__ import annotations

import errno
import io
import mmap
import os
import re
import threading
from pathlib import Path
from typing import Any

from mcorekit.outputs import WRITEBACK_BYTES, start_writeback

# file offsets, lengths and memory of direct writes: the largest logical block size in use, and at least a page (a
# partial block written through the page cache then shares no page with a direct one, also on 64 KiB-page kernels)
ALIGN = max(4096, mmap.PAGESIZE)
DIRECT_CHUNK = 16 * 1024**2  # bytes per direct write, and the size of each thread's aligned buffer

# file systems written through the page cache although they take O_DIRECT: each direct write waits for the server
PAGE_CACHE_FILE_SYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p"})

_local = threading.local()


def file_system(path: str | Path, mountinfo: bytes | None = None) -> str:
    """The type of the file system that holds `path` (the longest mount point above it in /proc/self/mountinfo, or
    in `mountinfo`), '' where that cannot be told."""
    try:
        if mountinfo is None:
            mountinfo = Path("/proc/self/mountinfo").read_bytes()
        target, best, kind = os.path.realpath(path), "", ""
        for line in mountinfo.splitlines():
            mount_fields, _, fs_fields = line.partition(b" - ")
            fields = mount_fields.split()
            if len(fields) < 5 or not fs_fields:
                continue
            # the kernel writes space, tab, newline and backslash in a path as octal escapes (\040 ...)
            mount = os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4]))
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, os.fsdecode(fs_fields.split()[0])
        return kind
    except Exception:  # a hint only: an unreadable table means the direct path is tried
        return ""


def open_direct(path: str | Path) -> int:
    """A write-only descriptor of the existing file `path` that bypasses the page cache, or -1 where the file system
    refuses O_DIRECT or is one of PAGE_CACHE_FILE_SYSTEMS."""
    if file_system(path) in PAGE_CACHE_FILE_SYSTEMS:
        return -1
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except (OSError, AttributeError):  # EINVAL where refused; AttributeError: no O_DIRECT on this OS
        return -1


def _aligned() -> memoryview:
    """This thread's page-aligned buffer of DIRECT_CHUNK bytes (anonymous mmap: aligned to the page)."""
    view = getattr(_local, "view", None)
    if view is None:
        _local.region = mmap.mmap(-1, DIRECT_CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = _local.view = memoryview(_local.region)
    return view


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """All of `data` at `offset`: a full disk can make pwrite write part of it (then 0 bytes) without raising."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def pwrite_direct(direct_fd: int, fd: int, aligned: memoryview, offset: int) -> bool:
    """All of `aligned` (memory, length and offset multiples of ALIGN) at `offset`, through direct_fd. Returns False
    when the file system turned a direct write down (EINVAL), or a short write left the block grid: the rest went
    through fd, and the caller should stop using direct_fd."""
    done = 0
    try:
        while done < len(aligned):
            n = os.pwrite(direct_fd, aligned[done:], offset + done)
            if n == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += n
            if n % ALIGN:
                break
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    if done == len(aligned):
        return True
    pwrite_all(fd, aligned[done:], offset + done)
    return False


def pwrite_around_cache(direct_fd: int, fd: int, data: memoryview, offset: int) -> bool:
    """`data` at `offset` of the file open as both `direct_fd` (O_DIRECT) and `fd`: the whole ALIGN blocks inside it
    through direct_fd, copied DIRECT_CHUNK at a time into this thread's aligned buffer, the partial blocks at its
    ends through fd. Returns False when the file system turned a direct write down: the rest was written through
    fd, and the caller should stop using direct_fd."""
    first = -(-offset // ALIGN) * ALIGN  # the first block boundary at or after offset
    last = (offset + len(data)) // ALIGN * ALIGN
    if last - first < ALIGN:  # no whole block inside
        pwrite_all(fd, data, offset)
        return True
    pwrite_all(fd, data[: first - offset], offset)
    buffer = _aligned()
    for at in range(first, last, DIRECT_CHUNK):
        n = min(DIRECT_CHUNK, last - at)
        buffer[:n] = data[at - offset: at - offset + n]
        if not pwrite_direct(direct_fd, fd, buffer[:n], at):
            pwrite_all(fd, data[at + n - offset:], at + n)
            return False
    pwrite_all(fd, data[last - offset:], last)
    return True


class DirectFile(io.RawIOBase):
    """A new file written front to back (a torch.save stream, a .distcp file) from one thread: whole DIRECT_CHUNKs
    around the page cache as they fill its own aligned buffer, the last partial chunk at close, then fsync. Where
    the file system refuses O_DIRECT, an ordinary file whose written bytes are handed to the kernel's writeback
    every WRITEBACK_BYTES. tell() is the bytes written so far; it cannot seek."""

    def __init__(self, path: str | Path, mode: str = "wb") -> None:
        super().__init__()
        if mode != "wb":
            raise ValueError(f"DirectFile writes new files only, not mode {mode!r}")
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._direct = open_direct(path)
        self._region: mmap.mmap | None = None
        self._buffer = memoryview(b"")
        if self._direct >= 0:
            try:  # the file's own page-aligned buffer
                self._region = mmap.mmap(-1, DIRECT_CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except BaseException:
                os.close(self._direct)
                os.close(self._fd)
                raise
            self._buffer = memoryview(self._region)
        self._flushed = 0  # bytes on their way to the disk, from the start of the file (a multiple of ALIGN
        self._filled = 0  # while direct); bytes waiting in the aligned buffer behind them
        self._handed = 0  # buffered bytes handed to writeback

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True  # for tell(); seek() only answers where the stream is

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._flushed + self._filled

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        here = self.tell()
        if (whence, offset) not in ((io.SEEK_CUR, 0), (io.SEEK_SET, here), (io.SEEK_END, 0)):
            raise io.UnsupportedOperation("DirectFile writes front to back")
        return here

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        done = 0
        buffer = self._buffer
        while done < len(data) and self._direct >= 0:
            n = min(DIRECT_CHUNK - self._filled, len(data) - done)
            buffer[self._filled: self._filled + n] = data[done: done + n]
            self._filled += n
            done += n
            if self._filled == DIRECT_CHUNK:
                self._drain(buffer, DIRECT_CHUNK)
        if done < len(data):  # through the page cache
            pwrite_all(self._fd, data[done:], self._flushed)
            self._flushed += len(data) - done
            if self._flushed - self._handed >= WRITEBACK_BYTES:
                start_writeback(self._fd, self._handed, self._flushed - self._handed)
                self._handed = self._flushed
        return len(data)

    def _drain(self, buffer: memoryview, n: int) -> None:
        """The first n bytes of the buffer (a multiple of ALIGN) to the file at _flushed, through the direct
        descriptor; what is left in the buffer moves to its front. Should the file system turn a direct write down,
        the rest of the buffer goes through the page cache, and so does everything after it."""
        taken = pwrite_direct(self._direct, self._fd, buffer[:n], self._flushed)
        self._flushed += n
        self._filled -= n
        if self._filled:
            buffer[: self._filled] = buffer[n: n + self._filled]
        if not taken:
            os.close(self._direct)
            self._direct = -1
            pwrite_all(self._fd, buffer[: self._filled], self._flushed)
            self._flushed += self._filled
            self._filled = 0

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._direct >= 0:
                buffer = self._buffer
                whole = self._filled // ALIGN * ALIGN
                if whole:
                    self._drain(buffer, whole)
                pwrite_all(self._fd, buffer[: self._filled], self._flushed)  # the last partial block
                self._flushed += self._filled
                self._filled = 0
            os.fsync(self._fd)
        finally:
            for fd in (self._direct, self._fd):
                if fd >= 0:
                    os.close(fd)
            self._direct = self._fd = -1
            self._buffer = memoryview(b"")
            if self._region is not None:
                try:
                    self._region.close()
                except BufferError:  # a failed write's traceback still holds a view of it: freed with that
                    pass
                self._region = None
            super().close()
