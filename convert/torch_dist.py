"""Megatron-Core's `torch_dist` checkpoint format, written and read on CPU with torch.distributed.checkpoint.

What Megatron-Core 0.19's `dist_checkpointing.load` needs (see docs/design notes, verified on the GPU):
`metadata.json` naming the backend; layer-stacked tensors (global shape [layers, ...], experts [layers,
experts, ...]); `common_state/shard_0_1` holding `torch.save([common_dict])`; and one bytes entry per
Transformer Engine module and layer (and expert), `<module>._extra_state/shard_<l>_<L>` or
`.../shard_<l>.<e>_<L>.<E>`, each `torch.save([empty uint8 tensor])`. Bytes entries are stored already
serialized (DCP's default planner would pickle them twice).

Writing streams: each stacked tensor is planned as one chunk per layer (per layer and expert for experts), and
DCP asks for the chunks one at a time while it writes, so only one chunk and its sources are in memory.
The format has no parallel layout: Megatron reshards it to whatever TP/PP/EP it is loaded with.

Reading trusts nothing in the directory: DCP's own `read_metadata()` unpickles `.metadata` (any class, so a
crafted file runs code); here a restricted unpickler admits only the classes DCP metadata is made of, the
result is checked (types, bounds, storage files inside the directory, enough bytes behind every chunk) before
anything is allocated, bytes entries are loaded with `weights_only=True`, tensor chunks are read straight from
the .distcp files without unpickling anything (mcorekit/torch_save.py), and a read fails unless the stored chunks
cover every element it returns. The writer starts every item at a multiple of 64 bytes, so that large chunks can be
mapped.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mcorekit.convert import files
from mcorekit.convert.direct_io import DirectFile
from mcorekit.convert.files import model_file, read_json, write_failure
from mcorekit.errors import ConversionError, first_line
from mcorekit.outputs import without_crc32
from mcorekit.torch_save import NotATensorChunk, StoredTensor, locate
from mcorekit.train.checkpoint_reader import dcp_cause
from mcorekit.train.checkpoint_reader import load_metadata as checked_load_metadata

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}


@dataclass
class ChunkSource:
    """One chunk of a global tensor and the function that produces it when DCP asks."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


@dataclass
class PlannedTensor:
    fqn: str
    size: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[ChunkSource]
    scope: str = "global"  # "global", "layer" or "expert": how the leading dims are stacked


def empty_extra_state() -> bytes:
    buf = io.BytesIO()
    torch.save([torch.empty(0, dtype=torch.uint8)], buf)
    return buf.getvalue()


def common_state(common: dict[str, Any] | None = None) -> bytes:
    buf = io.BytesIO()
    torch.save([common or {}], buf)
    return buf.getvalue()


def extra_state_key(module: str, layer: int | None = None, layers: int | None = None, expert: int | None = None,
                    experts: int | None = None) -> str:
    if layer is None:
        return f"{module}._extra_state/shard_0_1"
    if expert is None:
        return f"{module}._extra_state/shard_{layer}_{layers}"
    return f"{module}._extra_state/shard_{layer}.{expert}_{layers}.{experts}"


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP warns on every call that it runs without a process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class StreamingSavePlanner(SavePlanner):
    """A SavePlanner whose tensors do not exist until DCP resolves them, chunk by chunk.

    DCP runs some writes on helper threads that drop their exceptions; every failure is kept in `errors`
    so that `write` can raise it in the caller's thread."""

    def __init__(self, tensors: list[PlannedTensor], blobs: dict[str, bytes],
                 on_chunk: Callable[[int], None] | None = None) -> None:
        self.tensors = tensors
        self.blobs = blobs
        self.on_chunk = on_chunk
        self.sources: dict[tuple[str, tuple[int, ...]], ChunkSource] = {}
        self.items = 0
        self.errors: list[BaseException] = []

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        items = []
        for t in self.tensors:
            props = TensorProperties(dtype=t.dtype)
            for c in t.chunks:
                offsets = torch.Size(c.offsets)
                items.append(WriteItem(
                    index=MetadataIndex(t.fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, torch.Size(c.sizes)),
                                                properties=props, size=torch.Size(t.size)),
                ))
                self.sources[(t.fqn, tuple(c.offsets))] = c
        for fqn, blob in self.blobs.items():
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO,
                                   bytes_io_data=BytesIOWriteData(nbytes=len(blob))))
        self.items = len(items)
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        try:
            return self._resolve(write_item)
        except BaseException as e:
            self.errors.append(e)
            raise

    def _resolve(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.blobs[write_item.index.fqn])
        source = self.sources[(write_item.index.fqn, tuple(write_item.index.offset))]
        tensor = source.produce()
        if tuple(tensor.shape) != tuple(source.sizes):
            raise ConversionError(f"{write_item.index.fqn} chunk at {source.offsets}: produced shape {tuple(tensor.shape)}, "
                                  f"expected {source.sizes}")
        if self.on_chunk:
            self.on_chunk(tensor.numel() * tensor.element_size())
        return tensor.contiguous()


