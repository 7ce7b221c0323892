"""The HF tokenizer named by data.tokenizer, loaded once the same way for every data kind that reads text (chat
jsonl, preference pairs, the indexed data's eod): a broken directory, a vocabulary larger than the model's or no eos
token is a one-line ConfigError before anything is built. Beside it, what SFT and DPO share about turning text into
tokens: the ids the tokenizer puts before a text (BOS), and where a chat template's response starts."""

from __future__ import annotations

from typing import Any

from mcorekit.errors import ConfigError, first_line


def load_tokenizer(tokenizer_dir: str, vocab_size: int | None = None) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)  # never its own code
    except Exception as e:  # noqa: BLE001  (transformers raises many types for a broken directory)
        raise ConfigError(f"{tokenizer_dir}: not a usable HF tokenizer directory (data.tokenizer): "
                          f"{first_line(e)}") from None
    if vocab_size is not None and len(tok) > vocab_size:
        raise ConfigError(f"tokenizer {tokenizer_dir} has {len(tok)} tokens but the model's vocabulary is {vocab_size}")
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer {tokenizer_dir} has no eos token, so sequences have no end marker")
    return tok


def bos_ids(tok: Any) -> list[int]:
    """The ids the tokenizer's defaults put before a text (Llama's BOS; none for Qwen2): a probe encoded with and
    without special tokens, so the tokenizer's own post-processor decides, as it does for TRL and HF inference.
    What the defaults put after a text (an EOS) is not taken: the data ends each response itself."""
    bare = list(tok("a", add_special_tokens=False)["input_ids"])
    full = list(tok("a")["input_ids"])
    if bare:
        for i in range(len(full) - len(bare) + 1):
            if full[i:i + len(bare)] == bare:
                return full[:i]
    raise ConfigError(f"tokenizer {tok.name_or_path}: the special tokens it adds around a text cannot be told apart "
                      f"from the text ('a' is {full} with them, {bare} without)")


def generation_prompt_problem(head: str, text: str) -> str | None:
    """Why a response cannot be located in `text` (a conversation rendered by the chat template, ending with
    assistant message(s)) after `head` (the conversation before them rendered with the generation prompt); None
    when `text` starts with `head`. A template whose generation prompt is not the start of the assistant turn it
    renders (DeepSeek-R1 distills open '<think>\\n' in the generation prompt only) is refused: a mask starting after
    `head` would leave the first tokens of the response out, and one starting where the two differ would train the
    model after a context it never sees at inference."""
    if text.startswith(head):
        return None
    same = next((i for i, (a, b) in enumerate(zip(head, text)) if a != b), min(len(head), len(text)))
    return (f"the tokenizer's chat template does not start the assistant turn with its generation prompt (after "
            f"{head[max(0, same - 30):same]!r} the generation prompt has {head[same:same + 30]!r} where the rendered "
            f"turn has {text[same:same + 30]!r}), so the response and its loss mask cannot be located; give data."
            f"tokenizer a chat template (chat_template.jinja) whose assistant turns start with its generation prompt, "
            f"or the data as plain text")
