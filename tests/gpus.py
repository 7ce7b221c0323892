"""How many GPUs this machine has, and the mark for tests that need two (the nvidia-h200-x2 device kind)."""

from __future__ import annotations

import pytest


def gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


needs_two = pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs (device kind nvidia-h200-x2 or larger)")
