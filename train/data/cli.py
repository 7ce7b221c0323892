"""`mcorekit data`: prepare training data.

  mcorekit data preprocess INPUT.jsonl [...] --tokenizer HF_DIR --output-prefix PREFIX [--key text] [--workers N] [--max-line-mb N] [--force]
"""

from __future__ import annotations

import argparse

from mcorekit.cli import HelpFormatter, dispatch
from mcorekit.options import positive_int




def _preprocess(argv: list[str]) -> int:
    from mcorekit.train.data.preprocess import MAX_LINE_MB, preprocess

    p = argparse.ArgumentParser(allow_abbrev=False, prog="mcorekit data preprocess", formatter_class=HelpFormatter,
                                description="jsonl (one document per line) -> Megatron .bin/.idx with an end-of-document "
                                "token after each document, tokenized on all cores. Use the prefix in data.paths.")
    p.add_argument("inputs", nargs="+", help="jsonl files, one document per line")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer directory, or a Hub model ID (org/name)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx and PREFIX.json")
    p.add_argument("--key", default="text", help="the JSON field holding the text (default: text)")
    p.add_argument("--workers", type=positive_int, default=None, help="tokenizer processes (default: all cores)")
    p.add_argument("--max-line-mb", type=positive_int, default=MAX_LINE_MB,
                   help=f"refuse lines (documents) longer than this many MB (default {MAX_LINE_MB}; tokenizing a line "
                   "takes about 70x its size in memory, per worker)")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier output of this command (recognised by its PREFIX.json); never an input")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    from mcorekit.hub import model_dir

    tokenizer = str(model_dir(a.tokenizer, "tokenizer", "--tokenizer"))  # org/name: the Hub snapshot's tokenizer files
    s = preprocess(a.inputs, tokenizer, a.output_prefix, a.key, a.workers, a.force, a.quiet, a.max_line_mb)
    print(s.line(a.output_prefix))
    return 0


def main(command: str, argv: list[str]) -> int:
    return dispatch("mcorekit data", __doc__, {"preprocess": _preprocess}, argv,
                    {"preprocess": "jsonl -> Megatron .bin/.idx (pretraining data for data.kind=indexed)"})
