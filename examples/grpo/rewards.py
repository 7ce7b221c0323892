"""A reward read from a file (grpo.rewards: `examples/grpo/rewards.py:digits_only`, relative to the working
directory): any `function(prompt, completion, **fields) -> float` works, fields being the prompt record's other
keys (here `answer`)."""

from __future__ import annotations

from typing import Any


def digits_only(prompt: str, completion: str, **fields: Any) -> float:
    """1.0 when the completion is a number and nothing else (the format the task asks for)."""
    text = completion.strip()
    return float(bool(text) and text.isdigit())
