"""Megatron indexed datasets (.bin/.idx from `mcorekit data preprocess` or Megatron-LM's tools) through
Megatron-Core's own GPTDataset and BlendedMegatronDatasetBuilder: seeded shuffling, blending with weights,
index caches shared between runs."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from mcorekit.errors import ConfigError
from mcorekit.runtime.ranks import rank_zero_choice

log = logging.getLogger("mcorekit.train")


@dataclass
class TokenIds:
    """What GPTDataset needs of a tokenizer: the end-of-document id and the vocabulary size; `data`, the index
    digest of the prefixes read, goes into Megatron-Core's cache key with them."""

    eod: int
    vocab_size: int
    data: str = ""

    @property
    def unique_identifiers(self) -> dict[str, int | str]:  # part of the dataset cache key
        return {"eod": self.eod, "vocab_size": self.vocab_size, "data": self.data}


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
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, an integer too long to read
        raise ConfigError(f"{meta}: not a valid JSON side-car ({type(e).__name__}); {fix}") from None
    if not isinstance(m, dict):
        raise ConfigError(f"{meta}: expected a JSON object with eod and vocab_size; {fix}")
    bad = [k for k in ("eod", "vocab_size") if not isinstance(m.get(k), int) or isinstance(m.get(k), bool)]
    if bad:
        raise ConfigError(f"{meta}: {' and '.join(bad)} missing or not an integer; {fix}")
    if not 0 <= m["eod"] < m["vocab_size"]:
        raise ConfigError(f"{meta}: eod={m['eod']} is outside the vocabulary (vocab_size={m['vocab_size']}); {fix}")
    return TokenIds(m["eod"], m["vocab_size"])


# Megatron-Core's .idx (megatron/core/datasets/indexed_dataset.py): header, version, dtype code, counts, then the
# arrays: each sequence's length (int32) and byte offset in the .bin (int64), and the document index (int64)
INDEX_HEADER = b"MMIDIDX\x00\x00"
TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}  # code -> dtype;
# 6 and 7 are float64 and float32, which Megatron's format allows and no tokenizer writes
HEAD = struct.Struct("<9sQBQQ")
CHUNK = 1 << 22  # elements per step of the array checks: bounded memory for an index of any size


