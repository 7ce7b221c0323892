"""A stored tensor chunk (a `torch.save` archive of one tensor) parsed without running anything from it.

torch.distributed.checkpoint stores each tensor chunk as a `torch.save` archive (an uncompressed zip) at the offset
and length that `.metadata` gives. Its `data.pkl` describes the tensor (storage type, element count, offset, size,
strides) and `data/<key>` holds the storage's bytes. Here the zip directory is read with `zipfile` (which only
parses) and `data.pkl` is disassembled with `pickletools.genops` and evaluated symbolically: the few opcodes that
`torch.save` of one tensor uses build plain ints, strings and tuples, globals stay names, nothing is imported or
called. Anything else (another opcode, another callable, a compressed record, a second storage, bytes that do not
fit) is refused with a reason. The caller then reads the storage's bytes straight into a tensor (the converter's
reader, convert/torch_dist.py) or views them where they were read (the resume load, train/checkpoint_reader.py).

Like `torch.load`, the data record's CRC-32 is not checked (that would cost a pass over every byte); our writers
write none (mcorekit.outputs.without_crc32), and data.pkl's is checked where one was written.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickletools
import struct
import zipfile
from dataclasses import dataclass
from typing import Callable

import torch
from torch.storage import _dtype_to_storage_type_map

STORAGE_DTYPES = {name: dtype for dtype, name in _dtype_to_storage_type_map().items()}
MAX_PICKLE_BYTES = 1024**2  # data.pkl of one tensor is ~200 bytes
LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes
END = struct.Struct("<4s4H2IH")  # zip end of central directory record, 22 bytes (torch.save writes no comment)
ZIP64_LOCATOR = struct.Struct("<4sIQI")  # zip64 end of central directory locator, 20 bytes
ZIP64_END = struct.Struct("<4sqHH2L4q")  # zip64 end of central directory record, 56 bytes (zipfile's layout)
# torch.save of one tensor writes 7 entries, a directory of ~460 bytes; zipfile reads and parses however many the
# end records claim before anything else can be checked
MAX_ENTRIES, MAX_DIRECTORY_BYTES = 64, 64 * 1024


class NotATensorChunk(ValueError):
    """The stored bytes are not one tensor as torch.save writes it; the message says why."""


@dataclass(frozen=True)
class StoredTensor:
    """One stored chunk: its storage's bytes at `data_offset` (from the start of the file), `numel` elements of
    `dtype`, and the tensor as a strided view of that storage."""

    data_offset: int
    dtype: torch.dtype
    numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def is_dense(self) -> bool:
        """The tensor is its whole storage, row-major: its bytes are the chunk's elements in order."""
        expect, run = [0] * len(self.size), 1
        for i in reversed(range(len(self.size))):
            expect[i] = run
            run *= self.size[i]
        # strides of size-1 dimensions do not matter
        return self.storage_offset == 0 and self.numel == run and all(
            s == e for d, s, e in zip(self.size, self.stride, expect) if d != 1)


class _Window(io.RawIOBase):
    """Bytes [0, length) of a chunk as a seekable file for zipfile, each read through `read_at(buffer, position)`
    (pread from a file, or a slice of a record already in memory: nothing is copied but what zipfile asks for)."""

    def __init__(self, read_at: Callable[[memoryview, int], int], length: int) -> None:
        self.read_at, self.length, self.pos = read_at, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        if base + pos < 0:
            raise OSError("seek before the start of the chunk")
        self.pos = base + pos
        return self.pos

    def readinto(self, b: bytearray | memoryview) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        got = self.read_at(memoryview(b)[:n], self.pos) if n else 0
        self.pos += got
        return got

    def read_exactly_at(self, pos: int, n: int) -> bytes:
        self.seek(pos)
        return self.read(n) or b""


class _Global:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _Persistent:
    __slots__ = ("pid",)

    def __init__(self, pid: object) -> None:
        self.pid = pid


class _Call:
    __slots__ = ("fn", "args")

    def __init__(self, fn: object, args: object) -> None:
        self.fn, self.args = fn, args


_INTS = {"BININT", "BININT1", "BININT2", "LONG1"}
_STRINGS = {"BINUNICODE", "SHORT_BINUNICODE"}
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}


