"""The resume load's reader of torch_dist checkpoints: torch's FileSystemReader with the disk kept busy and each
tensor viewed where it was read.

torch's reader (torch.distributed.checkpoint.FileSystemReader, which Megatron-Core's load uses) reads each tensor's
record from the file when it gets to it, then deserializes it and copies it into its target (often on the GPU), the
disk idle meanwhile, and in the plan's order rather than the file's. On one H200 machine it loaded the 3B shape's
36.6 GB checkpoint at 0.78-0.96 GB/s where `dd` read 0.95-1.44 GB/s (2026-12-01/02). This reader reads the records
on a thread in file order, up to AHEAD_BYTES ahead of the consumer, so the disk reads while the tensors before are
copied. A tensor record (a torch.save archive of one tensor) is not deserialized with torch.load, which copies the
tensor out of the bytes read: mcorekit.torch_save finds the tensor's bytes in the record without unpickling
anything, and the copy into the target reads them where they lie. A record torch_save does not recognise is
loaded with torch.load (weights_only), as torch's reader does.

    with read_ahead():
        dist_checkpointing.load(...)

Nothing it reads is unpickled without restriction: .metadata goes through MetadataUnpickler (RestrictedReader), each
bytes record is checked in memory before the planner unpickles it, and the common state is read weights-only
(common_state), as the start's checks read them.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import queue
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index  # as torch's FileSystemReader
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from mcorekit.errors import ConfigError
from mcorekit.torch_save import NotATensorChunk, locate_in, memory_file

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

# records read and queued, not yet taken by the consumer (one record larger than this still passes); the record
# being copied is held on top of it
AHEAD_BYTES = 2 << 30


class MetadataRefused(CheckpointException):
    """A .metadata load_metadata refuses, in torch's CheckpointException (a BaseException): DCP's load catches an
    Exception from read_metadata and fails later with 'metadata is None'; this reaches checkpoint.read's handler of
    torch's failures, which prints its message in one line."""

    def __init__(self, message: str) -> None:
        super().__init__(message, {})

    def __str__(self) -> str:
        return str(self.args[0])


class RestrictedReader(FileSystemReader):
    """torch's FileSystemReader with its .metadata read by load_metadata. Its bytes records go to the planner as
    torch reads them: give it a planner that refuses them (TensorsOnlyPlanner) or use ReadAheadReader."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The .metadata through MetadataUnpickler (load_metadata), where torch's reader unpickles anything in it:
        the start's check of a checkpoint (checked_metadata) holds for the file the load reads, even one replaced
        since."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        try:
            metadata = load_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        except ConfigError as e:
            raise MetadataRefused(str(e)) from None
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """torch's default load planner for loads of tensors alone (the Megatron-FSDP checkpoints): a bytes record,
    which it would unpickle with weights_only=False, is refused instead."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise ConfigError(f"record {read_item.dest_index.fqn} is a bytes record where this load reads tensors only: "
                          f"refusing to unpickle it (a damaged or crafted .metadata)")


