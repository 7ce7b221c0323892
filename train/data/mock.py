"""Mock data: deterministic, learnable token sequences keyed by (seed, global sample index). Each sequence is an
arithmetic progression modulo the vocabulary (random start and stride), so a model can learn it and the loss
visibly falls; benchmarks and smoke tests need no files."""

from __future__ import annotations

import torch


class MockDataset:
    def __init__(self, seed: int, vocab: int, seq_len: int) -> None:
        self.seed, self.vocab, self.seq_len = seed, vocab, seq_len

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start, stride = torch.randint(0, self.vocab, (2,), generator=g).tolist()
        seq = (start + (stride % 16 + 1) * torch.arange(self.seq_len + 1)) % self.vocab
        return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": torch.ones(self.seq_len),
                "position_ids": torch.arange(self.seq_len)}