def evaluate(pkl: bytes) -> object:
    """The value of a pickle built from plain values only: ints, strings, booleans and tuples; a global is a
    _Global holding its name, a persistent id a _Persistent, a call (REDUCE) a _Call. Nothing is looked up or
    run. ValueError for any other opcode or a malformed stream."""
    stack: list[object] = []
    marks: list[int] = []
    memo: dict[int, object] = {}
    try:
        for op, arg, _ in pickletools.genops(pkl):
            name = op.name
            if name == "PROTO":
                continue
            if name == "STOP":
                if len(stack) != 1 or marks:
                    raise ValueError("unbalanced stack at STOP")
                return stack[0]
            if name == "GLOBAL":
                stack.append(_Global(str(arg).replace(" ", ".", 1)))
            elif name == "MARK":
                marks.append(len(stack))
            elif name in ("BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[int(arg)])
            elif name in _INTS or name in _STRINGS:
                stack.append(arg)
            elif name in ("NEWFALSE", "NEWTRUE"):
                stack.append(name == "NEWTRUE")
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in _TUPLES:
                n = _TUPLES[name]
                if len(stack) - (marks[-1] if marks else 0) < n:
                    raise ValueError(f"{name} on a short stack")
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif name == "TUPLE":
                start = marks.pop()
                items = tuple(stack[start:])
                del stack[start:]
                stack.append(items)
            elif name == "BINPERSID":
                stack.append(_Persistent(stack.pop()))
            elif name == "REDUCE":
                args = stack.pop()
                stack.append(_Call(stack.pop(), args))
            else:
                raise ValueError(f"opcode {name}, which torch.save of a tensor does not write")
            if marks and marks[-1] > len(stack):
                raise ValueError("stack below the last mark")
    except (IndexError, KeyError) as e:
        raise ValueError(f"malformed pickle ({type(e).__name__})") from None
    raise ValueError("no STOP opcode")


def _is_global(v: object, name: str) -> bool:
    return isinstance(v, _Global) and v.name == name


def _ints(v: object) -> tuple[int, ...] | None:
    return v if isinstance(v, tuple) and all(type(d) is int and d >= 0 for d in v) else None


def describe(pkl: bytes) -> tuple[torch.dtype, str, int, int, tuple[int, ...], tuple[int, ...]]:
    """(dtype, storage key, storage elements, storage offset, size, stride) of the one tensor that `data.pkl`
    rebuilds, or NotATensorChunk."""
    try:
        value = evaluate(pkl)
    except ValueError as e:
        raise NotATensorChunk(f"data.pkl is not a saved tensor ({e})") from None
    if not (isinstance(value, _Call) and _is_global(value.fn, "torch._utils._rebuild_tensor_v2")
            and isinstance(value.args, tuple) and len(value.args) == 6):
        raise NotATensorChunk("data.pkl does not rebuild one plain tensor (torch._utils._rebuild_tensor_v2)")
    persistent, storage_offset, size, stride, requires_grad, hooks = value.args
    pid = persistent.pid if isinstance(persistent, _Persistent) else None
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)):
        raise NotATensorChunk("data.pkl names its storage in an unknown way")
    _, storage_type, key, _location, numel = pid
    module, _, type_name = storage_type.name.rpartition(".")
    dtype = STORAGE_DTYPES.get(type_name) if module == "torch" else None
    if dtype is None:
        raise NotATensorChunk(f"data.pkl names storage type {storage_type.name}, which is not a plain dtype's")
    if not (isinstance(key, str) and type(numel) is int and numel >= 0 and type(storage_offset) is int
            and storage_offset >= 0 and _ints(size) is not None and _ints(stride) is not None
            and len(size) == len(stride) and requires_grad is False and isinstance(hooks, _Call)
            and _is_global(hooks.fn, "collections.OrderedDict") and hooks.args == ()):
        raise NotATensorChunk("data.pkl holds an unexpected tensor description")
    if math.prod(size) >= 2**62:  # stride-0 dimensions can claim any size within the storage
        raise NotATensorChunk(f"data.pkl describes a tensor of {size} elements")
    last = storage_offset + sum((d - 1) * s for d, s in zip(size, stride)) if all(size) else storage_offset - 1
    if last >= numel:
        raise NotATensorChunk(f"data.pkl describes a tensor {size} with strides {stride} beyond its storage of {numel}")
    return dtype, key, numel, storage_offset, tuple(size), tuple(stride)