def check_index(prefix: str, digest: Any = None) -> None:
    """The .idx is whole and describes its .bin: every sequence's length non-negative and its bytes right after the
    previous one's, the last ending where the .bin does, the document index rising from 0 to the sequence count. A
    truncated, foreign or crafted pair fails here with its file named, not in Megatron's reader at whatever step
    first reads the bad document (a traceback hours into a run, the other ranks waiting). `digest` (a hashlib
    object), when given, takes what the index holds in the same pass: the header, the lengths and the document index
    (the offsets follow from the lengths, as checked)."""
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
    if code not in TOKEN_DTYPES:
        raise ConfigError(f"{idx}: token dtype code {code} is not an integer type Megatron writes "
                          f"({', '.join(f'{k} {v.__name__}' for k, v in TOKEN_DTYPES.items())}); {fix}")
    need = HEAD.size + sequences * (4 + 8) + documents * 8
    if documents < 1 or size < need:
        raise ConfigError(f"{idx}: truncated or corrupt ({size} bytes; {sequences} sequences and {documents - 1} "
                          f"documents need {need}); {fix}")
    if sequences == 0:  # Megatron's reader would fail on mapping an empty .bin, with a traceback
        raise ConfigError(f"{idx}: holds no documents; {fix}, or drop the prefix from data.paths")
    lengths = np.memmap(idx, np.int32, "r", HEAD.size, (sequences,))
    offsets = np.memmap(idx, np.int64, "r", HEAD.size + sequences * 4, (sequences,))
    starts = np.memmap(idx, np.int64, "r", HEAD.size + sequences * 12, (documents,))
    item = np.dtype(TOKEN_DTYPES[code]).itemsize
    update = digest.update if digest is not None else lambda _: None
    update(head)
    end = 0  # where the next sequence must start
    for i in range(0, sequences, CHUNK):
        update(lengths[i:i + CHUNK].tobytes())
        length, offset = lengths[i:i + CHUNK].astype(np.int64), offsets[i:i + CHUNK]
        expected = end + np.concatenate(([0], np.cumsum(length[:-1] * item)))
        if (length < 0).any() or (offset != expected).any():
            bad = i + int(np.flatnonzero((length < 0) | (offset != expected))[0])
            raise ConfigError(f"{idx}: sequence {bad} has length {lengths[bad]} at byte {offsets[bad]} of the .bin, "
                              f"where the sequences before it end at byte {int(expected[bad - i])} (corrupt or "
                              f"crafted); {fix}")
        end = int(expected[-1] + length[-1] * item)
    if bin_.stat().st_size != end:  # the .bin ends where its last document does
        raise ConfigError(f"{bin_}: {bin_.stat().st_size} bytes, but {idx.name} places its last document's end at "
                          f"byte {end} (truncated, or the pair does not belong together); {fix}")
    previous = 0
    for i in range(0, documents, CHUNK):
        part = starts[i:i + CHUNK]
        update(part.tobytes())
        if (np.diff(part, prepend=previous) < 0).any() or (i == 0 and part[0] != 0):
            raise ConfigError(f"{idx}: its document index does not rise from 0 (corrupt or crafted); {fix}")
        previous = int(part[-1])
    if previous != sequences:
        raise ConfigError(f"{idx}: its document index ends at sequence {previous}, not at its {sequences} sequences "
                          f"(corrupt or crafted); {fix}")


def check_prefixes(prefixes: list[str], weights: list[float] | None) -> str:
    """Each prefix's pair checked (check_index); the digest of their indexes, for the cache key: Megatron-Core keys
    its index cache on the paths, not on what they hold, so data preprocessed again under the same prefix would get
    stale indices (samples cut at the old documents' ends, or reading past the new ones)."""
    missing = [p + ext for p in prefixes for ext in (".bin", ".idx") if not Path(p + ext).is_file()]
    if missing:
        raise ConfigError(f"indexed data not found: {', '.join(missing)}; "
                          f"data.paths are prefixes (without .bin/.idx) made by `mcorekit data preprocess`")
    if weights is not None and (len(weights) != len(prefixes) or any(w <= 0 for w in weights)):
        raise ConfigError(f"data.weights needs one positive weight per path ({len(prefixes)} paths, got {weights})")
    digest = hashlib.blake2b(digest_size=16)
    for p in prefixes:
        check_index(p, digest)
    return digest.hexdigest()


def build_gpt_dataset(prefixes: list[str], weights: list[float] | None, seq_length: int, num_samples: int, seed: int,
                      cache_dir: Path, tokenizer_dir: str | None, model_vocab: int) -> Any:
    # rank 0 reads each .idx whole, not every rank (a few GB of index read by thousands of ranks from one shared file
    # system); its digest is every rank's cache key, so they all find the index files rank 0 builds. Each rank sees
    # the same files, or stops: a node-local copy that differs would read other documents through rank 0's indices
    digest, sizes = rank_zero_choice(lambda: (check_prefixes(prefixes, weights), _sizes(prefixes)))
    if differ := [f"{p} (here {a}; rank 0 {b})" for p, a, b in zip(prefixes, _sizes(prefixes), sizes) if a != b]:
        import socket

        raise ConfigError(f"the indexed data on {socket.gethostname()} is not rank 0's: {'; '.join(differ)}; a "
                          f"node-local copy that is missing or differs? Give every node the same files")
    ids = [token_ids(p, tokenizer_dir) for p in prefixes]
    if len({(i.eod, i.vocab_size) for i in ids}) > 1:
        raise ConfigError(f"data.paths were tokenized with different tokenizers ({ids}); blend data of one tokenizer")
    if ids[0].vocab_size > model_vocab:
        raise ConfigError(f"the data's tokenizer has {ids[0].vocab_size} tokens but the model's vocabulary is {model_vocab}")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cache_dir.mkdir(parents=True, exist_ok=True)
    tokens = TokenIds(ids[0].eod, ids[0].vocab_size, digest)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(list(prefixes), list(weights) if weights else None),
        split="100,0,0", path_to_cache=str(cache_dir), tokenizer=tokens, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False, mmap_bin_files=True)
    built_on_all = lambda: True  # noqa: E731  (the builder coordinates ranks itself when distributed is up)
    writes = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0  # the rank that writes it
    with cache_lock(cache_dir) if writes else contextlib.nullcontext():
        if writes:
            drop_damaged_cache(cache_dir)
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], built_on_all, config).build()
    return IndexedSamples(train, tokens.vocab_size, prefixes)


