"""Megatron indexed datasets (.bin/.idx from `mcorekit data preprocess` or Megatron-LM's tools) through
Megatron-Core's own GPTDataset and BlendedMegatronDatasetBuilder: seeded shuffling, blending with weights,
index caches shared between runs."""

from __future__ import annotations

import json
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
        m = json.loads(meta.read_text())
        return TokenIds(int(m["eod"]), int(m["vocab_size"]))
    if tokenizer_dir:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        return TokenIds(int(tok.eos_token_id), len(tok))
    raise ConfigError(f"{prefix}: no {meta.name} side-car (written by `mcorekit data preprocess`); set data.tokenizer "
                      f"so the end-of-document id is known")


def check_prefixes(prefixes: list[str], weights: list[float] | None) -> None:
    missing = [p + ext for p in prefixes for ext in (".bin", ".idx") if not Path(p + ext).is_file()]
    if missing:
        raise ConfigError(f"indexed data not found: {', '.join(missing)}; "
                          f"data.paths are prefixes (without .bin/.idx) made by `mcorekit data preprocess`")
    if weights is not None and (len(weights) != len(prefixes) or any(w <= 0 for w in weights)):
        raise ConfigError(f"data.weights needs one positive weight per path ({len(prefixes)} paths, got {weights})")


def build_gpt_dataset(prefixes: list[str], weights: list[float] | None, seq_length: int, num_samples: int, seed: int,
                      cache_dir: Path, tokenizer_dir: str | None, model_vocab: int) -> Any:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    check_prefixes(prefixes, weights)
    ids = [token_ids(p, tokenizer_dir) for p in prefixes]
    if len({(i.eod, i.vocab_size) for i in ids}) > 1:
        raise ConfigError(f"data.paths were tokenized with different tokenizers ({ids}); blend data of one tokenizer")
    if ids[0].vocab_size > model_vocab:
        raise ConfigError(f"the data's tokenizer has {ids[0].vocab_size} tokens but the model's vocabulary is {model_vocab}")
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
