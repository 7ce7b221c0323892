"""Mock data: deterministic, learnable token sequences keyed by (seed, global sample index), so a resumed run
continues the exact data order. Each sequence is an arithmetic progression modulo the vocabulary (random start
and stride), so a model can learn it and the loss visibly falls. Indexed datasets and SFT packing are not built yet."""

from __future__ import annotations

from typing import Iterator

import torch


def mock_batches(seed: int, vocab: int, seq_len: int, micro_batch: int, first_sample: int,
                 dp_rank: int, dp_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Yields this data-parallel rank's micro-batches, starting at global sample `first_sample`."""
    sample = first_sample + dp_rank * micro_batch
    while True:
        rows = []
        for i in range(micro_batch):
            g = torch.Generator().manual_seed(seed * 1_000_003 + sample + i)
            start, stride = torch.randint(0, vocab, (2,), generator=g).tolist()
            rows.append((start + (stride % 16 + 1) * torch.arange(seq_len + 1)) % vocab)
        seq = torch.stack(rows)
        yield {
            "tokens": seq[:, :-1].cuda(non_blocking=True),
            "labels": seq[:, 1:].cuda(non_blocking=True),
            "loss_mask": torch.ones(micro_batch, seq_len, device="cuda"),
            "position_ids": torch.arange(seq_len, device="cuda").unsqueeze(0).expand(micro_batch, -1),
        }
        sample += micro_batch * dp_size
