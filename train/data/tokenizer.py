"""The HF tokenizer named by data.tokenizer, loaded once the same way for every data kind that reads text (chat
jsonl, preference pairs, the indexed data's eod): a broken directory, a vocabulary larger than the model's or no eos
token is a one-line ConfigError before anything is built."""

from __future__ import annotations

from typing import Any

from mcorekit.errors import ConfigError


def load_tokenizer(tokenizer_dir: str, vocab_size: int | None = None) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)  # never its own code
    except Exception as e:  # noqa: BLE001  (transformers raises many types for a broken directory)
        lines = str(e).strip().splitlines()
        raise ConfigError(f"{tokenizer_dir}: not a usable HF tokenizer directory (data.tokenizer): "
                          f"{lines[0] if lines else type(e).__name__}") from None
    if vocab_size is not None and len(tok) > vocab_size:
        raise ConfigError(f"tokenizer {tokenizer_dir} has {len(tok)} tokens but the model's vocabulary is {vocab_size}")
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer {tokenizer_dir} has no eos token, so sequences have no end marker")
    return tok
