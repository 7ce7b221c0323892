"""jsonl -> Megatron indexed dataset (.bin/.idx), tokenized with an HF tokenizer on every core.

One document per line (`--key` names the text field, default "text"), an end-of-document token appended to
each. Worker processes tokenize batches of lines (at most BATCH_LINES lines and about BATCH_BYTES bytes, with at
most two batches per worker in flight, so memory is bounded by bytes, not line counts); the parent writes them
in input order, so the output does not depend on the number of workers. Lines longer than --max-line-mb are
refused before they are read whole.

Written under `PREFIX.EXT.tmp-PID` names and renamed when complete, the .idx last: a prefix with an .idx is
complete. A side-car PREFIX.json records the tokenizer's eod id and vocabulary size for train/, and marks the
files as ours: --force replaces only a prefix whose .json is such a side-car, and never an input.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import time
from array import array
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from mcorekit.errors import ConfigError, first_line
from mcorekit.train.data.jsonl import MAX_LINE_MB, json_object, raw_lines, text_problem

BATCH_LINES = 512
BATCH_BYTES = 8 * 1024**2
EXTS = (".bin", ".idx", ".json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SIDECAR_KEYS = ("tokenizer", "eod", "vocab_size", "documents", "tokens", "key")
# Megatron-Core's indexed dataset format (megatron/core/datasets/indexed_dataset.py), version 1, no modes.
INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}

_tokenizer: Any = None
_key = "text"
_eod = 0


@dataclass
class PreprocessSummary:
    documents: int
    tokens: int
    seconds: float
    workers: int
    empty: int = 0  # documents of an empty text: the eod token alone

    def line(self, prefix: str) -> str:
        empty = f"; {self.empty} of the documents empty (an eod token alone)" if self.empty else ""
        return (f"{prefix}: {self.documents} documents, {self.tokens} tokens in {self.seconds:.1f} s "
                f"({self.tokens / max(self.seconds, 1e-9) / 1e3:.0f}k tokens/s, {self.workers} workers){empty}")


# ---------------------------------------------------------------- tokenizing (in workers)


def _encoder(tokenizer_dir: str, pipeline: str | None) -> Any:
    """texts -> token id lists, without special tokens. A fast tokenizer's whole pipeline is `pipeline`, the JSON of
    the backend tokenizer transformers assembled (tokenizer.json with what tokenizer_config.json adds, such as its
    added tokens: tokenizer.json alone would encode those as pieces of text): workers run it with `tokenizers` alone
    and start in a fraction of a second instead of importing torch through transformers. Slow tokenizers need
    transformers."""
    if pipeline is not None:
        from tokenizers import Tokenizer

        fast = Tokenizer.from_str(pipeline)
        encode = getattr(fast, "encode_batch_fast", fast.encode_batch)  # no offsets: far less memory per token
        return lambda texts: [e.ids for e in encode(texts, add_special_tokens=False)]
    from transformers import AutoTokenizer

    slow = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    return lambda texts: slow(texts, add_special_tokens=False)["input_ids"]


def _init_worker(tokenizer_dir: str, pipeline: str | None, key: str, eod: int) -> None:
    global _tokenizer, _key, _eod
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _tokenizer, _key, _eod = _encoder(tokenizer_dir, pipeline), key, eod


def _text(raw: bytes, where: str) -> str | None:
    """The document of one line, or None for a blank line."""
    record = json_object(raw, where)
    if record is None:
        return None
    if _key not in record:
        raise ConfigError(f"{where}: not a JSON object with a {_key!r} string (keys: {', '.join(sorted(record)[:8])}); "
                          f"--key names the text field")
    if not isinstance(record[_key], str):
        raise ConfigError(f"{where}: field {_key!r} is {type(record[_key]).__name__}, not a string")
    if problem := text_problem(record[_key], raw):  # only the field read: other fields may hold anything
        raise ConfigError(f"{where}: field {_key!r} {problem}; fix or drop the line")
    return record[_key]


def _tokenize(batch: tuple[str, int, list[bytes]]) -> list[np.ndarray]:
    path, first_line, lines = batch
    texts = [t for n, raw in enumerate(lines, start=first_line) if (t := _text(raw, f"{path}:{n}")) is not None]
    return [_with_eod(doc) for doc in _tokenizer(texts)]


def _with_eod(doc: list[int]) -> np.ndarray:
    ids = np.empty(len(doc) + 1, dtype=np.int32)  # no intermediate list: a long document is millions of ids
    ids[:-1] = doc
    ids[-1] = _eod
    return ids


# ---------------------------------------------------------------- reading (in the parent)


def _batches(paths: list[Path], max_line_bytes: int) -> Iterator[tuple[str, int, list[bytes]]]:
    """Consecutive lines (blank ones too, so line numbers stay exact) of at most BATCH_LINES / BATCH_BYTES."""
    for path in paths:
        batch: list[bytes] = []
        first, size = 1, 0
        for n, line in raw_lines(path, max_line_bytes):
            batch.append(line)
            size += len(line)
            if len(batch) == BATCH_LINES or size >= BATCH_BYTES:
                yield str(path), first, batch
                batch, first, size = [], n + 1, 0
        if batch:
            yield str(path), first, batch


def _tokenized(batches: Iterable[tuple[str, int, list[bytes]]], workers: int, tokenizer_dir: str,
               pipeline: str | None, key: str, eod: int) -> Iterator[list[np.ndarray]]:
    """Tokenized batches in input order; with several workers at most two batches each in flight."""
    if workers == 1:  # no pool: the same code in this process
        _init_worker(tokenizer_dir, pipeline, key, eod)
        yield from map(_tokenize, batches)
        return
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_dir, pipeline, key, eod)) as pool:
        pending: deque[Any] = deque()
        for batch in batches:
            pending.append(pool.apply_async(_tokenize, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---------------------------------------------------------------- writing


class IndexedWriter:
    """A .bin written as documents arrive (one sequence per document) and its .idx at the end."""

    def __init__(self, bin_path: Path, dtype: np.dtype) -> None:
        self.dtype = np.dtype(dtype)
        self.lengths = array("i")  # int32 per document, as Megatron stores them
        self.file = open(bin_path, "wb")

    def add(self, doc: np.ndarray) -> None:
        self.file.write(doc.astype(self.dtype, copy=False).tobytes())
        self.lengths.append(doc.size)

    def finalize(self, idx_path: Path) -> None:
        self.file.close()
        lengths = np.frombuffer(self.lengths, dtype=np.int32) if self.lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path, "wb") as f:
            f.write(INDEX_HEADER + struct.pack("<Q", 1) + struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(lengths) + 1))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())  # document i is sequence i

    def close(self) -> None:
        self.file.close()


def is_sidecar(path: Path) -> bool:
    """True for a PREFIX.json that preprocess wrote (the marker that --force may replace the prefix)."""
    try:
        if not path.is_file() or path.stat().st_size > 1024**2:
            return False
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # ValueError: not UTF-8, not JSON, an integer too long to read
        return False
    return isinstance(meta, dict) and all(k in meta for k in SIDECAR_KEYS)


def output_paths(prefix: str) -> dict[str, Path]:
    return {ext: Path(prefix + ext) for ext in EXTS}


def check_outputs(out: dict[str, Path], inputs: list[Path], tokenizer_dir: Path, force: bool) -> None:
    """Never an input, never inside the tokenizer, and --force only over an earlier preprocess output."""
    protected = {p.resolve() for p in inputs}
    tok = tokenizer_dir.resolve()
    for p in out.values():
        if p.resolve() in protected:
            raise ConfigError(f"output {p} is an input file; choose another --output-prefix (--force never "
                              f"replaces an input)")
        if p.resolve().is_relative_to(tok):
            raise ConfigError(f"output {p} lies inside the tokenizer directory {tokenizer_dir}; choose another "
                              f"--output-prefix")
        if p.is_dir():
            raise ConfigError(f"output {p} is a directory; choose another --output-prefix")
    existing = [str(p) for p in out.values() if p.exists() or p.is_symlink()]
    if not existing:
        return
    if not force:
        raise ConfigError(f"output exists: {', '.join(existing)}; pass --force to replace it")
    if not is_sidecar(out[".json"]):
        raise ConfigError(f"output exists: {', '.join(existing)}, and {out['.json']} is not a side-car written by "
                          f"`mcorekit data preprocess`; --force replaces only an earlier preprocess output: remove "
                          f"the files yourself or choose another --output-prefix")


def remove_stale_temporaries(out: dict[str, Path], inputs: list[Path]) -> None:
    """Remove `PREFIX.EXT.tmp-PID` files of runs that no longer exist (and the pid-less `.tmp` of older
    versions): a killed run leaves them, and nothing else would."""
    from mcorekit.outputs import pid_alive

    protected = {p.resolve() for p in inputs}
    for p in out.values():
        for leftover in p.parent.glob(f"{glob.escape(p.name)}.tmp*"):
            suffix = leftover.name[len(p.name):]
            pid = suffix[len(".tmp-"):] if suffix.startswith(".tmp-") else ""
            dead = suffix == ".tmp" or (pid.isdigit() and not pid_alive(int(pid)))
            if dead and leftover.is_file() and leftover.resolve() not in protected:
                leftover.unlink(missing_ok=True)


def load_tokenizer(tokenizer_dir: str) -> tuple[Any, str | None]:
    """The HF tokenizer and the pipeline its workers run (_encoder), checked to encode as transformers does: the
    data must hold the ids training's tokenizer (AutoTokenizer, for SFT, DPO and generation too) gives."""
    from transformers import AutoTokenizer

    if not Path(tokenizer_dir).is_dir():
        raise ConfigError(f"tokenizer not found: {tokenizer_dir} (an HF tokenizer directory)")
    if not any((Path(tokenizer_dir) / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"{tokenizer_dir}: not an HF tokenizer directory (none of {', '.join(TOKENIZER_FILES)}); "
                          f"pass the folder that save_pretrained wrote the tokenizer to")
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)  # never the folder's own code
        pipeline = tok.backend_tokenizer.to_str() if tok.is_fast else None
        encode = _encoder(tokenizer_dir, pipeline)  # what the workers load: fail here, not in a worker
    except Exception as e:  # noqa: BLE001  (transformers/tokenizers raise many types for a broken directory)
        raise ConfigError(f"{tokenizer_dir}: not a usable HF tokenizer directory ({first_line(e)})") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer {tokenizer_dir} has no eos token to end documents with; set eos_token in its config")
    probe = "Hello, world! 12 + 3 = 15.\n" + " ".join(t.content for t in tok.added_tokens_decoder.values())
    if (got := encode([probe])[0]) != (want := tok(probe, add_special_tokens=False)["input_ids"]):
        raise ConfigError(f"{tokenizer_dir}: its tokenizers pipeline encodes {probe!r} as {got[:12]}..., transformers "
                          f"as {want[:12]}...; the data would not hold the ids training reads: save the tokenizer "
                          f"again with transformers' save_pretrained")
    return tok, pipeline