class ReadAheadReader(RestrictedReader):
    """Also: each bytes record (a ShardedObject: TE's extra states, the RNG states, Megatron-Core's common state) is
    checked in memory (_checked) before the planner unpickles it (torch's default planner and Megatron-Core's:
    torch.load with weights_only=False), so a file replaced after the start's check runs nothing either."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if any(self.storage_data[r.storage_index].transform_descriptors for r in plan.items):
            return super().read_data(plan, planner)  # compressed or otherwise transformed: torch's own path
        records = _Records(self, plan.items)
        try:
            for req, record in records:
                if req.type == LoadItemType.BYTE_IO:  # the planner unpickles it without restriction: these very
                    data = record.numpy().tobytes()   # bytes are checked first, as checked_records checks a start's
                    fqn = req.storage_index.fqn
                    _checked(f"checkpoint {self.path}: record {fqn}", lambda: data, "_extra_state" in fqn)
                    planner.load_bytes(req, io.BytesIO(data))
                    continue
                tensor = narrow_tensor_by_index(saved_tensor(record), req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
        finally:
            records.close()
        done: Future[None] = Future()
        done.set_result(None)
        return done


def saved_tensor(record: torch.Tensor) -> torch.Tensor:
    """The tensor a torch.save archive held in `record` (uint8) stores, as a view into `record` where its bytes lie
    at a multiple of its element size in memory (torch.save puts them at a multiple of 64 in the archive), else
    copied out; torch.load (weights_only) for an archive that is not one plain tensor (among them the dtypes torch
    saves with its v3 rebuild: float8, uint16-64, complex32, ...)."""
    try:
        stored = locate_in(memoryview(record.numpy()))
    except NotATensorChunk:
        return torch_loaded(record)
    data = record[stored.data_offset:stored.data_offset + stored.nbytes]
    if data.data_ptr() % stored.dtype.itemsize:
        data = data.clone()  # fresh memory is aligned
    flat = data.view(stored.dtype)  # as_strided's offset counts from the start of the record's memory
    return flat.as_strided(stored.size, stored.stride, flat.storage_offset() + stored.storage_offset)


def torch_loaded(record: torch.Tensor) -> Any:
    """The torch.save archive in `record` (uint8) deserialized by torch.load (weights_only), reading it in place."""
    return torch.load(memory_file(memoryview(record.numpy())), map_location="cpu", weights_only=True)


class _Records:
    """(read item, its record's bytes as uint8) in file order (file by file, by offset), read by a thread ahead of the
    consumer; a failed read is raised to the consumer; close() stops the thread."""

    def __init__(self, reader: FileSystemReader, items: list[ReadItem]) -> None:
        info = reader.storage_data
        self._order = sorted(items, key=lambda r: (info[r.storage_index].relative_path, info[r.storage_index].offset))
        self._reader, self._queue = reader, queue.Queue()
        self._room = threading.Condition()
        self._ahead, self._stopped = 0, False
        self._thread = threading.Thread(target=self._read_all, daemon=True, name="mcorekit-read-ahead")
        self._thread.start()

    def _read_all(self) -> None:
        info, fd, open_path = self._reader.storage_data, -1, None
        try:
            for req in self._order:
                record = info[req.storage_index]
                with self._room:  # wait for room: at most AHEAD_BYTES read and not yet taken (or nothing at all)
                    self._room.wait_for(lambda: self._stopped or self._ahead == 0 or
                                        self._ahead + record.length <= AHEAD_BYTES)
                    if self._stopped:
                        return
                    self._ahead += record.length
                if record.relative_path != open_path:
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    open_path = record.relative_path
                    fd = os.open(self._reader.fs.concat_path(self._reader.path, open_path), os.O_RDONLY)
                self._queue.put((req, read_exactly(fd, record.length, record.offset, open_path)))
        except BaseException as e:  # noqa: BLE001  # handed to the consumer, which raises it
            self._queue.put(e)
        finally:
            if fd >= 0:
                os.close(fd)

    def __iter__(self) -> Iterator[tuple[ReadItem, torch.Tensor]]:
        for _ in self._order:
            got = self._queue.get()
            if isinstance(got, BaseException):
                raise got
            with self._room:
                self._ahead -= len(got[1])
                self._room.notify()
            yield got

    def close(self) -> None:
        with self._room:
            self._stopped = True
            self._room.notify()
        self._thread.join()


def read_exactly(fd: int, length: int, offset: int, name: str) -> torch.Tensor:
    """`length` bytes at `offset`, read straight into a new uint8 tensor (not zero-filled first, unlike bytearray).
    One read returns at most 0x7ffff000 bytes on Linux: a record over 2 GiB (the fp32 Adam moment of a large
    vocabulary's embedding) takes several. A read that returns nothing is the end of the file before the record's
    end."""
    out = torch.empty(length, dtype=torch.uint8)
    view, got = memoryview(out.numpy()), 0
    while got < length:
        part = os.preadv(fd, [view[got:]], offset + got)
        if not part:
            raise OSError(f"{name}: {got} bytes at offset {offset}, the checkpoint's metadata says {length} "
                          "(a truncated file?)")
        got += part
    return out


# ---------------------------------------------------------------- reading a checkpoint's .metadata without running it

METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a dict lookup of torch's layouts by name (torch.strided)
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id as DCP writes it
}
TORCH_DTYPES = frozenset(name for name, v in vars(torch).items() if isinstance(v, torch.dtype))


class RefusedClass(Exception):
    """A pickle asked for a class that DCP metadata is not made of."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: a class outside what DCP metadata is made of (the way a
    crafted pickle reaches os.system & co.) is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_CLASSES or (module == "torch" and name in TORCH_DTYPES):
            return super().find_class(module, name)
        raise RefusedClass(f"{module}.{name}")


def load_metadata(file: Path, error: type[Exception] = ConfigError) -> Metadata:
    """The DCP metadata in `file`, unpickled with MetadataUnpickler (no code from the file runs); what is not
    metadata raises `error` (conversion's own error type there)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except RefusedClass as e:
        raise error(f"{file}: not a checkpoint metadata file (refusing to load class {e})") from None
    except OSError as e:
        raise error(f"{file}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - unpickling arbitrary bytes can raise anything; all mean "not metadata"
        first = str(e).strip().splitlines()
        raise error(f"{file}: not a readable checkpoint metadata file ({type(e).__name__}: "
                    f"{first[0] if first else ''})") from None
    if not isinstance(metadata, Metadata):
        raise error(f"{file}: not a checkpoint metadata file (it holds a {type(metadata).__name__})")
    return metadata


def dcp_cause(e: BaseException) -> BaseException:
    """The exception inside torch's CheckpointException (it wraps each rank's failure as (exception, traceback))."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        inner = next(iter(e.failures.values()), e)
        return inner[0] if isinstance(inner, tuple) else inner
    return e