ITEM_ALIGN = 64  # every stored item starts at a multiple of this in its .distcp file


class _AligningStream(io.BufferedWriter):
    """The stream DCP writes one .distcp file to. DCP takes an item's offset and then its end with tell(), and
    the next item's offset with the next tell(): a tell() with no write since the one before is where an item
    begins, and zeros put in there (between items, in none) start every item, and so the data of each chunk's
    torch.save archive (64-byte aligned inside the archive), at a multiple of ITEM_ALIGN in the file. That lets
    the reader map a chunk's bytes from the page cache instead of copying them (_storage)."""

    _told = False

    def write(self, b: Any) -> int:
        self._told = False
        return super().write(b)

    def tell(self) -> int:
        pos = super().tell()
        if self._told and pos % ITEM_ALIGN:
            super().write(bytes(ITEM_ALIGN - pos % ITEM_ALIGN))
            pos = super().tell()
        self._told = True
        return pos


class _DirectFS(FileSystem):
    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _AligningStream(DirectFile(path, mode)) as stream:
            yield stream


class _CountingWriter(FileSystemWriter):
    """Counts the items DCP reports as written (a helper thread that fails reports none of its own)."""

    written = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _DirectFS()

    def finish(self, metadata: Metadata, results: list[Any]) -> None:
        self.written = sum(len(r) for r in results)
        super().finish(metadata, results)


def write(path: Path, tensors: list[PlannedTensor], blobs: dict[str, bytes], threads: int = 2,
          on_chunk: Callable[[int], None] | None = None) -> None:
    """Write one torch_dist iteration directory (path must not exist yet)."""
    path.mkdir(parents=True)
    writer = _CountingWriter(str(path), single_file_per_rank=True, thread_count=threads, sync_files=True)
    planner = StreamingSavePlanner(tensors, blobs, on_chunk)
    failures: list[BaseException] = []
    running = set(threading.enumerate())
    with _quiet_dcp(), _thread_errors() as thread_errors, without_crc32():
        try:
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:
            failures.append(dcp_cause(e))
        finally:  # DCP does not join its helper threads when its own part fails: wait, so none writes on
            for thread in set(threading.enumerate()) - running:
                if not thread.daemon:
                    thread.join()
    # Helper threads that failed are not in DCP's exception: their items are missing from .metadata.
    failures += planner.errors + thread_errors
    if failures:
        _raise_write_failure(path, failures)
    if writer.written != planner.items:
        raise ConversionError(f"writing {path} failed: {planner.items - writer.written} of {planner.items} items were not written")
    (path / "metadata.json").write_text(json.dumps(BACKEND))


def _raise_write_failure(path: Path, failures: list[BaseException]) -> None:
    """Raise the most telling failure: our own errors as they are, else an OSError (it has the errno)."""
    for e in failures:
        if isinstance(e, (ConversionError, KeyboardInterrupt)):
            raise e from None
    cause = next((e for e in failures if isinstance(e, OSError)), failures[0])
    raise ConversionError(f"writing {path} failed: {write_failure(path, cause)}") from None


@contextmanager
def _thread_errors() -> Iterator[list[BaseException]]:
    """Exceptions that end threads (DCP's writer helpers), collected instead of printed as tracebacks."""
    caught: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: caught.append(args.exc_value)
    try:
        yield caught
    finally:
        threading.excepthook = previous


# ---------------------------------------------------------------- reading .metadata without running it

def load_metadata(file: Path) -> Metadata:
    """The DCP metadata in `file`, read without running anything in it (train/checkpoint_reader.load_metadata)."""
    return checked_load_metadata(file, ConversionError)


MAX_BYTES = 2**63 - 1  # int64's largest: torch sizes a tensor's bytes in it (a larger claim overflows there)


