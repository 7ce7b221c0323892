"""jsonl -> Megatron indexed dataset (.bin/.idx), tokenized with an HF tokenizer on every core.

One document per line (`--key` names the text field, default "text"), an end-of-document token appended to
each. Worker processes tokenize batches of lines; the parent writes them in input order, so the output does
not depend on the number of workers. Written under temporary names and renamed when complete; a side-car
PREFIX.json records the tokenizer's eod id and vocabulary size for train/.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from mcorekit.errors import ConfigError

BATCH_LINES = 512
_tokenizer: Any = None
_key = "text"
_eod = 0


@dataclass
class PreprocessSummary:
    documents: int
    tokens: int
    seconds: float
    workers: int

    def line(self, prefix: str) -> str:
        return (f"{prefix}: {self.documents} documents, {self.tokens} tokens in {self.seconds:.1f} s "
                f"({self.tokens / max(self.seconds, 1e-9) / 1e3:.0f}k tokens/s, {self.workers} workers)")


def _init_worker(tokenizer_dir: str, key: str, eod: int) -> None:
    global _tokenizer, _key, _eod
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    # A fast tokenizer's tokenizer.json holds the whole pipeline: load it with `tokenizers` alone (workers start in
    # a fraction of a second instead of importing torch through transformers); slow tokenizers need transformers.
    if (Path(tokenizer_dir) / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        _tokenizer = lambda texts: [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)]  # noqa: E731
    else:
        from transformers import AutoTokenizer

        slow = AutoTokenizer.from_pretrained(tokenizer_dir)
        _tokenizer = lambda texts: slow(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    _key, _eod = key, eod


def _tokenize(batch: tuple[str, int, list[str]]) -> list[np.ndarray]:
    path, first_line, lines = batch
    texts = []
    for n, line in enumerate(lines, start=first_line):
        try:
            record = json.loads(line)
            texts.append(record[_key])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}:{n}: not a JSON object with a {_key!r} string ({type(e).__name__}: {e})") from None
        if not isinstance(texts[-1], str):
            raise ConfigError(f"{path}:{n}: field {_key!r} is {type(texts[-1]).__name__}, not a string")
    return [np.asarray(list(doc) + [_eod], dtype=np.int32) for doc in _tokenizer(texts)]


def _batches(paths: list[Path]) -> Iterator[tuple[str, int, list[str]]]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            batch, first = [], 1
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if not batch:
                    first = n
                batch.append(line)
                if len(batch) == BATCH_LINES:
                    yield str(path), first, batch
                    batch = []
            if batch:
                yield str(path), first, batch


def preprocess(inputs: list[str], tokenizer_dir: str, output_prefix: str, key: str = "text", workers: int | None = None,
               force: bool = False, quiet: bool = False) -> PreprocessSummary:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm
    from transformers import AutoTokenizer

    paths = [Path(p) for p in inputs]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"input not found: {', '.join(missing)}")
    out = {ext: Path(output_prefix + ext) for ext in (".bin", ".idx", ".json")}
    existing = [str(p) for p in out.values() if p.exists()]
    if existing and not force:
        raise ConfigError(f"output exists: {', '.join(existing)}; pass --force to replace it")
    if not Path(tokenizer_dir).exists():
        raise ConfigError(f"tokenizer not found: {tokenizer_dir} (an HF tokenizer directory)")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer {tokenizer_dir} has no eos token to end documents with; set eos_token in its config")
    vocab = len(tok)
    dtype = DType.optimal_dtype(vocab)
    out[".bin"].parent.mkdir(parents=True, exist_ok=True)
    tmp = {ext: p.with_name(p.name + ".tmp") for ext, p in out.items()}
    workers = workers or os.cpu_count() or 1
    start = time.perf_counter()
    docs = tokens = 0
    builder = IndexedDatasetBuilder(str(tmp[".bin"]), dtype=dtype)
    try:
        with mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_dir, key, tok.eos_token_id)) as pool, \
                tqdm(unit="tok", unit_scale=True, disable=quiet, desc="tokenizing") as bar:
            for batch in pool.imap(_tokenize, _batches(paths), chunksize=1):  # imap keeps input order
                for doc in batch:
                    builder.add_document(doc, [doc.size])
                batch_tokens = sum(d.size for d in batch)
                tokens += batch_tokens
                docs += len(batch)
                bar.update(batch_tokens)
        builder.finalize(str(tmp[".idx"]))
        tmp[".json"].write_text(json.dumps({"tokenizer": str(tokenizer_dir), "eod": int(tok.eos_token_id),
                                            "vocab_size": vocab, "documents": docs, "tokens": tokens, "key": key}))
    except BaseException:
        for p in tmp.values():
            p.unlink(missing_ok=True)
        raise
    if docs == 0:
        for p in tmp.values():
            p.unlink(missing_ok=True)
        raise ConfigError(f"no documents in {', '.join(inputs)}")
    for ext in (".bin", ".json", ".idx"):  # the .idx last: a prefix with an .idx is complete
        os.replace(tmp[ext], out[ext])
    return PreprocessSummary(docs, tokens, time.perf_counter() - start, workers)
