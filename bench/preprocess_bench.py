"""Preprocessing throughput (jsonl -> .bin/.idx): `mcorekit data preprocess` with 1 and with all cores, next to
the obvious alternative (a plain loop calling the HF tokenizer one document at a time and writing the same
files), in one run.

    .venv/bin/python bench/preprocess_bench.py [--mb 40] [--workdir /tmp/mcorekit-preprocess-bench]

Builds a byte-level BPE tokenizer (32k vocabulary, trained offline on the generated text, as real LLM
tokenizers are) and a jsonl corpus of about --mb megabytes of word-like text, then times each method in its own
process. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

from results import fresh_dir, run_worker

NAIVE = r"""
import json, sys, time, numpy as np
from transformers import AutoTokenizer
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
src, tok_dir, prefix = sys.argv[1:4]
t = time.perf_counter()
tok = AutoTokenizer.from_pretrained(tok_dir)
builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(len(tok)))
tokens = 0
for line in open(src):
    ids = tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    builder.add_document(np.asarray(ids, dtype=np.int32), [len(ids)])
    tokens += len(ids)
builder.finalize(prefix + ".idx")
print("RESULT", json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t}))
"""
OURS = r"""
import json, sys
from mcorekit.train.data.preprocess import preprocess
s = preprocess([sys.argv[1]], sys.argv[2], sys.argv[3], workers=int(sys.argv[4]), quiet=True)
print("RESULT", json.dumps({"tokens": s.tokens, "seconds": s.seconds}))
"""


def make_corpus(path: Path, megabytes: int) -> None:
    rng = random.Random(0)
    syllables = ["ka", "ro", "mi", "te", "su", "na", "lo", "vi", "de", "pa", "shu", "gen", "tor", "el", "an"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(20000)]
    with open(path, "w") as f:
        written = 0
        while written < megabytes * 1_000_000:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(50, 800))) + "."
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)


def make_tokenizer(corpus: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = (json.loads(line)["text"] for _, line in zip(range(20000), open(corpus)))
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(out)


def measure(code: str, *args: str) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}  # the naive loop: one process, one thread
    payload, output = run_worker(code, *args, env=env)
    if payload is None:
        raise SystemExit(output)
    return json.loads(payload)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=40)
    p.add_argument("--workdir", default="/tmp/mcorekit-preprocess-bench")
    a = p.parse_args()
    work = fresh_dir(a.workdir)
    corpus, tok = work / "corpus.jsonl", work / "tok"
    make_corpus(corpus, a.mb)
    make_tokenizer(corpus, tok)
    size = corpus.stat().st_size / 1e6
    rows = []
    naive = measure(NAIVE, str(corpus), str(tok), str(work / "naive"))
    rows.append(("naive loop (HF tokenizer, one document at a time)", naive))
    cores = len(os.sched_getaffinity(0))  # what preprocess allows at most
    for workers in sorted({1, cores}):
        rows.append((f"mcorekit data preprocess, {workers} worker{'s' if workers > 1 else ''}",
                     measure(OURS, str(corpus), str(tok), str(work / f"ours{workers}"), str(workers))))
    same = (work / f"ours{cores}.bin").read_bytes() == (work / "naive.bin").read_bytes()
    print(f"corpus {size:.0f} MB, {naive['tokens']} tokens, byte-level BPE 32k; {cores} cores; "
          f"outputs identical to the naive loop: {same}")
    print("| method | seconds | MB/s | tokens/s | speed-up |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['seconds']:.1f} | {size / r['seconds']:.1f} | {r['tokens'] / r['seconds'] / 1e3:.0f}k | "
              f"{naive['seconds'] / r['seconds']:.2f}x |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