def _size(v: object) -> tuple[int, ...] | None:
    return tuple(v) if isinstance(v, tuple) and all(type(d) is int and 0 <= d <= MAX_BYTES for d in v) else None


def metadata_problem(md: Metadata, iter_dir: Path) -> str | None:
    """What is wrong with unpickled metadata, checked before any of it is used: entry types, tensor bounds,
    storage files inside iter_dir, and at least as many stored bytes as every chunk's elements need."""
    sdm, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        return "state_dict_metadata or storage_data is not a dict"
    for key, info in storage.items():
        if not (isinstance(key, MetadataIndex) and isinstance(key.fqn, str) and isinstance(info, _StorageInfo)):
            return f"storage entry {key!r} is not a MetadataIndex -> _StorageInfo"
        if not (isinstance(info.relative_path, str) and _size((info.offset, info.length))):
            return f"storage entry {key.fqn!r} has a bad file, offset or length"
        if info.transform_descriptors:
            return f"storage entry {key.fqn!r} is stored transformed ({info.transform_descriptors}), which is not supported"
        model_file(iter_dir, info.relative_path, f"{iter_dir / '.metadata'} (entry {key.fqn!r})")
    for fqn, entry in sdm.items():
        if not isinstance(fqn, str):
            return f"key {fqn!r} is not a string"
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                return f"bytes entry {fqn!r} has no storage"
            continue
        if not isinstance(entry, TensorStorageMetadata):
            return f"entry {fqn!r} is a {type(entry).__name__}, neither tensor nor bytes"
        problem = _tensor_problem(fqn, entry, storage)
        if problem:
            return problem
    return None


def _tensor_problem(fqn: str, md: TensorStorageMetadata, storage: dict[MetadataIndex, _StorageInfo]) -> str | None:
    size = _size(md.size)
    dtype = getattr(md.properties, "dtype", None)
    if size is None or not isinstance(dtype, torch.dtype) or not isinstance(md.chunks, list):
        return f"tensor {fqn!r} has a bad size, dtype or chunk list"
    if math.prod(size) * dtype.itemsize > MAX_BYTES:  # no file holds it; torch cannot even describe it
        return f"tensor {fqn!r} claims size {size} of {dtype}, more than {MAX_BYTES} bytes"
    for chunk in md.chunks:
        offsets, sizes = _size(getattr(chunk, "offsets", None)), _size(getattr(chunk, "sizes", None))
        if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size):
            return f"tensor {fqn!r} has a chunk whose offsets or sizes do not fit its {len(size)} dimensions"
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            return f"tensor {fqn!r}: chunk at {offsets} of {sizes} lies outside the tensor's size {size}"
        stored = storage.get(MetadataIndex(fqn, torch.Size(offsets)))
        if stored is None:
            return f"tensor {fqn!r}: chunk at {offsets} has no storage"
        if stored.length < math.prod(sizes) * dtype.itemsize:  # the file must hold what we would allocate
            return f"tensor {fqn!r}: chunk at {offsets} claims {sizes} of {dtype} but has {stored.length} stored bytes"
    return None


