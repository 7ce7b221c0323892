"""A reward read from a file (grpo.rewards: `examples/grpo/rewards.py:digits_only`, relative to the working
directory): any `function(prompt, completion, **fields) -> float` works, fields being the prompt record's other
keys (here `answer`)."""

from __future__ import annotations

from typing import Any


def digits_only(prompt: str, completion: str, **fields: Any) -> float:
    """1.0 when the completion is a number and nothing else (the format the task asks for)."""
    text = completion.strip()
    return float(bool(text) and text.isdigit())


def digits_correct(prompt: str, completion: str, answer: Any = None, **fields: Any) -> float:
    """Partial credit: the share of digit positions the completion has right, compared position by position from
    its first character (the example writes sums units digit first, so digit k is the same place value in both),
    over the longer of the two (a missing or extra digit costs); 0.0 when the completion is not a number. Near
    misses then score above wild guesses, which gives a group of mostly wrong answers something to learn from."""
    want, got = str(answer), completion.strip()
    if answer is None or not got.isdigit():
        return 0.0
    right = sum(a == b for a, b in zip(want, got))
    return right / max(len(want), len(got))