# The name of what a refused pickle asked for, in torch's weights-only error and Megatron-Core's SafeUnpickler's
REFUSED_NAME = re.compile(r"(?:GLOBAL |class ')([\w.]+)")


class UnsafeRecord(Exception):
    """A record whose unpickling would call something that is not data."""


def _refused(e: pickle.UnpicklingError) -> UnsafeRecord | None:
    named = REFUSED_NAME.search(str(e))
    return UnsafeRecord(named.group(1)) if named else None  # None: damaged, not unsafe


def _weights_only(data: bytes) -> Any:
    """A record deserialized by torch's weights-only unpickler, with what Megatron-Core registers as safe when it is
    imported (its enums and args namespace, numpy's RNG arrays, BytesIO: megatron.core.safe_globals)."""
    import megatron.core  # noqa: F401 - registers them, and makes torch's storage unpickling weights-only too

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refused(e) or e from None


TE_UNSAFE_PICKLE = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


@contextmanager
def checked_extra_states() -> Iterator[None]:
    """TE (2.18 on) refuses to unpickle a delayed-scaling FP8 extra state in set_extra_state unless
    NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1, since such a pickle could run code: without it no FP8 (delayed) checkpoint
    resumes or starts another run. Every checkpoint a start or a conversion loads has had its records checked first
    (checked_records: restricted unpicklers, nothing runs), the check TE asks for; a model's load_state_dict runs in
    here with the variable set, and the variable is as it was afterwards."""
    saved = os.environ.get(TE_UNSAFE_PICKLE)
    os.environ[TE_UNSAFE_PICKLE] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(TE_UNSAFE_PICKLE, None)
        else:
            os.environ[TE_UNSAFE_PICKLE] = saved


def _check_extra_state(state: torch.Tensor) -> None:
    """TE's extra state: a uint8 tensor holding a plain pickle (FP8 scales and amax histories, the recipe), which TE's
    set_extra_state unpickles with pickle.loads. Unpickled here by Megatron-Core's SafeUnpickler, the restricted
    unpickler it uses for the same states of its grouped experts."""
    from megatron.core.safe_globals import SafeUnpickler

    try:
        SafeUnpickler(io.BytesIO(state.detach().cpu().numpy().tobytes())).load()  # TE's own expression
    except pickle.UnpicklingError as e:
        raise _refused(e) or e from None


