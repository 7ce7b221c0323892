"""Where commands write: a staged folder renamed into place only when complete, never over an input, and
`--force` replacing only what an earlier mcorekit command wrote (recognised by a marker file in it).

Every command that writes a directory (convert, export) goes through `staged_output`; the rules are here once.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from mcorekit.errors import OutputError

MARKER = ".mcorekit-output"  # written last into every output folder; its content names the command

# Written bytes are handed to the kernel's writeback every WRITEBACK_BYTES, so the disk writes while the next data
# is still being made instead of all at the closing fsync (which is still what makes the file durable).
WRITEBACK_BYTES = 32 * 1024**2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing back this range of fd without waiting (POSIX_FADV_DONTNEED); a hint only."""
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass


_crc32 = {"lock": threading.Lock(), "depth": 0, "before": True}


@contextmanager
def without_crc32() -> Iterator[None]:
    """torch.save without the CRC-32 of each record: nothing that reads these checkpoints checks it (torch.load does
    not, mcorekit/torch_save.py neither for tensor records) and computing it is one CPU pass over every byte written,
    ~4 GB/s on one core, in the writer thread while it holds the GIL. The archives stay valid for torch.load;
    `unzip -t` would report their CRCs as wrong. A forked background writer inherits the setting. The setting is
    the process's: blocks that overlap (on several threads) share one, and the last to end restores it."""
    import torch

    with _crc32["lock"]:
        if _crc32["depth"] == 0:
            _crc32["before"] = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc32["depth"] += 1
    try:
        yield
    finally:
        with _crc32["lock"]:
            _crc32["depth"] -= 1
            if _crc32["depth"] == 0:
                torch.serialization.set_crc32_options(_crc32["before"])


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path`, whole or not at all: written aside, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def overlaps(a: Path, b: Path) -> bool:
    """True when a and b are the same path or one lies inside the other (symlinks resolved)."""
    a, b = a.resolve(), b.resolve()
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def check_output(out: Path, inputs: Iterable[Path], force: bool) -> Path:
    """The resolved output path, once it is safe to (re)place it: it neither is, contains nor lies inside any
    input, and an existing one is replaced only with --force and only if an mcorekit command wrote it."""
    out = Path(out).resolve()
    for src in inputs:
        if src is not None and overlaps(out, Path(src)):
            raise OutputError(f"output {out} overlaps the input {Path(src).resolve()} (the same folder, inside it, or "
                              f"containing it); write somewhere else (--force never replaces an input)")
    if out.exists() or out.is_symlink():
        if not force:
            raise OutputError(f"output {out} exists; pass --force to replace it")
        if not (out.is_dir() and (out / MARKER).is_file()):
            raise OutputError(f"output {out} exists and was not written by mcorekit (no {MARKER} in it); --force "
                              f"replaces only an earlier mcorekit output: remove it yourself or choose another path")
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _aside(out: Path, kind: str) -> Path:
    """`.OUT.KIND-PID@HOST`: the host too, as a process id says nothing about a process on another node of a shared
    file system."""
    return out.with_name(f".{out.name}.{kind}-{os.getpid()}@{socket.gethostname()}")


def remove_stale(out: Path, inputs: Iterable[Path] = ()) -> None:
    """Clear what killed runs of this host left beside `out` (their process no longer exists): `.OUT.partial-PID@HOST`,
    a staged output (complete once it holds the marker, written before the two renames that put it in place), and
    `.OUT.old-PID@HOST`, the previous output that the first rename moved aside. A kill between the renames leaves no
    `out`: the complete one of the two, the new one first, is moved into place instead of removed. Another host's
    are left alone (whether its process lives cannot be told from here), and so is an input with such a name."""
    stale, here = [], socket.gethostname()
    for leftover in sorted(out.parent.glob(f".{out.name}.*-*")):
        name, _, host = leftover.name[len(out.name) + 2:].partition("@")
        kind, _, pid = name.rpartition("-")
        if kind in ("partial", "old") and pid.isdigit() and host in ("", here) and not pid_alive(int(pid)) \
                and not any(overlaps(leftover, Path(src)) for src in inputs if src is not None):
            stale.append((kind != "partial", leftover))  # sorts the staged (newer) output first
    complete = [p for _, p in sorted(stale) if (p / MARKER).is_file()]
    if complete and not out.exists():
        try:
            complete[0].rename(out)
        except OSError:  # another run put an output there first, or moved this one: leave it be
            pass
        stale = [(k, p) for k, p in stale if p != complete[0]]
    for _, leftover in stale:
        shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def staged_output(out: Path, force: bool, inputs: Iterable[Path] = (), command: str = "mcorekit") -> Iterator[Path]:
    """Yield a temporary sibling of `out`; it becomes `out` (with the marker) only if the body finishes.
    On any error the temporary folder is removed and `out` is left as it was."""
    inputs = list(inputs)
    out = check_output(out, inputs, force)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {out.parent}: {e.strerror}") from None
    remove_stale(out, inputs)
    check_output(out, inputs, force)  # again: remove_stale may have moved an earlier output back into place
    tmp = _aside(out, "partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:
        raise OutputError(f"cannot write in {out.parent}: {e.strerror}") from None
    try:
        yield tmp
        (tmp / MARKER).write_text(command + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = _aside(out, "old")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def require_inside(path: Path, root: Path, what: str) -> Path:
    """`path` resolved, if it lies inside `root` (no `..`, no absolute path or symlink leading out)."""
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise OutputError(f"{what} names {path}, which is outside {root}; only files inside the folder are read")
    return resolved
