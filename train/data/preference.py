"""Preference data for DPO from jsonl: each line a prompt with a chosen and a rejected response, tokenized with an
HF tokenizer into two sequences that share the prompt's tokens, with a loss mask on the response tokens only.

Accepted lines:
  {"prompt": "...", "chosen": "...", "rejected": "..."}     plain text: the tokenizer's BOS (what its defaults put
      before a text, as TRL and HF inference tokenize a prompt; nothing for Qwen2) + prompt tokens, then response
      tokens + eos
  {"prompt": [{"role": ..., "content": ...}, ...],           chat: the tokenizer's chat template; the prompt is
   "chosen": [{"role": "assistant", "content": ...}] | {"role": "assistant", ...} | "...", "rejected": (same)}
      rendered with the generation prompt, the response is what the template adds for the assistant message(s)
      (its end-of-turn tokens included), as TRL renders conversational preference data; a template whose
      generation prompt is not the start of the assistant turn it renders is refused, as for SFT
Loss mask: 1 on the response tokens (and the eos after a plain response); 0 on the prompt and the padding.

Truncation (counted and logged): when a pair does not fit, its prompt is cut from the LEFT (the end of the prompt,
next to the response, is kept; the same cut for both sequences, so they still share it), after the BOS, which is
kept. Responses are never cut: a pair whose longer response does not fit with one prompt token (besides the BOS)
is left out. Without packing each sequence must fit data.seq_length; with packing both sequences of a pair go into
one packed row, so together they must fit it.

A sample is a whole pair (a packed row of whole pairs with data.packing); sample g of epoch e is a seeded
permutation's pick, so the order is reproducible and a resumed run continues it (like the SFT data).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from mcorekit.errors import ConfigError
from mcorekit.train.data.jsonl import records, refuse_lone_surrogates
from mcorekit.train.data.packing import EpochOrder, Example, first_fit_decreasing, pack, pad_one
from mcorekit.train.data.tokenizer import bos_ids, generation_prompt_problem, load_tokenizer

log = logging.getLogger("mcorekit.train")
TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids")  # per-token tensors, one row per sequence


def _messages(value: Any, what: str, where: str) -> list[dict[str, str]]:
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                           and isinstance(m.get("content"), str) for m in value):
        raise ConfigError(f"{where}: '{what}' must be a non-empty list of {{\"role\": str, \"content\": str}} objects")
    return value


def tokenize_preference(tok: Any, record: dict[str, Any], where: str,
                        bos: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen response ids, rejected response ids) of one jsonl record; `bos` (tokenizer.bos_ids)
    starts a plain-text prompt."""
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
    if missing:
        raise ConfigError(f"{where}: a preference pair needs 'prompt', 'chosen' and 'rejected' (missing "
                          f"{', '.join(repr(k) for k in missing)}; got keys {sorted(record)[:8]})")
    refuse_lone_surrogates([record[k] for k in ("prompt", "chosen", "rejected")], where)
    prompt = record["prompt"]
    if isinstance(prompt, str):
        for key in ("chosen", "rejected"):
            if not isinstance(record[key], str):
                raise ConfigError(f"{where}: with a plain-text 'prompt', '{key}' must be a string too")
        p = bos + tok(prompt, add_special_tokens=False)["input_ids"]
        if not p:  # a response's first token would follow nothing: it could not be learned, and no cut makes it fit
            raise ConfigError(f"{where}: the prompt is empty (no tokens, and this tokenizer puts no BOS before a "
                              f"text); a preference pair needs a prompt its responses follow")
        return (list(p), *(list(tok(record[k], add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
                           for k in ("chosen", "rejected")))
    messages = _messages(prompt, "prompt", where)
    if not tok.chat_template:
        raise ConfigError(f"{where}: chat data needs a tokenizer with a chat template")
    try:
        head = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out = [list(tok(head, add_special_tokens=False)["input_ids"])]
        for key in ("chosen", "rejected"):
            value = record[key]
            response = ([{"role": "assistant", "content": value}] if isinstance(value, str)
                        else _messages(value, key, where))
            if any(m["role"] != "assistant" for m in response):
                raise ConfigError(f"{where}: '{key}' must hold assistant message(s) only")
            text = tok.apply_chat_template(messages + response, tokenize=False)
            problem = generation_prompt_problem(head, text)
            if problem:
                raise ConfigError(f"{where}: {problem}")
            out.append(list(tok(text[len(head):], add_special_tokens=False)["input_ids"]))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  (templates raise their own errors, e.g. "roles must alternate")
        lines = str(e).strip().splitlines()
        raise ConfigError(f"{where}: the tokenizer's chat template failed on this pair: "
                          f"{lines[0] if lines else type(e).__name__}") from None
    if not out[1] or not out[2]:
        raise ConfigError(f"{where}: an empty response after rendering the chat template")
    return out[0], out[1], out[2]


def fit_pair(prompt: list[int], chosen: list[int], rejected: list[int], seq_length: int, packing: bool,
             keep_first: int = 0) -> tuple[Example, Example] | None:
    """The pair's two sequences, the prompt cut from the left after its first `keep_first` tokens (the BOS) as far
    as needed to fit (None when even one more prompt token is too many). A sequence of n tokens takes n - 1
    positions (inputs t0..t(n-2), labels t1..t(n-1))."""
    long_r = max(len(chosen), len(rejected))
    if packing:  # both sequences in one row: (p + c - 1) + (p + r - 1) <= seq_length
        keep = (seq_length + 2 - len(chosen) - len(rejected)) // 2
    else:  # each sequence alone: p + r - 1 <= seq_length
        keep = seq_length + 1 - long_r
    keep = min(keep, len(prompt))
    if keep < 1 or (keep < len(prompt) and keep <= keep_first):
        return None
    p = prompt[:keep_first] + prompt[len(prompt) - keep + keep_first:]  # the whole prompt when it fits
    return (Example(p + chosen, [0] * len(p) + [1] * len(chosen)),
            Example(p + rejected, [0] * len(p) + [1] * len(rejected)))


class PreferenceDataset:
    """Tokenized pairs (pair i = line order over data.paths, pairs left out skipped), optionally packed.

    `reference`, when set (precomputed reference log-probs, [pairs, 2]: chosen, rejected), is attached to every
    sample by pair index, so it is read back by global sample number like everything else."""

    def __init__(self, paths: list[str], tokenizer_dir: str, seq_length: int, seed: int, packing: bool,
                 vocab_size: int) -> None:
        tok = load_tokenizer(tokenizer_dir, vocab_size)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        bos = bos_ids(tok)
        pairs: list[tuple[Example, Example]] = []
        lines, truncated, dropped, same = 0, 0, 0, []
        for path in paths:
            if not Path(path).is_file():
                raise ConfigError(f"preference data not found: {path}")
            for n, record in records(Path(path)):
                lines += 1
                prompt, chosen, rejected = tokenize_preference(tok, record, f"{path}:{n}", bos)
                if chosen == rejected:
                    same.append(f"{path}:{n}")
                kept = len(bos) if prompt[:len(bos)] == bos else 0  # a chat template's BOS too
                pair = fit_pair(prompt, chosen, rejected, seq_length, packing, kept)
                if pair is None:
                    dropped += 1
                    continue
                truncated += len(pair[0].ids) < len(prompt) + len(chosen)
                pairs.append(pair)
        if not pairs:
            raise ConfigError(f"no preference pair fits data.seq_length={seq_length} in {', '.join(paths)} "
                              f"({lines} lines read); raise data.seq_length")
        if truncated or dropped:
            log.warning("preference data: %d of %d pairs had their prompt cut from the left to fit seq_length=%d%s; "
                        "%d pairs were left out (a response too long even with one prompt token)", truncated, lines,
                        seq_length, " (both sequences of a pair in one packed row)" if packing else "", dropped)
        if same:  # kept: the data is the user's, but they dilute the loss mean every step
            log.warning("preference data: %d of %d pairs have the same chosen and rejected response (%s%s): their DPO "
                        "loss is log 2 with no gradient, yet they count in the loss and accuracy means; drop them from "
                        "the data", len(same), lines, ", ".join(same[:3]), ", ..." if len(same) > 3 else "")
        self.pairs, self.seq_length, self.seed, self.packing = pairs, seq_length, seed, packing
        self.truncated, self.dropped = truncated, dropped
        self.bins = first_fit_decreasing([c.positions + r.positions for c, r in pairs], seq_length) if packing \
            else [[i] for i in range(len(pairs))]
        self.reference: np.ndarray | None = None
        self.order = EpochOrder(seed, len(self.bins))

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.sample(self.order(index))

    def sample(self, b: int) -> dict[str, Any]:
        """Bin b (in data order, unshuffled): one pair, or with packing one row of whole pairs.
        Unpacked: {"chosen": {TOKEN_KEYS}, "rejected": {...}, "pair_ids"}. Packed: one row of TOKEN_KEYS with
        cu_seqlens/max_seqlen and seq_ids (chosen of the row's j-th pair: j, its rejected: n + j), "pair_ids".
        Both carry "ref_logps" ([chosen..., rejected...] of their pairs) once `reference` is set."""
        ids = self.bins[b]
        out: dict[str, Any] = {"pair_ids": torch.tensor(ids)}
        if self.packing:
            members = [ex for j in ids for ex in self.pairs[j]]  # c0, r0, c1, r1, ...
            out.update(pack(members, self.seq_length, self.pad_id))
            bounds, n = out["cu_seqlens"].tolist(), len(ids)
            seq = torch.zeros(self.seq_length, dtype=torch.long)  # padding: 0 (its loss mask is 0)
            for k, (a, e) in enumerate(zip(bounds[:2 * n], bounds[1:2 * n + 1])):
                seq[a:e] = k // 2 + (n if k % 2 else 0)
            out["seq_ids"] = seq
        else:
            chosen, rejected = self.pairs[ids[0]]
            out["chosen"] = pad_one(chosen, self.seq_length, self.pad_id)
            out["rejected"] = pad_one(rejected, self.seq_length, self.pad_id)
        if self.reference is not None:
            ref = torch.from_numpy(self.reference[ids])  # [n, 2]
            out["ref_logps"] = torch.cat([ref[:, 0], ref[:, 1]])
        return out


def collate(samples: list[dict[str, Any]], device: str = "cuda") -> dict[str, Any]:
    """One micro-batch of whole pairs. Unpacked, m pairs -> 2m rows: the m chosen sequences, then the m rejected
    ones (sequence k's log-prob is row k's); packed (one sample) -> one row, sequences told apart by seq_ids.
    Either way the micro-batch's sequences are [chosen of its pairs..., rejected of its pairs...]."""
    if "seq_ids" in samples[0]:  # packed: micro_batch_size is 1 (a rule in config/rules.py)
        (s,) = samples
        batch = {k: s[k].unsqueeze(0).to(device, non_blocking=True) for k in (*TOKEN_KEYS, "seq_ids")}
        batch.update(cu_seqlens=s["cu_seqlens"].to(device, non_blocking=True), max_seqlen=s["max_seqlen"])
    else:
        batch = {k: torch.stack([s[side][k] for side in ("chosen", "rejected") for s in samples]).to(
            device, non_blocking=True) for k in TOKEN_KEYS}
    batch["pair_ids"] = torch.cat([s["pair_ids"] for s in samples])  # stays on the host
    if "ref_logps" in samples[0]:
        refs = [s["ref_logps"].view(2, -1) for s in samples]
        batch["ref_logps"] = torch.cat([torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs])]).to(
            device, non_blocking=True)
    return batch


def pair_batches(dataset: PreferenceDataset, micro_batch: int, first_sample: int, dp_rank: int, dp_size: int,
                 device: str = "cuda") -> Iterator[dict[str, Any]]:
    """This data-parallel rank's micro-batches from global sample `first_sample` on (a sample is a pair, or a
    packed row of pairs): each global batch is consumed in order, rank r taking micro-batch slices r, r + dp, ...
    of it, as train/data.batches does for the other kinds."""
    sample = first_sample + dp_rank * micro_batch
    while True:
        yield collate([dataset[sample + i] for i in range(micro_batch)], device)
        sample += micro_batch * dp_size