def preprocess(inputs: list[str], tokenizer_dir: str, output_prefix: str, key: str = "text", workers: int | None = None,
               force: bool = False, quiet: bool = False, max_line_mb: int = MAX_LINE_MB) -> PreprocessSummary:
    from tqdm import tqdm

    if workers is not None and workers < 1:
        raise ConfigError(f"workers={workers}: must be >= 1")
    cores = len(os.sched_getaffinity(0))  # the CPUs this process may run on (a Slurm job's cpuset), not the machine's
    if workers is not None and workers > cores:  # each worker holds a tokenizer: more than the cores only adds memory
        raise ConfigError(f"workers={workers}: more than the {cores} cores this process may use; give at most {cores}")
    if max_line_mb < 1:
        raise ConfigError(f"max_line_mb={max_line_mb}: must be >= 1")
    paths = [Path(p) for p in inputs]
    if folders := [str(p) for p in paths if p.is_dir()]:
        raise ConfigError(f"input {', '.join(folders)} is a folder; give its .jsonl files (e.g. {folders[0]}/*.jsonl)")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"input not found: {', '.join(missing)}")
    if not Path(output_prefix).name or output_prefix.endswith(("/", os.sep)):
        raise ConfigError(f"--output-prefix {output_prefix!r} names a folder; add a file stem (e.g. {output_prefix}corpus "
                          f"writes corpus.bin/.idx/.json there)")
    out = output_paths(output_prefix)
    check_outputs(out, paths, Path(tokenizer_dir), force)
    tok, pipeline = load_tokenizer(tokenizer_dir)
    vocab = len(tok)
    dtype = np.dtype(np.uint16 if vocab < 65500 else np.int32)  # Megatron's DType.optimal_dtype
    try:
        out[".bin"].parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {out['.bin'].parent}: {e.strerror}") from None
    remove_stale_temporaries(out, paths)
    tmp = {ext: p.with_name(f"{p.name}.tmp-{os.getpid()}") for ext, p in out.items()}
    workers = workers or cores
    start = time.perf_counter()
    docs = tokens = empty = 0
    writer = None
    try:
        writer = IndexedWriter(tmp[".bin"], dtype)
        read = [0]  # input bytes handed to the tokenizers so far: the bar's progress against the inputs' size

        def counted(batches: Iterator[tuple[str, int, list[bytes]]]) -> Iterator[tuple[str, int, list[bytes]]]:
            for batch in batches:
                read[0] += sum(len(line) + 1 for line in batch[2])
                yield batch

        total = sum(p.stat().st_size for p in paths)
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet, desc="tokenizing") as bar:
            batches = counted(_batches(paths, max_line_mb * 1024**2))
            for batch in _tokenized(batches, workers, tokenizer_dir, pipeline, key, tok.eos_token_id):
                for doc in batch:
                    writer.add(doc)
                tokens += sum(d.size for d in batch)
                empty += sum(d.size == 1 for d in batch)
                docs += len(batch)
                bar.update(min(read[0], total) - bar.n)
                bar.set_postfix(tokens=tokens, refresh=False)
            bar.update(total - bar.n)
        if docs == 0:
            raise ConfigError(f"no documents in {', '.join(inputs)}")
        writer.finalize(tmp[".idx"])
        tmp[".json"].write_text(json.dumps({"tokenizer": str(tokenizer_dir), "eod": int(tok.eos_token_id),
                                            "vocab_size": vocab, "documents": docs, "tokens": tokens, "key": key}))
        out[".idx"].unlink(missing_ok=True)  # the old output is incomplete from here on, never mixed with the new
        for ext in (".bin", ".json", ".idx"):  # the .idx last: a prefix with an .idx is complete
            os.replace(tmp[ext], out[ext])
    except OSError as e:  # a full or read-only disk: one line, nothing left behind
        _discard(writer, tmp.values())
        ours = e.filename is None or Path(e.filename) in tmp.values() or Path(e.filename) in out.values()
        where = f"cannot write {output_prefix}.{{bin,idx,json}}" if ours else str(e.filename)
        raise ConfigError(f"{where}: {e.strerror or e}") from None
    except BaseException:
        _discard(writer, tmp.values())
        raise
    return PreprocessSummary(docs, tokens, time.perf_counter() - start, workers, empty)


def _discard(writer: IndexedWriter | None, paths: Iterable[Path]) -> None:
    """Close and remove this run's temporaries (errors ignored: the first error is the one to report)."""
    if writer is not None:
        try:
            writer.close()
        except OSError:
            pass
    for p in paths:
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass
