"""Supervised fine-tuning data from jsonl: chat conversations or prompt/response pairs, tokenized with an HF
tokenizer, with a loss mask that keeps only what the model should learn to say.

Accepted lines:
  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}  (the tokenizer's chat template)
  {"prompt": "...", "response": "..."}   (also "instruction"/"input"/"output": prompt = instruction + input)
Loss mask: 1 on assistant turns (the template's text of each assistant message after the generation prompt,
including its end-of-turn token) or on the response and the eos token after it; 0 elsewhere.
A prompt/response example starts with what the tokenizer's defaults put before a text (Llama's BOS; nothing for
Qwen2), as TRL and HF inference tokenize a prompt; chat text holds what its template puts. A chat template whose
generation prompt is not the start of the assistant turn it renders is refused (tokenizer.generation_prompt_problem).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mcorekit.errors import ConfigError
from mcorekit.train.data.jsonl import records, refuse_lone_surrogates
from mcorekit.train.data.packing import EpochOrder, Example, first_fit_decreasing, pack, pad_one
from mcorekit.train.data.tokenizer import bos_ids, generation_prompt_problem, load_tokenizer

log = logging.getLogger("mcorekit.train")


def _read(path: Path) -> list[tuple[int, dict[str, Any]]]:
    if not path.is_file():
        raise ConfigError(f"SFT data not found: {path}")
    return list(records(path))


def tokenize_chat(tok: Any, messages: list[dict[str, str]]) -> Example:
    """Render the whole conversation once; assistant spans are found from the renderings of its prefixes (the
    template must render a prefix of the conversation as a prefix of the text, which chat templates do), each
    starting after the generation prompt, which must be where the template's assistant turn starts."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prefix = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(prefix):
            raise ConfigError("the tokenizer's chat template does not render conversations prefix by prefix; "
                              "loss masks cannot be placed")
        head = (tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i
                else _before_first_turn(tok, m))
        problem = generation_prompt_problem(head, text)
        if problem:
            raise ConfigError(problem)
        spans.append((len(head), len(prefix)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)  # the template holds its own BOS
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return Example(list(enc["input_ids"]), mask)


def _before_first_turn(tok: Any, message: dict[str, str]) -> str:
    """What the template renders before a conversation's opening assistant turn's text (a default system prompt, the
    role header): transformers renders no empty conversation to take it from, so the turn is rendered with a marker
    for its content. The mask starts after it, as after the generation prompt for later turns."""
    marker = "MCOREKITRESPONSEMARKER"
    rendered = tok.apply_chat_template([{**message, "content": marker}], tokenize=False)
    if marker not in rendered:
        raise ConfigError("the conversation opens with an assistant turn whose start the tokenizer's chat template "
                          "does not show; drop that turn, or start the conversation with a user or system turn")
    return rendered[:rendered.index(marker)]


def tokenize_pair(tok: Any, prompt: str, response: str, bos: list[int]) -> Example:
    """`bos` (tokenizer.bos_ids) once before the prompt, as the tokenizer's defaults put it at inference."""
    p = bos + tok(prompt, add_special_tokens=False)["input_ids"]
    r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return Example(list(p) + list(r), [0] * len(p) + [1] * len(r))


TEXT_FIELDS = ("messages", "prompt", "response", "instruction", "input", "output")


def tokenize_record(tok: Any, record: dict[str, Any], where: str, bos: list[int]) -> Example:
    refuse_lone_surrogates([record.get(k) for k in TEXT_FIELDS], where)
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ConfigError(f"{where}: 'messages' must be a list of {{\"role\": str, \"content\": str}} objects")
        if not tok.chat_template:
            raise ConfigError(f"{where}: chat data needs a tokenizer with a chat template")
        try:
            return tokenize_chat(tok, messages)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        except Exception as e:  # noqa: BLE001  (templates raise their own errors, e.g. "roles must alternate")
            lines = str(e).strip().splitlines()
            raise ConfigError(f"{where}: the tokenizer's chat template failed on this conversation: "
                              f"{lines[0] if lines else type(e).__name__}") from None
    for keys in (("prompt", "response"), ("instruction", "output", "input")):  # the first pair present is read
        if all(k in record for k in keys[:2]):
            wrong = [k for k in keys if k in record and not isinstance(record[k], str)
                     and not (k == "input" and record[k] is None)]
            if wrong:  # str() made text of them: "None" -> "5" was trained on
                raise ConfigError(f"{where}: {', '.join(repr(k) for k in wrong)} must be text, got "
                                  f"{', '.join(type(record[k]).__name__ for k in wrong)}")
            break
    if "prompt" in record and "response" in record:
        return tokenize_pair(tok, record["prompt"], record["response"], bos)
    if "instruction" in record and "output" in record:
        prompt = record["instruction"] + ("\n\n" + record["input"] if record.get("input") else "")
        return tokenize_pair(tok, prompt + "\n\n", record["output"], bos)
    raise ConfigError(f"{where}: expected 'messages', 'prompt'+'response' or 'instruction'+'output' "
                      f"(got keys {sorted(record)[:8]})")


class SFTDataset:
    """Tokenized examples, optionally packed; sample i of epoch e is a seeded permutation's pick, so the order
    is reproducible and a resumed run continues it."""

    def __init__(self, paths: list[str], tokenizer_dir: str, seq_length: int, seed: int, packing: bool,
                 vocab_size: int) -> None:
        tok = load_tokenizer(tokenizer_dir, vocab_size)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        bos = bos_ids(tok)
        examples, read, truncated, nothing, cut_off, headless = [], 0, 0, 0, 0, 0
        roles: set[str] = set()
        for path in paths:
            for n, record in _read(Path(path)):
                ex, read = tokenize_record(tok, record, f"{path}:{n}", bos), read + 1
                headless += bool(ex.mask[:1] == [1])  # nothing before the response: its first token has no label
                if not sum(ex.mask[1:]):  # no assistant turn to learn from (roles other than "assistant"?)
                    nothing += 1
                    roles |= {m.get("role") for m in record.get("messages") or [] if isinstance(m, dict)}
                    continue
                if ex.positions > seq_length:
                    ex, truncated = Example(ex.ids[: seq_length + 1], ex.mask[: seq_length + 1]), truncated + 1
                    if not sum(ex.mask[1:]):  # the prompt alone fills seq_length
                        cut_off += 1
                        continue
                examples.append(ex)
        if nothing:
            log.warning("%d of %d SFT examples have no response to learn and were skipped%s", nothing, read,
                        f" (roles seen: {', '.join(sorted(map(str, roles)))}; the loss is on 'assistant' turns)"
                        if roles else "")
        if headless:
            log.warning("%d of %d SFT examples have nothing before their response (an empty prompt, and this "
                        "tokenizer puts no BOS before a text): the first token of each response is never learned",
                        headless, read)
        if truncated:
            log.warning("%d of %d SFT examples were longer than seq_length=%d and were truncated (%d of them kept no "
                        "response and were skipped)", truncated, read, seq_length, cut_off)
        if not examples:
            raise ConfigError(f"no usable SFT examples (with a response to learn) in {', '.join(paths)}")
        self.examples, self.seq_length, self.seed, self.packing = examples, seq_length, seed, packing
        self.bins = first_fit_decreasing([e.positions for e in examples], seq_length) if packing else \
            [[i] for i in range(len(examples))]
        self.order = EpochOrder(seed, len(self.bins))

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, Any]:
        members = [self.examples[j] for j in self.bins[self.order(index)]]
        if self.packing:
            return pack(members, self.seq_length, self.pad_id)
        return pad_one(members[0], self.seq_length, self.pad_id)
