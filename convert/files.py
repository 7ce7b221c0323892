"""The small files around a checkpoint (config.json, the index, metadata.json, the tracker) read as untrusted
input: each problem is a ConversionError that names the file and says what is wrong, never a traceback; files
that a model directory names stay inside it."""

from __future__ import annotations

import json
import mmap
import os
import re
from pathlib import Path
from typing import Any

import torch

from mcorekit.errors import ConversionError, OutputError, first_line
from mcorekit.outputs import require_inside
from mcorekit.train.checkpoint import RELEASE, TRACKER, tracked

CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # control characters, which no checkpoint writer puts in a name
MAX_JSON_BYTES = 64 * 1024**2  # an index of a trillion-parameter model is a few MB; more is not a config


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or a one-line ConversionError saying why not."""
    if not path.is_file():
        raise ConversionError(f"{path}: missing (or not a regular file)")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror})") from None
    if len(raw) > MAX_JSON_BYTES:
        raise ConversionError(f"{path}: larger than {MAX_JSON_BYTES // 1024**2} MiB, too big for a JSON config or index")
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConversionError(f"{path}: not UTF-8 text (binary data where JSON was expected)") from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ConversionError(f"{path}: JSON nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ConversionError(f"{path}: invalid JSON ({first_line(e)})") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path}: expected a JSON object, found a {type(value).__name__}")
    return value


def model_file(root: Path, name: object, what: str) -> Path:
    """root/name resolved, refused unless it stays inside root: no absolute path, no `..`, no symlink leading
    out. One exception: a Hugging Face hub snapshot (`.../snapshots/REV/`) links its files to `../../blobs/`."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ConversionError(f"{what} names {name!r}: only relative paths inside {root} are read (no absolute path, "
                              f"no '..'); fix the entry")
    if CONTROL.search(name):  # NUL fails in the OS's calls, a newline splits messages; no writer makes either
        raise ConversionError(f"{what} names {name!r}: a file name with a control character is not read; fix the entry")
    try:
        return require_inside(Path(name), root, what)
    except OutputError:
        target = (root / name).resolve()
        home = root.resolve()
        if home.parent.name == "snapshots" and target.parent == home.parent.parent / "blobs":
            return target  # the hub cache's own layout
        raise ConversionError(f"{what}: {root / name} resolves to {target}, outside {root}; only files inside the "
                              f"model folder are read (replace the symlink by the file)") from None


def tracked_iteration(root: Path) -> Path | None:
    """The iteration directory that root's tracker names; None without a tracker. The tracker must hold
    `release` or an iteration number, and that directory must exist."""
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    try:
        with open(tracker, "rb") as f:
            raw = f.read(65)
    except OSError as e:
        raise ConversionError(f"{tracker}: cannot read ({e.strerror})") from None
    text = raw.decode("ascii", errors="replace").strip()
    if len(raw) > 64 or not (text == RELEASE or re.fullmatch(r"[0-9]{1,12}", text)):
        shown = text[:40] + ("..." if len(text) > 40 else "")
        raise ConversionError(f"{tracker}: holds {shown!r}; expected `{RELEASE}` or an iteration number")
    found = tracked(root)
    assert found is not None  # the tracker exists
    if not found.is_dir():
        raise ConversionError(f"{tracker} names {text}, but {found} does not exist; the checkpoint is incomplete")
    return found


def write_failure(path: Path, error: BaseException) -> str:
    """Why writing under `path` failed, in words. torch's zip writer reports a full disk as "unexpected pos",
    so without an errno the free space of the filesystem is looked at (before the staged output is removed)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        stat = os.statvfs(probe)
        free = stat.f_bavail * stat.f_frsize
    except OSError:
        free = None
    if free is not None and free < 1024**2:
        return f"no space left on device ({free} bytes free)"
    return first_line(error)


MAP_BYTES = 1024**2  # tensors this large are mapped rather than read


def read_flat(fd: int, offset: int, nbytes: int, dtype: torch.dtype, may_map: bool = True) -> torch.Tensor:
    """`nbytes` of the file from `offset` as a flat tensor of `dtype`: a private (copy-on-write) mapping of the page
    cache when it is MAP_BYTES or more and `may_map` (nothing copied; unmapped when the tensor is freed), else read
    into fresh memory. EOFError when the file ends first."""
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    if may_map and nbytes >= MAP_BYTES:
        if os.fstat(fd).st_size < offset + nbytes:  # shrunk since its header was checked
            raise EOFError(f"the file ends before byte {offset + nbytes}")
        lead = offset % mmap.ALLOCATIONGRANULARITY
        region = mmap.mmap(fd, nbytes + lead, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                           offset=offset - lead)
        region.madvise(mmap.MADV_WILLNEED)  # the whole tensor's reads start now, not page by page
        return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=lead).view(dtype)
    out = torch.empty(nbytes, dtype=torch.uint8).view(dtype)  # unlike bytearray, not zero-filled before pread
    pread_into(fd, out, offset)
    return out


def pread_into(fd: int, out: torch.Tensor, offset: int) -> None:
    """Fill contiguous `out` with the file's bytes from `offset` (straight into its memory, no buffer between).
    EOFError when the file ends first."""
    view, done, nbytes = memoryview(out.view(-1).view(torch.uint8).numpy()), 0, out.numel() * out.element_size()
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise EOFError(f"the file ends at byte {offset + done}")
        done += got
