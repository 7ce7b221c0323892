"""HF checkpoints on disk: validated streaming reads of sharded safetensors, and size-bounded sharded writes."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mcorekit.errors import ConversionError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Everything besides the weights that a served or fine-tuned model needs; copied as they are.
ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
ASSET_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


class HFReader:
    """Reads one tensor at a time with pread (no mmap, so untouched shards never count against memory).
    Every shard's header is parsed and checked against the file size up front, so a missing, corrupt or
    truncated shard fails before anything is written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ConversionError(f"{self.path}: no config.json; pass an HF model directory")
        self.config: dict[str, Any] = json.loads((self.path / "config.json").read_text())
        if (self.path / INDEX).is_file():
            weight_map: dict[str, str] = json.loads((self.path / INDEX).read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            weight_map = {}
        else:
            bins = sorted(p.name for p in self.path.glob("*.bin"))
            raise ConversionError(
                f"{self.path}: no {INDEX} or {SINGLE}"
                + (f" (found {bins[0]}...: only safetensors are read; re-save with save_pretrained(safe_serialization=True))" if bins else "")
            )
        shards = sorted(set(weight_map.values())) or [SINGLE]
        self.entries: dict[str, tuple[str, int, torch.dtype, tuple[int, ...], int]] = {}
        for shard in shards:
            header, base = self._header(shard)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                self.entries[name] = (shard, base + begin, ST_DTYPES[info["dtype"]], tuple(info["shape"]), end - begin)
            expected = {k for k, v in weight_map.items() if v == shard}
            if expected - set(header):
                raise ConversionError(f"{self.path / shard}: the index lists {sorted(expected - set(header))[:3]} but the shard lacks them")
        self.weight_map = {name: e[0] for name, e in self.entries.items()}
        self._fds: dict[str, int] = {}

    def _header(self, shard: str) -> tuple[dict[str, Any], int]:
        file = self.path / shard
        if not file.is_file():
            raise ConversionError(f"missing shard {file} (listed in {INDEX}); re-download or re-save the checkpoint")
        size = file.stat().st_size
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError(f"header length {n} exceeds the file")
                header = json.loads(f.read(n))
            data = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            for k, v in header.items():
                if k != "__metadata__" and v["dtype"] not in ST_DTYPES:
                    raise ValueError(f"tensor {k} has unsupported dtype {v['dtype']}")
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise ConversionError(f"corrupt or truncated safetensors file {file}: bad header ({e})") from None
        if 8 + n + data > size:
            raise ConversionError(f"corrupt or truncated safetensors file {file}: {size} bytes, header needs {8 + n + data}")
        return header, 8 + n

    def names(self) -> list[str]:
        return sorted(self.entries)

    def shard_files(self) -> list[Path]:
        return [self.path / s for s in sorted(set(self.weight_map.values()))]

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries.get(name)
        if entry is None:
            raise ConversionError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        shard, offset, dtype, shape, nbytes = entry
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(self.path / shard, os.O_RDONLY)
        buf = bytearray(nbytes)
        view, done = memoryview(buf), 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise ConversionError(f"{self.path / shard}: file ended inside tensor {name!r}")
            done += got
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class HFWriter:
    """Collects tensors into shards of at most max_shard_bytes and writes each full shard on a background
    thread while the next one fills (reading and writing overlap; at most two shards are in memory)."""

    def __init__(self, path: Path, max_shard_bytes: int = 5 * 1024**3) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        self.path = path
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._inflight: Future | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        n = len(self.shards) + 1
        self._wait()
        self._inflight = self._pool.submit(save_file, self.pending, str(self.path / f"part-{n:05d}.safetensors"),
                                           {"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def _wait(self) -> None:
        if self._inflight is not None:
            self._inflight.result()  # re-raises a failed write here
            self._inflight = None

    def finish(self) -> None:
        if self.pending:
            self._flush()
        self._wait()
        self._pool.shutdown()
        total = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards, start=1):
            final = f"model-{i:05d}-of-{total:05d}.safetensors"
            (self.path / f"part-{i:05d}.safetensors").rename(self.path / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.path / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def copy_assets(src: Path, dst: Path, config: dict[str, Any] | None = None) -> list[str]:
    """Copy config, generation config and tokenizer files; `config` replaces config.json when given."""
    copied = []
    for name in ASSET_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return copied
