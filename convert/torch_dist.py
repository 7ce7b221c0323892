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
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadPlan,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mcorekit.errors import ConversionError

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


class StreamingSavePlanner(SavePlanner):
    """A SavePlanner whose tensors do not exist until DCP resolves them, chunk by chunk."""

    def __init__(self, tensors: list[PlannedTensor], blobs: dict[str, bytes],
                 on_chunk: Callable[[int], None] | None = None) -> None:
        self.tensors = tensors
        self.blobs = blobs
        self.on_chunk = on_chunk
        self.sources: dict[tuple[str, tuple[int, ...]], ChunkSource] = {}

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
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
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


def write(path: Path, tensors: list[PlannedTensor], blobs: dict[str, bytes], threads: int = 2,
          on_chunk: Callable[[int], None] | None = None) -> None:
    """Write one torch_dist iteration directory (path must not exist yet)."""
    path.mkdir(parents=True)
    writer = FileSystemWriter(str(path), single_file_per_rank=True, thread_count=threads, sync_files=True)
    try:
        dcp.save({}, storage_writer=writer, planner=StreamingSavePlanner(tensors, blobs, on_chunk), no_dist=True)
    except CheckpointException as e:  # DCP wraps whatever failed inside it; surface the original
        inner = next(iter(e.failures.values()), e)
        inner = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback)
        if isinstance(inner, (ConversionError, KeyboardInterrupt)):
            raise inner from None
        raise ConversionError(f"writing {path} failed: {inner}") from None
    (path / "metadata.json").write_text(json.dumps(BACKEND))


# ---------------------------------------------------------------- reading


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Loads arbitrary sub-blocks of stored global tensors (e.g. one layer of a stacked tensor)."""

    def __init__(self, requests: dict[str, tuple[ChunkStorageMetadata, torch.Tensor]]) -> None:
        super().__init__()
        self.requests = requests

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata
        self.state_dict = {fqn: buf for fqn, (_, buf) in self.requests.items()}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, (chunk, _) in self.requests.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise ConversionError(f"tensor {fqn!r} is not in the checkpoint")
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


class TorchDistReader:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta_json = self.path / "metadata.json"
        if not meta_json.is_file():
            raise ConversionError(f"{self.path}: no metadata.json; not a Megatron torch_dist checkpoint directory (iter_N/)")
        backend = json.loads(meta_json.read_text())
        if backend.get("sharded_backend") != "torch_dist":
            raise ConversionError(f"{self.path}: backend {backend.get('sharded_backend')!r}, expected torch_dist")
        try:
            self.reader = FileSystemReader(str(self.path))
            self.metadata: Metadata = self.reader.read_metadata()
        except Exception as e:
            raise ConversionError(f"{self.path}: cannot read the DCP metadata (.metadata): {e}") from None
        self._check_files()

    def _check_files(self) -> None:
        for info in {i.relative_path for i in self.metadata.storage_data.values()}:
            if not (self.path / info).is_file():
                raise ConversionError(f"missing checkpoint file {self.path / info} (listed in .metadata)")
        sizes: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
        for rel, need in sizes.items():
            have = (self.path / rel).stat().st_size
            if have < need:
                raise ConversionError(f"truncated checkpoint file {self.path / rel}: {have} bytes, .metadata needs {need}")

    def tensor_keys(self) -> dict[str, TensorStorageMetadata]:
        return {k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def bytes_keys(self) -> list[str]:
        return sorted(k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))

    def read(self, fqn: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """The sub-tensor at leading index `index`: read(k) is the whole tensor, read(k, (l,)) one layer,
        read(k, (l, e)) one expert of one layer."""
        md = self.tensor_keys().get(fqn)
        if md is None:
            raise ConversionError(f"{self.path}: tensor {fqn!r} is not in the checkpoint")
        size = tuple(md.size)
        offsets = tuple(index) + (0,) * (len(size) - len(index))
        sizes = (1,) * len(index) + size[len(index):]
        buf = torch.empty(sizes, dtype=md.properties.dtype)
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        dcp.load({}, storage_reader=self.reader, planner=_ChunkLoadPlanner({fqn: (chunk, buf)}), no_dist=True)
        return buf.reshape(size[len(index):])

    def read_bytes(self, key: str) -> Any:
        holder = {key: io.BytesIO()}
        dcp.load(holder, storage_reader=self.reader, no_dist=True)
        return holder[key]