def _read_record(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """A small record's bytes, CRC-checked by zipfile where the writer wrote a CRC; torch.save with CRC-32s off
    (mcorekit.outputs.without_crc32) writes 0 there, and zipfile skips the check for a ZipInfo without one."""
    if info.CRC == 0:
        del info.CRC
    return archive.read(info)


def locate(fd: int, start: int, length: int) -> StoredTensor:
    """The one tensor in the torch.save archive at bytes [start, start + length) of `fd`; its data_offset counts
    from the start of the file."""
    stored = _locate(_Window(lambda b, pos: os.preadv(fd, [b], start + pos), length))
    return dataclasses.replace(stored, data_offset=start + stored.data_offset)


def locate_in(record: memoryview) -> StoredTensor:
    """The one tensor in a torch.save archive held in memory (a byte-format memoryview); its data_offset counts from
    the start of `record`."""
    return _locate(memory_file(record))


def memory_file(record: memoryview) -> _Window:
    """`record` as a seekable file that copies out only what is read from it (io.BytesIO copies it whole first)."""

    def read_at(b: memoryview, pos: int) -> int:
        n = min(len(b), len(record) - pos)
        b[:n] = record[pos:pos + n]
        return n

    return _Window(read_at, len(record))


def _check_directory_size(window: _Window) -> None:
    """The entry count and directory size the end records give (the zip64 one where its locator is present, as
    zipfile reads it), at most MAX_ENTRIES and MAX_DIRECTORY_BYTES: checked before zipfile reads the directory."""
    n = window.length
    end = window.read_exactly_at(n - END.size, END.size) if n >= END.size else b""
    if len(end) != END.size or end[:4] != b"PK\x05\x06":
        raise NotATensorChunk("not a torch.save archive (no zip end record at the end of the chunk)")
    counts = [END.unpack(end)[4:6]]  # (entries, directory bytes)
    at = n - END.size - ZIP64_LOCATOR.size
    if at >= 0 and window.read_exactly_at(at, 4) == b"PK\x06\x07":
        record = window.read_exactly_at(at - ZIP64_END.size, ZIP64_END.size) if at >= ZIP64_END.size else b""
        if len(record) != ZIP64_END.size or record[:4] != b"PK\x06\x06":
            raise NotATensorChunk("a zip64 locator without its end record")
        counts.append(ZIP64_END.unpack(record)[7:9])
    for entries, size in counts:
        if not 0 <= entries <= MAX_ENTRIES or not 0 <= size <= MAX_DIRECTORY_BYTES:
            raise NotATensorChunk(f"a zip directory of {entries} entries in {size} bytes, not one saved tensor's")


def _locate(window: _Window) -> StoredTensor:
    length = window.length
    try:
        _check_directory_size(window)
        archive = zipfile.ZipFile(window)
        infos = archive.infolist()
        pkl_infos = [i for i in infos if i.filename.endswith("/data.pkl")]
        if len(pkl_infos) != 1:
            raise NotATensorChunk(f"{len(pkl_infos)} data.pkl records, expected one")
        prefix, pkl_info = pkl_infos[0].filename[: -len("data.pkl")], pkl_infos[0]
        if pkl_info.file_size > MAX_PICKLE_BYTES or pkl_info.compress_size != pkl_info.file_size:
            raise NotATensorChunk(f"data.pkl of {pkl_info.file_size} bytes, {pkl_info.compress_size} stored")
        if pkl_info.compress_type != zipfile.ZIP_STORED or pkl_info.flag_bits & 0x1:
            raise NotATensorChunk("data.pkl is compressed or encrypted")
        pkl = _read_record(archive, pkl_info)
        names = {i.filename: i for i in infos}
        order = names.get(prefix + "byteorder")
        if order is not None and (order.file_size > 16 or order.compress_size != order.file_size
                                  or _read_record(archive, order) != b"little"):
            raise NotATensorChunk("stored big-endian")
    except NotATensorChunk:
        raise
    except zipfile.BadZipFile as e:
        raise NotATensorChunk(f"not a torch.save archive ({e})") from None
    except (zipfile.LargeZipFile, NotImplementedError, EOFError, struct.error, RuntimeError, OSError, ValueError) as e:
        # what zipfile raises for damaged or unusual archives (an encrypted or bzip2 entry: RuntimeError, OSError)
        raise NotATensorChunk(f"unreadable torch.save archive ({type(e).__name__}: {e})") from None
    dtype, key, numel, storage_offset, size, stride = describe(pkl)
    storages = [n for n in names if n.startswith(prefix + "data/")]
    record = names.get(prefix + "data/" + key)
    if record is None or len(storages) != 1:
        raise NotATensorChunk(f"{len(storages)} storage records, expected one named data/{key}")
    if record.compress_type != zipfile.ZIP_STORED:
        raise NotATensorChunk(f"record data/{key} is compressed")
    if record.file_size != numel * dtype.itemsize:
        raise NotATensorChunk(f"record data/{key} holds {record.file_size} bytes, the tensor's storage needs "
                              f"{numel * dtype.itemsize}")
    head = window.read_exactly_at(record.header_offset, LOCAL_HEADER.size)
    if len(head) != LOCAL_HEADER.size or record.header_offset + LOCAL_HEADER.size > length:
        raise NotATensorChunk(f"record data/{key} lies outside the chunk")
    fields = LOCAL_HEADER.unpack(head)
    if fields[0] != b"PK\x03\x04":
        raise NotATensorChunk(f"record data/{key} has no local header")
    data = record.header_offset + LOCAL_HEADER.size + fields[9] + fields[10]
    if data + record.file_size > length:
        raise NotATensorChunk(f"record data/{key} ends past the chunk")
    return StoredTensor(data, dtype, numel, storage_offset, size, stride)
