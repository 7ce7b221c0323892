"""HF checkpoints on disk: validated streaming reads of sharded safetensors, and size-bounded sharded writes.

Everything in an HF directory is untrusted input: the index may only name files inside the directory, and
every safetensors header is checked (dtype known, shape and byte span agree, data inside the file) before
any tensor is allocated, so a header claiming more bytes than the file holds fails at once.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcorekit.convert.direct_io import ALIGN, open_direct, pwrite_all, pwrite_around_cache
from mcorekit.convert.files import model_file, read_json, read_flat
from mcorekit.errors import ConversionError
from mcorekit.outputs import start_writeback

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
MAX_TENSORS = 2**22  # in all shards together: DeepSeek-V3's 256 experts x 61 layers make ~100k (with fp8 scales)
MAX_DIM = 2**63 - 1  # torch's sizes are int64
WRITER_THREADS = 2  # HFWriter's background writers (see there)
WRITEBACK_MIN_BYTES = 1024**2  # smaller tensors go through the page cache, left to the shard's fsync: a direct
# write or a hint per tensor would cost more than it saves
ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
# Everything besides the weights that a served or fine-tuned model needs; copied as they are.
ASSET_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in its shard, as its (checked) header says."""

    shard: str
    offset: int  # from the start of the file
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _is_count(v: object) -> bool:
    return type(v) is int and v >= 0


def parse_entry(name: str, info: object, data_bytes: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, or ValueError saying what is wrong with it."""
    if not isinstance(info, dict):
        raise ValueError(f"entry {name!r} is not an object")
    dtype = ST_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise ValueError(f"tensor {name!r} has unsupported dtype {info.get('dtype')!r} (known: {', '.join(ST_DTYPES)})")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if any(d > MAX_DIM for d in shape):  # with a 0 elsewhere the bytes agree, but torch cannot hold the shape
        raise ValueError(f"tensor {name!r}: shape {shape} has a dimension above {MAX_DIM}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not two non-negative integers")
    begin, end = offsets
    if begin > end:
        raise ValueError(f"tensor {name!r}: data_offsets {offsets} are reversed")
    if end > data_bytes:
        raise ValueError(f"tensor {name!r} ends at data byte {end}, past the end of the file ({data_bytes} data bytes)")
    need = math.prod(shape) * dtype.itemsize
    if end - begin != need:
        raise ValueError(f"tensor {name!r}: shape {shape} of {info['dtype']} needs {need} bytes, data_offsets span {end - begin}")
    return dtype, tuple(shape), begin, end


def check_tiling(spans: dict[str, tuple[int, int]], data_bytes: int) -> None:
    """safetensors' own rule: in offset order the tensors cover the data bytes exactly, each starting where the
    one before ends; else two tensors share bytes (one would read the other's values) or bytes belong to none."""
    at, before = 0, None
    for name, (begin, end) in sorted(spans.items(), key=lambda kv: kv[1]):
        if begin < at:
            raise ValueError(f"tensor {name!r}: data_offsets [{begin}, {end}] overlap tensor {before!r}, "
                             f"which ends at {at}")
        if begin > at:
            raise ValueError(f"tensor {name!r} starts at data byte {begin}, leaving bytes {at}..{begin} to no tensor")
        at, before = end, name
    if at != data_bytes:
        raise ValueError(f"the tensors end at data byte {at}, but the file holds {data_bytes} data bytes")


class HFReader:
    """Reads one tensor at a time (files.read_flat): a tensor of MAP_BYTES or more is a private (copy-on-write) mapping of its own
    bytes of the shard, unmapped when the tensor is freed, so untouched shards never count against memory and
    its bytes go from the page cache to wherever they are used without a copy into fresh memory first (half
    the system time of hf-to-mcore); smaller ones are read with pread. Every shard's header is parsed and
    checked against the file size up front, so a missing, corrupt or truncated shard fails before anything is
    written. (A shard truncated by another process while it is being converted ends the process with SIGBUS
    rather than an error message: mapped files cannot report it otherwise.)"""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ConversionError(f"{self.path}: no config.json; pass an HF model directory")
        self.config: dict[str, Any] = read_json(model_file(self.path, "config.json", str(self.path)))
        weight_map = self._weight_map()
        self.entries: dict[str, TensorEntry] = {}
        for shard in sorted(set(weight_map.values())) or [SINGLE]:
            found = self._header(shard)
            twice = sorted(found.keys() & self.entries.keys())
            if twice:
                raise ConversionError(f"{self.path}: tensor {twice[0]!r} is in both {self.entries[twice[0]].shard} and {shard}")
            self.entries.update(found)
            if len(self.entries) > MAX_TENSORS:  # each header is bounded, their number only by the index
                raise ConversionError(f"{self.path}: its shards list more than {MAX_TENSORS:,} tensors, more than any "
                                      f"model has; a damaged checkpoint")
            missing = sorted(k for k, v in weight_map.items() if v == shard and k not in found)
            if missing:
                raise ConversionError(f"{self.path / shard}: the index lists {missing[:3]} but the shard lacks them")
        self.weight_map = {name: e.shard for name, e in self.entries.items()}
        self._fds: dict[str, int] = {}

    def _weight_map(self) -> dict[str, str]:
        """The index's tensor -> shard map ({} for a single model.safetensors); shards must lie inside the folder."""
        if (self.path / INDEX).is_file():
            index_file = self.path / INDEX
            weight_map = read_json(model_file(self.path, INDEX, str(self.path))).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{index_file}: no \"weight_map\" object mapping tensor names to shard files")
            for name, shard in weight_map.items():
                if not isinstance(shard, str):
                    raise ConversionError(f"{index_file}: weight_map[{name!r}] is {shard!r}, not a file name")
                model_file(self.path, shard, str(index_file))
            return weight_map
        if (self.path / SINGLE).is_file():
            return {}
        bins = sorted(p.name for p in self.path.glob("*.bin"))
        raise ConversionError(
            f"{self.path}: no {INDEX} or {SINGLE}"
            + (f" (found {bins[0]}...: only safetensors are read; re-save with save_pretrained(safe_serialization=True))" if bins else "")
        )

    def _header(self, shard: str) -> dict[str, TensorEntry]:
        file = model_file(self.path, shard, str(self.path / INDEX))
        if not file.is_file():
            raise ConversionError(f"missing shard {self.path / shard} (listed in {INDEX}); re-download or re-save the checkpoint")
        size = file.stat().st_size
        entries = {}
        try:
            with open(file, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n > min(size - 8, MAX_HEADER_BYTES):
                    raise ValueError(f"header length {n} exceeds the file ({size} bytes)" if n > size - 8
                                     else f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
                header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            spans = {}
            meta = header.get("__metadata__")
            meta = {} if meta is None else meta  # null: as the safetensors library reads it, no metadata
            if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
                raise ValueError("__metadata__ is not an object of strings, as safetensors requires")
            for name, info in header.items():
                if name != "__metadata__":
                    dtype, shape, begin, end = parse_entry(name, info, size - 8 - n)
                    entries[name] = TensorEntry(shard, 8 + n + begin, dtype, shape, end - begin)
                    spans[name] = (begin, end)
            check_tiling(spans, size - 8 - n)
        except (ValueError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors too
            raise ConversionError(f"corrupt or truncated safetensors file {self.path / shard}: {e}; "
                                  f"re-download or re-save the checkpoint") from None
        return entries

    def names(self) -> list[str]:
        return sorted(self.entries)

    def shard_files(self) -> list[Path]:
        return [self.path / s for s in sorted(set(self.weight_map.values()))]

    def get(self, name: str, row: int | None = None) -> torch.Tensor:
        """Tensor `name`, or with `row` only its slice [row] on dim 0 (one expert of a tensor that holds them all),
        read alone."""
        entry = self.entries.get(name)
        if entry is None:
            raise ConversionError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        fd = self._fds.get(entry.shard)
        if fd is None:
            fd = self._fds[entry.shard] = os.open(self.path / entry.shard, os.O_RDONLY)
        shape, offset, nbytes = entry.shape, entry.offset, entry.nbytes
        if row is not None:
            if not entry.shape or not 0 <= row < entry.shape[0]:
                raise ConversionError(f"{self.path / entry.shard}: tensor {name!r} of shape {entry.shape} has no row {row}")
            nbytes //= entry.shape[0]
            shape, offset = entry.shape[1:], offset + row * nbytes
        try:
            return read_flat(fd, offset, nbytes, entry.dtype).reshape(shape)
        except EOFError:
            raise ConversionError(f"{self.path / entry.shard}: file ended inside tensor {name!r}") from None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _Shard:
    """One safetensors file written as its tensors arrive: each tensor's bytes go straight to their place behind
    a header area reserved at the start (no shard-sized buffer), around the page cache where the file system allows
    it (convert/direct_io.py); at close the header goes into that area, padded with spaces as the format allows. A
    header that outgrew the area moves the data behind it once."""

    def __init__(self, file: Path, reserved: int) -> None:
        self.file = file
        self.reserved = reserved  # header area, a multiple of ALIGN: the data starts on the block grid
        self.fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.direct_fd = open_direct(file)
        self.direct = self.direct_fd >= 0  # until the file system turns a direct write down
        self.entries: dict[str, dict[str, Any]] = {}
        self.end = 0  # bytes of tensor data placed so far

    def place(self, name: str, tensor: torch.Tensor) -> int:
        """Reserve the tensor's bytes behind the data so far and enter it in the header; returns its file offset."""
        nbytes = tensor.numel() * tensor.element_size()
        self.entries[name] = {"dtype": ST_NAMES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self.end, self.end + nbytes]}
        self.end += nbytes
        return self.reserved + self.end - nbytes

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        """The tensor's bytes at the offset place() gave it (any thread, in any order): its whole blocks around the
        page cache, or, where that is refused, through it and then handed to the kernel's writeback, so the disk
        writes while the next tensors are made."""
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
        if self.direct and len(data) >= WRITEBACK_MIN_BYTES:
            if not pwrite_around_cache(self.direct_fd, self.fd, data, offset):
                self.direct = False  # never back to True: another thread may have been turned down meanwhile
            return
        pwrite_all(self.fd, data, offset)
        if len(data) >= WRITEBACK_MIN_BYTES:
            start_writeback(self.fd, offset, len(data))

    def close(self) -> None:
        """Header in place, then fsync: on disk before the output folder is renamed complete."""
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        room = self.reserved - 8
        if len(header) > room:
            room = -(-len(header) // 8) * 8  # the data then starts 8-byte aligned, as safetensors writes it
            self._move_data(8 + room)
        pwrite_all(self.fd, memoryview(struct.pack("<Q", room) + header + b" " * (room - len(header))), 0)
        os.fsync(self.fd)
        self.abandon()

    def _move_data(self, start: int) -> None:
        """The data from the reserved area's end to `start` (later), last block first: the ranges may overlap."""
        block = 64 * 1024**2
        for at in range(max(self.end - 1, 0) // block * block, -1, -block):
            chunk = os.pread(self.fd, min(block, self.end - at), self.reserved + at)
            pwrite_all(self.fd, memoryview(chunk), start + at)

    def abandon(self) -> None:
        """Its descriptors closed."""
        for name in ("direct_fd", "fd"):
            fd = getattr(self, name)
            setattr(self, name, -1)
            if fd >= 0:
                os.close(fd)


class HFWriter:
    """Writes tensors into safetensors shards of at most max_shard_bytes as they are added: each tensor gets its
    place in the current shard's file at once and is written there on one of WRITER_THREADS background threads
    while the caller makes the next (at most MAX_QUEUED_BYTES waiting), so memory holds a few tensors, not a shard.

    A failed background write is re-raised in the caller's thread by the next add/finish. Use it as a context
    manager: on an error the queued writes are waited for, so nothing writes into a folder being removed."""

    MAX_QUEUED_BYTES = 256 * 1024**2

    def __init__(self, path: Path, max_shard_bytes: int = 5 * 1024**3) -> None:
        from collections import deque
        from concurrent.futures import Future, ThreadPoolExecutor

        self.path = path
        self.max_shard_bytes = max_shard_bytes
        self.shards: list[list[str]] = []  # tensor names per shard
        self.shard: _Shard | None = None
        self.shard_bytes = 0
        self.total_bytes = 0
        # two writers: copying into the page cache takes a core per GB/s or so (one writer thread spent 4.4 of a
        # 7.2 s mcore-to-hf in pwrite); each tensor has its place before it is queued, so the order does not matter
        self._pool = ThreadPoolExecutor(max_workers=WRITER_THREADS)
        self._queued: deque[tuple[Future, int]] = deque()
        self._queued_bytes = 0
        self._names: set[str] = set()
        # room for the header: one entry (~120 bytes) per 2 KiB of shard holds every tensor of 256 KB and more
        self.header_bytes = min(max(max_shard_bytes // 2048, ALIGN), 4 * 1024**2) // ALIGN * ALIGN

    def __enter__(self) -> HFWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:  # a second entry would leave bytes no header entry covers: unreadable
            raise ConversionError(f"{self.path}: tensor {name!r} written twice")
        if tensor.dtype not in ST_NAMES:
            raise ConversionError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        self._names.add(name)
        tensor = tensor.detach().cpu().contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.shard is None or (self.shards[-1] and self.shard_bytes + size > self.max_shard_bytes):
            self._next_shard()
        self._settle(self.MAX_QUEUED_BYTES - size)
        offset = self.shard.place(name, tensor)
        self._queued.append((self._pool.submit(_write, self.shard, offset, tensor), max(size, 1)))
        self._queued_bytes += max(size, 1)  # an empty tensor counts: _settle(0) waits for every queued write
        self.shards[-1].append(name)
        self.shard_bytes += size
        self.total_bytes += size

    def _next_shard(self) -> None:
        if self.shard is not None:
            self._close_shard()
        file = self.path / f"part-{len(self.shards) + 1:05d}.safetensors"
        try:
            self.shard = _Shard(file, self.header_bytes)
        except OSError as e:
            raise ConversionError(f"{file}: cannot write ({e.strerror or e})") from None
        self.shards.append([])
        self.shard_bytes = 0

    def _close_shard(self) -> None:
        self._settle(0)
        shard, self.shard = self.shard, None
        try:
            shard.close()
        except OSError as e:
            raise ConversionError(f"{shard.file}: cannot write ({e.strerror or e})") from None
        finally:
            shard.abandon()  # its descriptor, if close did not get to it

    def _settle(self, allowed: int) -> None:
        """Wait for the oldest writes until at most `allowed` bytes are still queued (their errors raised here)."""
        while self._queued and self._queued_bytes > max(allowed, 0):
            future, n = self._queued.popleft()
            self._queued_bytes -= n
            future.result()

    def close(self) -> None:
        """Wait for the queued writes (an error among them was or will be reported by finish), stop the thread."""
        for future, _ in self._queued:
            future.exception()
        self._queued.clear()
        self._queued_bytes = 0
        self._pool.shutdown()
        if self.shard is not None:
            self.shard.abandon()

    def finish(self) -> None:
        if self.shard is not None:
            self._close_shard()
        self._pool.shutdown()
        total = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards, start=1):
            final = f"model-{i:05d}-of-{total:05d}.safetensors"
            (self.path / f"part-{i:05d}.safetensors").rename(self.path / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.path / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _write(shard: _Shard, offset: int, tensor: torch.Tensor) -> None:
    try:
        shard.write(offset, tensor)
    except OSError as e:
        raise ConversionError(f"{shard.file}: cannot write ({e.strerror or e})") from None


def copy_assets(src: Path, dst: Path, config: dict[str, Any] | None = None) -> list[str]:
    """Copy config, generation config and tokenizer files; `config` replaces config.json when given.
    A file that is a symlink leading out of `src` is refused, as for shards."""
    copied = []
    for name in ASSET_FILES:
        if (src / name).is_file():
            shutil.copy2(model_file(src, name, str(src)), dst / name)
            copied.append(name)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return copied
