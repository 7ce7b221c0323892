"""HF checkpoints on disk: validated streaming reads of sharded safetensors, and size-bounded sharded writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcorekit.errors import ConversionError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Everything besides the weights that a served or fine-tuned model needs; copied as they are.
ASSET_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


class HFReader:
    """Reads one tensor at a time; every shard's header is checked up front, so a missing or corrupt
    shard fails before anything is written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ConversionError(f"{self.path}: no config.json; pass an HF model directory")
        self.config: dict[str, Any] = json.loads((self.path / "config.json").read_text())
        if (self.path / INDEX).is_file():
            index = json.loads((self.path / INDEX).read_text())
            self.weight_map: dict[str, str] = index["weight_map"]
        elif (self.path / SINGLE).is_file():
            self.weight_map = {}
            with self._open(SINGLE) as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
        else:
            bins = sorted(p.name for p in self.path.glob("*.bin"))
            raise ConversionError(
                f"{self.path}: no {INDEX} or {SINGLE}"
                + (f" (found {bins[0]}...: only safetensors are read; re-save with save_pretrained(safe_serialization=True))" if bins else "")
            )
        self._handles: dict[str, Any] = {}
        for shard in sorted(set(self.weight_map.values())):
            with self._open(shard) as f:
                present = set(f.keys())
            expected = {k for k, v in self.weight_map.items() if v == shard}
            if expected - present:
                raise ConversionError(f"{self.path / shard}: the index lists {sorted(expected - present)[:3]} but the shard lacks them")

    def _open(self, shard: str) -> Any:
        file = self.path / shard
        if not file.is_file():
            raise ConversionError(f"missing shard {file} (listed in {INDEX}); re-download or re-save the checkpoint")
        try:
            return safe_open(str(file), framework="pt")
        except Exception as e:  # safetensors raises its own error types for bad headers and short files
            raise ConversionError(f"corrupt or truncated safetensors file {file}: {e}") from None

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def shard_files(self) -> list[Path]:
        return [self.path / s for s in sorted(set(self.weight_map.values()))]

    def get(self, name: str) -> torch.Tensor:
        shard = self.weight_map.get(name)
        if shard is None:
            raise ConversionError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        handle = self._handles.get(shard)
        if handle is None:
            handle = self._handles[shard] = self._open(shard).__enter__()
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise ConversionError(f"{self.path / shard}: cannot read tensor {name!r}: {e}") from None

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()


class HFWriter:
    """Collects tensors into shards of at most max_shard_bytes and writes each shard as soon as it is full."""

    def __init__(self, path: Path, max_shard_bytes: int = 5 * 1024**3) -> None:
        self.path = path
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        n = len(self.shards) + 1
        save_file(self.pending, str(self.path / f"part-{n:05d}.safetensors"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.pending:
            self._flush()
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
