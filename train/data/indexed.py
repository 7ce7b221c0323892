"""Megatron indexed datasets (.bin/.idx from `mcorekit data preprocess` or Megatron-LM's tools) through
Megatron-Core's own GPTDataset and BlendedMegatronDatasetBuilder: seeded shuffling, blending with weights,
index caches shared between runs."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mcorekit.errors import ConfigError


@dataclass
class TokenIds:
    """What GPTDataset needs of a tokenizer: the end-of-document id and the vocabulary size."""

    eod: int
    vocab_size: int

    @property
    def unique_identifiers(self) -> dict[str, int]:  # part of the dataset cache key
        return {"eod": self.eod, "vocab_size": self.vocab_size}


def token_ids(prefix: str, tokenizer_dir: str | None) -> TokenIds:
    """From the side-car `PREFIX.json` that preprocess writes, else from the HF tokenizer given."""
    meta = Path(prefix + ".json")
    if meta.is_file():
        return _sidecar_ids(meta)
    if tokenizer_dir:
        from mcorekit.train.data.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer_dir)
        return TokenIds(int(tok.eos_token_id), len(tok))
    raise ConfigError(f"{prefix}: no {meta.name} side-car (written by `mcorekit data preprocess`); set data.tokenizer "
                      f"so the end-of-document id is known")


def _sidecar_ids(meta: Path) -> TokenIds:
    fix = "re-run `mcorekit data preprocess` for this prefix, or delete the file and set data.tokenizer"
    if meta.stat().st_size > 1024**2:  # the side-car is a few hundred bytes
        raise ConfigError(f"{meta}: {meta.stat().st_size} bytes, too big for a preprocess side-car; {fix}")
    try:
        m = json.loads(meta.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{meta}: not a valid JSON side-car ({type(e).__name__}); {fix}") from None
    if not isinstance(m, dict):
        raise ConfigError(f"{meta}: expected a JSON object with eod and vocab_size; {fix}")
    bad = [k for k in ("eod", "vocab_size") if not isinstance(m.get(k), int) or isinstance(m.get(k), bool)]
    if bad:
        raise ConfigError(f"{meta}: {' and '.join(bad)} missing or not an integer; {fix}")
    if not 0 <= m["eod"] < m["vocab_size"]:
        raise ConfigError(f"{meta}: eod={m['eod']} is outside the vocabulary (vocab_size={m['vocab_size']}); {fix}")
    return TokenIds(m["eod"], m["vocab_size"])


# Megatron-Core's .idx (megatron/core/datasets/indexed_dataset.py): header, version, dtype code, counts, arrays.
INDEX_HEADER = b"MMIDIDX\x00\x00"
ITEM_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # DType code -> bytes per token
HEAD = struct.Struct("<9sQBQQ")


def check_index(prefix: str) -> None:
    """The .idx is whole and its last document lies inside the .bin: a truncated or foreign pair fails here with
    its file named, not deep inside Megatron's reader."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    fix = "re-run `mcorekit data preprocess` for this prefix"
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(HEAD.size)
        if len(head) < HEAD.size:
            raise ConfigError(f"{idx}: truncated ({size} bytes, the header alone is {HEAD.size}); {fix}")
        magic, version, code, sequences, documents = HEAD.unpack(head)
        if magic != INDEX_HEADER or version != 1:
            raise ConfigError(f"{idx}: not a Megatron indexed-dataset index (header {magic!r}, version {version}); {fix}")
        if code not in ITEM_SIZES:
            raise ConfigError(f"{idx}: unknown token dtype code {code}; {fix}")
        need = HEAD.size + sequences * (4 + 8) + documents * 8
        if documents < 1 or size < need:
            raise ConfigError(f"{idx}: truncated or corrupt ({size} bytes; {sequences} sequences and {documents - 1} "
                              f"documents need {need}); {fix}")
        if sequences == 0:  # Megatron's reader would fail on mapping an empty .bin, with a traceback
            raise ConfigError(f"{idx}: holds no documents; {fix}, or drop the prefix from data.paths")
        f.seek(HEAD.size + (sequences - 1) * 4)
        (last_len,) = struct.unpack("<i", f.read(4))
        f.seek(HEAD.size + sequences * 4 + (sequences - 1) * 8)
        (last_ptr,) = struct.unpack("<q", f.read(8))
    end = last_ptr + last_len * ITEM_SIZES[code]
    if last_len < 0 or last_ptr < 0 or bin_.stat().st_size != end:  # the .bin ends where its last document does
        raise ConfigError(f"{bin_}: {bin_.stat().st_size} bytes, but {idx.name} places its last document at bytes "
                          f"{last_ptr}..{end} (truncated, or the pair does not belong together); {fix}")


def check_prefixes(prefixes: list[str], weights: list[float] | None) -> None:
    missing = [p + ext for p in prefixes for ext in (".bin", ".idx") if not Path(p + ext).is_file()]
    if missing:
        raise ConfigError(f"indexed data not found: {', '.join(missing)}; "
                          f"data.paths are prefixes (without .bin/.idx) made by `mcorekit data preprocess`")
    if weights is not None and (len(weights) != len(prefixes) or any(w <= 0 for w in weights)):
        raise ConfigError(f"data.weights needs one positive weight per path ({len(prefixes)} paths, got {weights})")
    for p in prefixes:
        check_index(p)


def build_gpt_dataset(prefixes: list[str], weights: list[float] | None, seq_length: int, num_samples: int, seed: int,
                      cache_dir: Path, tokenizer_dir: str | None, model_vocab: int) -> Any:
    check_prefixes(prefixes, weights)
    ids = [token_ids(p, tokenizer_dir) for p in prefixes]
    if len({(i.eod, i.vocab_size) for i in ids}) > 1:
        raise ConfigError(f"data.paths were tokenized with different tokenizers ({ids}); blend data of one tokenizer")
    if ids[0].vocab_size > model_vocab:
        raise ConfigError(f"the data's tokenizer has {ids[0].vocab_size} tokens but the model's vocabulary is {model_vocab}")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cache_dir.mkdir(parents=True, exist_ok=True)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(list(prefixes), list(weights) if weights else None),
        split="100,0,0", path_to_cache=str(cache_dir), tokenizer=ids[0], reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False, mmap_bin_files=True)
    built_on_all = lambda: True  # noqa: E731  (the builder coordinates ranks itself when distributed is up)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], built_on_all, config).build()
    return IndexedSamples(train)


class IndexedSamples:
    """GPTDataset/BlendedDataset samples as our loader's dict (tokens, labels, loss_mask, position_ids)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        s = self.dataset[index % len(self.dataset)]
        return {"tokens": s["tokens"], "labels": s["labels"], "loss_mask": s["loss_mask"].float(),
                "position_ids": s["position_ids"]}


def read_documents(prefix: str) -> list[np.ndarray]:
    """Every document of a .bin/.idx pair (for tests and inspection)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [np.array(ds[i]) for i in range(len(ds))]  # copies: the views die with the mmap