def _extra_states(obj: Any) -> Iterator[torch.Tensor]:
    """The non-empty tensors in an extra state's record (Megatron-Core wraps one in a list), of any dtype: TE
    unpickles the bytes of whatever tensor it is given."""
    if isinstance(obj, torch.Tensor) and obj.numel():
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _extra_states(item)


def checked_records(iter_dir: Path, metadata: Metadata) -> None:
    """Every bytes record of a checkpoint from elsewhere (checkpoint.load: a base to fine-tune, a DPO reference, a
    LoRA base) or of the run's own folder (which may have been copied from elsewhere), deserialized here by
    restricted unpicklers before any loader reads it: torch's and Megatron-Core's loaders unpickle these records
    without restriction, and TE unpickles its extra states itself, so a crafted record would run its code there. A
    record that names anything but data is one error line and nothing of it runs; what passes here is what the
    loaders then unpickle, byte for byte. A `common.pt` (older Megatron-Core writes the common state there; torch
    loads it weights-only, which refuses such a file with a traceback) is checked the same way."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    records = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    found = sorted(((info.relative_path, info.offset, info.length, index.fqn, info.transform_descriptors)
                    for index, info in metadata.storage_data.items() if index.fqn in records), key=lambda r: r[:2])
    # each file opened once, read front to back: a large MoE model holds tens of thousands of records (one extra
    # state per expert), and rank 0 reads them while the other ranks wait
    for name, group in itertools.groupby(found, key=lambda r: r[0]):
        with _opened(f"checkpoint {iter_dir}: {name}", iter_dir / name) as f:
            for _, offset, length, fqn, transforms in group:
                where = f"checkpoint {iter_dir}: record {fqn}"
                if transforms:
                    raise ConfigError(f"{where} is stored transformed ({', '.join(transforms)}), which mcorekit "
                                      f"cannot check before a loader unpickles it; convert it with `mcorekit "
                                      f"convert` instead")
                # the seek inside _checked: a damaged offset is one line naming the record, as a damaged record is
                _checked(where, lambda o=offset, n=length: (f.seek(o), f.read(n))[1], "_extra_state" in fqn)
    if (common := iter_dir / "common.pt").is_file():
        _checked(f"checkpoint {iter_dir}: {common.name}", common.read_bytes, extra_state=False)


@contextmanager
def _opened(where: str, file: Path) -> Iterator[Any]:
    try:
        f = open(file, "rb")
    except OSError as e:
        raise ConfigError(f"{where} cannot be read ({e.strerror or e})") from None
    with f:
        yield f


def _checked(where: str, read: Any, extra_state: bool) -> Any:
    """One record (`read()` gives its bytes) unpickled as checked_records says, or one line."""
    try:
        obj = _weights_only(read())
        for state in _extra_states(obj) if extra_state else ():
            _check_extra_state(state)
        return obj
    except UnsafeRecord as e:
        raise ConfigError(f"{where} asks to run {e} when it is unpickled: refusing to load it (a checkpoint from an "
                          f"untrusted source goes through `mcorekit convert`, which runs nothing of it)") from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - unpickling damaged bytes can raise anything
        first = str(e).strip().splitlines()
        raise ConfigError(f"{where} is not readable ({type(e).__name__}: {first[0] if first else ''}): a damaged or "
                          f"incomplete checkpoint") from None


def common_state(iter_dir: Path) -> dict[str, Any]:
    """The checkpoint's common state (iteration, scheduler, Megatron-Core's args), as Megatron-Core's
    dist_checkpointing.load_common_state_dict returns it, with nothing unpickled unrestricted: that function reads
    `.metadata` with torch's reader (plain pickle) and the common-state record with DCP's default planner
    (torch.load, weights_only=False); here load_metadata and the weights-only unpickler (_weights_only), as the start's
    checks read them. read_ahead() has dist_checkpointing.load use it too."""
    if (legacy := iter_dir / "common.pt").is_file():  # older Megatron-Core: torch.load'ed weights-only there too
        return _checked(f"checkpoint {iter_dir}: common.pt", legacy.read_bytes, extra_state=False)
    from megatron.core.dist_checkpointing import ShardedObject

    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    metadata = load_metadata(iter_dir / ".metadata")
    found = [info for index, info in metadata.storage_data.items() if index.fqn == key]
    if len(found) != 1 or found[0].transform_descriptors:
        raise ConfigError(f"checkpoint {iter_dir}: {len(found)} plain common-state records, expected one (a damaged "
                          f"checkpoint, or one of another format)")
    info, where = found[0], f"checkpoint {iter_dir}: record {key}"
    with _opened(where, iter_dir / info.relative_path) as f:
        value = _checked(where, lambda: (f.seek(info.offset), f.read(info.length))[1], extra_state=False)
    if isinstance(value, io.BytesIO):  # how Megatron-Core saves it: a torch.save'd list inside the record
        value = _checked(where, value.getvalue, extra_state=False)
    if not (isinstance(value, list) and value and isinstance(value[0], dict)):
        raise ConfigError(f"{where} holds a {type(value).__name__}, not Megatron-Core's common state")
    return value[0]


def checked_metadata(iter_dir: Path) -> Metadata:
    """A checkpoint's DCP metadata (torch_dist or fsdp_dtensor), read by load_metadata: run before any loader reads
    the checkpoint (torch's and Megatron-Core's own unpickle `.metadata` without restriction; ours, RestrictedReader,
    reads it the same way again), so a crafted one is one error line and nothing in it runs. Its bytes records: checked_records, for checkpoints from elsewhere."""
    return load_metadata(iter_dir / ".metadata")


def fit_problems(sharded: dict[str, Any], metadata: Metadata) -> list[str]:
    """The tensors this run loads that the checkpoint lacks or holds at another global shape, as Megatron-Core's
    planner would find them one at a time in a traceback (factories and tensors allowed another shape, such as
    a padded vocabulary, are left to it). One line each, a key once."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    saved, problems, seen = metadata.state_dict_metadata, [], set()
    for t in nested_values(sharded):
        if not isinstance(t, ShardedTensor) or t.allow_shape_mismatch or t.key in seen:
            continue
        seen.add(t.key)
        if t.key not in saved:
            problems.append(f"{t.key} is not in it")
        elif tuple(saved[t.key].size) != tuple(t.global_shape):
            problems.append(f"{t.key} is {list(saved[t.key].size)} in it, {list(t.global_shape)} here")
    return problems