class _SafeReader(FileSystemReader):
    """DCP's file reader, given metadata we loaded and checked (its own read_metadata would unpickle again)."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _BytesLoadPlanner(DefaultLoadPlanner):
    """Keeps bytes entries as bytes (DCP's default planner torch.loads them with weights_only=False)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)
        self.loaded: dict[str, bytes] = {}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.loaded[read_item.dest_index.fqn] = value.getvalue()


class TorchDistReader:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta_json = self.path / "metadata.json"
        if not meta_json.is_file():
            raise ConversionError(f"{self.path}: no metadata.json; not a Megatron torch_dist checkpoint directory (iter_N/)")
        # both read inside the directory, as the .distcp files are: one linked elsewhere would be an input that
        # --force could replace
        backend = read_json(model_file(self.path, "metadata.json", str(self.path)))
        if backend.get("sharded_backend") != "torch_dist":
            raise ConversionError(f"{meta_json}: backend {backend.get('sharded_backend')!r}, expected torch_dist")
        meta_file = self.path / ".metadata"
        if not meta_file.is_file():
            raise ConversionError(f"{meta_file}: missing; the checkpoint is incomplete")
        self.metadata: Metadata = load_metadata(model_file(self.path, ".metadata", str(self.path)))
        try:
            problem = metadata_problem(self.metadata, self.path)
        except (AttributeError, TypeError) as e:  # a Metadata instance built with odd attributes
            problem = f"{type(e).__name__}: {first_line(e)}"
        if problem:
            raise ConversionError(f"{meta_file}: not valid checkpoint metadata ({problem})")
        self.reader = _SafeReader(self.path, self.metadata)
        self._check_files()

    def _check_files(self) -> None:
        sizes: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
        for rel, need in sizes.items():
            file = self.path / rel
            if not file.is_file():
                raise ConversionError(f"missing checkpoint file {file} (listed in .metadata)")
            have = file.stat().st_size
            if have < need:
                raise ConversionError(f"truncated checkpoint file {file}: {have} bytes, .metadata needs {need}")

    def tensor_keys(self) -> dict[str, TensorStorageMetadata]:
        return {k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def bytes_keys(self) -> list[str]:
        return sorted(k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))

    def read(self, fqn: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """The sub-tensor at leading index `index`: read(k) is the whole tensor, read(k, (l,)) one layer,
        read(k, (l, e)) one expert of one layer. Fails unless the stored chunks cover all of it."""
        md = self.tensor_keys().get(fqn)
        if md is None:
            raise ConversionError(f"{self.path}: tensor {fqn!r} is not in the checkpoint")
        size = tuple(md.size)
        if len(index) > len(size) or any(not 0 <= i < d for i, d in zip(index, size)):
            raise ConversionError(f"{self.path}: tensor {fqn!r} of size {size} has no slice {index}")
        offsets = tuple(index) + (0,) * (len(size) - len(index))
        sizes = (1,) * len(index) + size[len(index):]
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        items = create_read_items_for_chunk_list(fqn, md, [chunk])
        self._check_coverage(fqn, chunk, items, index)
        try:
            out = self._read_items(md, sizes, items)
        except ConversionError:
            raise
        except Exception as e:  # noqa: BLE001 - a corrupt data file fails in many ways in torch.load
            raise ConversionError(f"{self.path}: cannot read tensor {fqn!r} ({type(e).__name__}: {first_line(e)})") from None
        return out.reshape(size[len(index):])

    def _read_items(self, md: TensorStorageMetadata, sizes: tuple[int, ...], items: list[Any]) -> torch.Tensor:
        """The requested block from its stored chunks, read straight from the .distcp files (torch_save.locate finds
        each chunk's bytes without unpickling anything). A stored chunk that is the whole request is returned as
        it lies in the file: mapped from the page cache when it is large and aligned there, else read into the
        returned tensor's own memory; otherwise each chunk's part is copied into one buffer."""
        dtype = md.properties.dtype
        buf = None
        for item in items:
            index = item.storage_index
            info = self.metadata.storage_data[index]
            where = f"{self.path / info.relative_path} at byte {info.offset}"
            fd = os.open(self.path / info.relative_path, os.O_RDONLY)
            try:
                try:
                    stored = locate(fd, info.offset, info.length)
                except NotATensorChunk as e:
                    raise ConversionError(f"{self.path}: cannot read tensor {index.fqn!r} (chunk at "
                                          f"{tuple(index.offset)}, {where}: {e})") from None
                if stored.dtype != dtype or len(stored.size) != len(sizes) or any(
                        o + n > d for o, n, d in zip(item.storage_offsets, item.lengths, stored.size)):
                    raise ConversionError(f"{self.path}: cannot read tensor {index.fqn!r} (chunk at {tuple(index.offset)}, "
                                          f"{where}: stored as {tuple(stored.size)} of {stored.dtype}, not as .metadata "
                                          f"says: {dtype}, at least {tuple(item.lengths)})")
                whole = stored.is_dense() and tuple(item.storage_offsets) == (0,) * len(sizes)
                if len(items) == 1 and whole and stored.size == tuple(sizes):
                    return _storage(fd, stored).view(sizes)  # the stored chunk is the request
                if buf is None:
                    buf = torch.empty(sizes, dtype=dtype)  # every element is filled: _check_coverage
                dest = buf
                for dim, (o, n) in enumerate(zip(item.dest_offsets, item.lengths)):
                    dest = dest.narrow(dim, o, n)
                if whole and stored.size == tuple(item.lengths) and dest.is_contiguous():
                    _pread_into(fd, dest, stored.data_offset)  # e.g. one of the chunks a dim-0 split made
                    continue
                part = _storage(fd, stored).as_strided(stored.size, stored.stride, stored.storage_offset)
                for dim, (o, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                    part = part.narrow(dim, o, n)
                dest.copy_(part)
            finally:
                os.close(fd)
        return torch.empty(sizes, dtype=dtype) if buf is None else buf  # no item: an empty slice (_check_coverage)

    def _check_coverage(self, fqn: str, chunk: ChunkStorageMetadata, items: list[Any], index: tuple[int, ...]) -> None:
        """The read items fill every element of `chunk`, decided without a mask of its elements: the size comes from
        .metadata, which may claim any size, while the items' boxes hold what the files store (metadata_problem)."""
        boxes = [(tuple(item.dest_offsets), tuple(item.lengths)) for item in items]
        total, stored = math.prod(chunk.sizes), sum(math.prod(n) for _, n in boxes)
        if stored >= total and len(boxes) == 1:  # one box inside the slice and as large: the slice
            return
        uncovered = _uncovered(tuple(chunk.sizes), boxes) if stored >= total else total - stored
        if uncovered is None:
            raise ConversionError(f"{self.path / '.metadata'}: {len(boxes)} stored chunks cut slice {index} of "
                                  f"{fqn!r} into more than {MAX_CELLS} pieces, which no Megatron checkpoint does; "
                                  f"it is damaged")
        if uncovered:
            raise ConversionError(f"{self.path / '.metadata'}: the stored chunks of {fqn!r} do not cover slice "
                                  f"{index} (at least {uncovered} of its {total} elements missing); the checkpoint "
                                  f"is incomplete")

    def read_bytes(self, key: str) -> Any:
        """A bytes entry (Megatron stores `torch.save(...)` there), loaded with weights_only=True."""
        if key not in self.bytes_keys():
            raise ConversionError(f"{self.path}: bytes entry {key!r} is not in the checkpoint")
        return self._load_bytes([key])[key]

    def _load_bytes(self, keys: list[str]) -> dict[str, Any]:
        planner = _BytesLoadPlanner()
        try:
            with _quiet_dcp():
                dcp.load({key: io.BytesIO() for key in keys}, storage_reader=self.reader, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a corrupt data file fails in many ways in DCP
            cause = dcp_cause(e)
            raise ConversionError(f"{self.path}: cannot read bytes entries ({type(cause).__name__}: {first_line(cause)})") from None
        out = {}
        for key in keys:
            try:
                with warnings.catch_warnings():  # torch warns about pickle protocols before refusing; one line is enough
                    warnings.simplefilter("ignore")
                    out[key] = torch.load(io.BytesIO(planner.loaded[key]), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - refused globals and corrupt bytes alike
                raise ConversionError(f"{self.path}: cannot load bytes entry {key!r} with weights_only, so it is not "
                                      f"read ({type(e).__name__}: {first_line(e)})") from None
        return out


MAX_CELLS = 2**22  # pieces the chunks' edges may cut a read into (Megatron's grid of ranks makes a few hundred)


def _uncovered(size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> int | None:
    """How many elements of a block of `size` no box covers, counted on the grid the boxes' edges make (one cell per
    piece between edges, weighted by its volume), so memory grows with the chunks, not the size; None when the
    grid would have more than MAX_CELLS cells."""
    edges = [sorted({0, d, *(o[k] for o, _ in boxes), *(o[k] + n[k] for o, n in boxes)}) for k, d in enumerate(size)]
    if math.prod(len(e) - 1 for e in edges) > MAX_CELLS:
        return None
    cell = [{edge: i for i, edge in enumerate(e)} for e in edges]
    covered = torch.zeros([len(e) - 1 for e in edges], dtype=torch.bool)
    for o, n in boxes:
        covered[tuple(slice(c[a], c[a + b]) for c, a, b in zip(cell, o, n))] = True
    volume = torch.ones((), dtype=torch.int64)
    for k, e in enumerate(edges):
        volume = volume * torch.tensor(e).diff().view([-1 if j == k else 1 for j in range(len(edges))])
    return int(volume.masked_fill(covered, 0).sum())


# ---------------------------------------------------------------- models whose layers differ: one key per layer

LAYERS = "decoder.layers."
MTP = "mtp.layers."  # Megatron-Core's multi-token-prediction layers: always one key per layer


def layer_key(stacked: str, layer: int) -> str:
    """`decoder.layers.<name>` at one layer: `decoder.layers.<layer>.<name>` (Megatron-Core's key for a model
    whose layers differ, e.g. DeepSeek's dense then MoE layers: TransformerBlock's non_homogeneous_layers); and
    `mtp.layers.<name>` at MTP layer i: `mtp.layers.<i>.<name>`."""
    prefix = MTP if stacked.startswith(MTP) else LAYERS
    return stacked.replace(prefix, f"{prefix}{layer}.", 1)


def per_layer(planned: list[PlannedTensor]) -> list[PlannedTensor]:
    """The same tensors with one key per layer: each layer-stacked tensor becomes one tensor per layer it has,
    without the layer dimension (experts keep theirs)."""
    out = []
    for t in planned:
        if t.scope == "global":
            out.append(t)
            continue
        by_layer: dict[int, list[ChunkSource]] = {}
        for c in t.chunks:
            def produce(c: ChunkSource = c) -> torch.Tensor:
                return c.produce().reshape(c.sizes[1:])
            by_layer.setdefault(c.offsets[0], []).append(ChunkSource(c.offsets[1:], c.sizes[1:], produce))
        out += [PlannedTensor(layer_key(t.fqn, layer), t.size[1:], t.dtype, chunks, "expert" if t.scope == "expert"
                              else "global") for layer, chunks in sorted(by_layer.items())]
    return out


class LayerStackedView:
    """A torch_dist checkpoint with per-layer keys seen with layer-stacked keys (what the weight maps name):
    tensor_keys() gives `decoder.layers.<name>` with size [num_layers, ...] for the layers that have it (and
    `mtp.layers.<name>` with size [mtp_layers, ...]), read(key, (l, ...)) reads `decoder.layers.<l>.<name>`.
    Layer-stacked keys pass through as they are."""

    _KEY = re.compile(r"(decoder|mtp)\.layers\.(\d+)\.(.+)")

    def __init__(self, reader: TorchDistReader, num_layers: int) -> None:
        self.reader = reader
        self.stacked: dict[str, TensorStorageMetadata] = {}
        self.layers: dict[str, set[int]] = {}  # the layers each per-layer name is stored for
        per_layer: dict[str, tuple[str, TensorStorageMetadata]] = {}
        for key, md in reader.tensor_keys().items():
            m = self._KEY.fullmatch(key)
            if m is None:
                self.stacked[key] = md
                continue
            name = f"{m.group(1)}.layers.{m.group(3)}"
            self.layers.setdefault(name, set()).add(int(m.group(2)))
            first, seen = per_layer.setdefault(name, (key, md))
            # one stacked entry stands for every layer, so the checks made on it hold for each only if they agree
            if (md.properties.dtype, md.size) != (seen.properties.dtype, seen.size):
                raise ConversionError(
                    f"{reader.path}: {first} is {seen.properties.dtype} {tuple(seen.size)}, but {key} is "
                    f"{md.properties.dtype} {tuple(md.size)}; the layers of one tensor are stored alike, so the "
                    f"checkpoint is damaged (re-save or re-convert it)")
        mtp = {i for name, ids in self.layers.items() if name.startswith(MTP) for i in ids}
        self.mtp_layers = len(mtp)  # how many multi-token-prediction layers the checkpoint holds
        for name, (_, md) in per_layer.items():
            count = self.mtp_layers if name.startswith(MTP) else num_layers
            self.stacked[name] = TensorStorageMetadata(md.properties, torch.Size((count, *md.size)), [])

    def tensor_keys(self) -> dict[str, TensorStorageMetadata]:
        return dict(self.stacked)

    def read(self, fqn: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        if fqn not in self.layers:
            return self.reader.read(fqn, index)
        if not index:
            raise ConversionError(f"{self.reader.path}: {fqn!r} is stored per layer; read one layer")
        return self.reader.read(layer_key(fqn, index[0]), index[1:])


def _storage(fd: int, stored: StoredTensor) -> torch.Tensor:
    """The stored chunk's storage as a flat tensor (files.read_flat): mapped from the page cache when it is large and
    its bytes lie at a multiple of the element size, else read into fresh memory."""
    try:
        return files.read_flat(fd, stored.data_offset, stored.nbytes, stored.dtype,
                               may_map=stored.data_offset % stored.dtype.itemsize == 0)
    except EOFError as e:
        raise NotATensorChunk(f"{e}, inside the chunk") from None


def _pread_into(fd: int, out: torch.Tensor, offset: int) -> None:
    try:
        files.pread_into(fd, out, offset)
    except EOFError as e:
        raise NotATensorChunk(f"{e}, inside the chunk") from None