def _sizes(prefixes: list[str]) -> list[str]:
    """Each prefix's .idx and .bin sizes as this process sees them, as text for a message."""
    return [", ".join(f"{f.suffix} {f.stat().st_size:,} bytes" if f.is_file() else f"{f.suffix} missing"
                      for f in (Path(p + ".idx"), Path(p + ".bin"))) for p in prefixes]


@contextlib.contextmanager
def cache_lock(cache_dir: Path) -> Iterator[None]:
    """The index cache's folder to this process while it checks and builds there: data.cache_dir may be shared by
    runs starting together (a sweep), whose files half-written would look damaged. Where the file system has no
    locks, nothing is held (as before)."""
    with open(cache_dir / ".lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # ENOLCK, EOPNOTSUPP: a file system without locks
            pass
        yield


def drop_damaged_cache(cache_dir: Path) -> None:
    """Removes the index-cache files that do not load as plain arrays: a start killed while Megatron-Core wrote them
    leaves one cut short, which it would find (it looks for the files, not at them) and fail on at every later start.
    Megatron-Core loads them with pickles allowed; a file that needs that is not one it wrote, and goes too."""
    for f in sorted(cache_dir.glob("*.npy")):
        try:
            np.load(f, mmap_mode="r", allow_pickle=False)
        except (ValueError, EOFError, OSError) as e:
            log.warning("%s: removed from the dataset index cache, it does not load (%s); it is built again", f,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            f.unlink(missing_ok=True)


class IndexedSamples:
    """GPTDataset/BlendedDataset samples as our loader's dict (tokens, labels, loss_mask, position_ids). Each sample's
    token ids are checked against the data's vocabulary: an id past it would train on a wrong loss or index past the
    embedding (a device assert on the GPU, with TP silently zeroed), and the .bin is too big to scan at the start."""

    def __init__(self, dataset: Any, vocab_size: int, prefixes: list[str]) -> None:
        self.dataset, self.vocab_size, self.prefixes = dataset, vocab_size, prefixes

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        s = self.dataset[index % len(self.dataset)]
        for ids in (s["tokens"], s["labels"]):
            low, high = torch.aminmax(ids)
            if low < 0 or high >= self.vocab_size:
                raise ConfigError(f"sample {index} of {', '.join(self.prefixes)} holds token id "
                                  f"{int(low if low < 0 else high)}, outside the data's vocabulary of "
                                  f"{self.vocab_size} (its side-car or data.tokenizer): the .bin was written with "
                                  f"another tokenizer or is damaged; re-run `mcorekit data preprocess`")
        return {"tokens": s["tokens"], "labels": s["labels"], "loss_mask": s["loss_mask"].float(),
                "position_ids": s["position_ids"]}


def read_documents(prefix: str) -> list[np.ndarray]:
    """Every document of a .bin/.idx pair (for tests and inspection)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [np.array(ds[i]) for i in range(len(ds))]  # copies: the views die with the mmap