def check_fit(sharded: dict[str, Any], path: Path, metadata: Metadata) -> None:
    """fit_problems as one error on every rank (a pipeline stage may hold the only tensor that differs: the other
    ranks would otherwise go on and wait for it), before anything is read."""
    from mcorekit.runtime.ranks import any_rank

    problems = fit_problems(sharded, metadata)
    if any_rank(bool(problems)):
        shown = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        shown = shown or "another rank says which tensors differ"
        raise ConfigError(f"checkpoint {path} does not fit this model: {shown}; it was saved with other model settings "
                          f"(model, model.overrides, peft.lora) or another optimizer: load it with the settings it was "
                          f"saved with")


@contextmanager
def read_ahead() -> Iterator[None]:
    """Megatron-Core's torch_dist loads inside the block read through ReadAheadReader (Megatron-Core builds its
    reader per load in strategies.torch._get_filesystem_reader; only the plain reader is replaced: a metadata cache
    or the multi-storage client keep theirs), and their common state through common_state."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as strategies

    build, common = strategies._get_filesystem_reader, serialization.load_common_state_dict

    def reader(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> FileSystemReader:
        built = build(checkpoint_dir, *args, **kwargs)
        return ReadAheadReader(checkpoint_dir) if type(built) is FileSystemReader else built

    strategies._get_filesystem_reader = reader
    serialization.load_common_state_dict = lambda checkpoint_dir: common_state(Path(checkpoint_dir))
    try:
        yield
    finally:
        strategies._get_filesystem_reader, serialization.load_common_state_dict = build, common
