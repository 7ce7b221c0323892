"""argparse `type=` checks for every command's numeric options (a value out of range) and path or name options
(an empty value): a usage error (exit 2) at parse time, before anything is read, written or submitted."""

from __future__ import annotations

import argparse
import math
from typing import Callable


# int32's largest: beyond any count, size or limit a command or a setting takes. Slurm's job fields and the sizes
# Megatron-Core and torch hand to C++/CUDA are 32-bit; a product of two (train_iters x global_batch_size) fits int64.
MAX_INT = 2**31 - 1


def int_at_least(low: int) -> Callable[[str], int]:
    """A whole number from low to MAX_INT, e.g. `type=int_at_least(1)` for counts and limits."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if value > MAX_INT:
            shown = text if len(text) <= 20 else text[:20] + "..."
            raise argparse.ArgumentTypeError(f"must be <= {MAX_INT:,}, got {shown}")
        return value

    return parse


def positive_float(text: str) -> float:
    """A finite number > 0 (sizes in GB, seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


count = positive_int = int_at_least(1)  # nodes, GPUs, parallel sizes, workers: at least one
index = int_at_least(0)  # ranks and task numbers start at 0


def nonempty(text: str) -> str:
    """A file, folder or profile name: an empty one would silently mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (it would mean the current directory); give a path or a name")
    return text
