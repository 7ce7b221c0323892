"""train/generate.py's mode switch on CPU, without a model: what generation_mode leaves as it found it. (Generation
itself: tests/test_grpo.py through tests/grpo_cpu_driver.py.)"""

from __future__ import annotations

import pytest
import torch

from mcorekit.train.generate import generation_mode, random_states_kept


def test_generation_leaves_the_random_states_and_the_mode_as_they_were() -> None:
    """Whatever generation draws or reseeds, the training's next draws are those it would have made without it."""
    chunk = torch.nn.Linear(2, 2)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    with generation_mode([chunk], inference=False):
        assert not chunk.training and not torch.is_grad_enabled()
        torch.manual_seed(99)
        torch.rand(10)
    assert torch.equal(torch.rand(4), expected) and chunk.training and torch.is_grad_enabled()


def test_random_states_come_back_after_an_error() -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    with pytest.raises(RuntimeError, match="inside"):
        with random_states_kept():
            torch.rand(50)
            raise RuntimeError("inside")
    assert torch.equal(torch.rand(3), expected)
