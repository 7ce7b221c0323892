"""Training data: mock sequences, Megatron indexed datasets (GPTDataset, blended), SFT jsonl with loss masks
and optional packing, and DPO preference pairs (preference.py). Every kind is a dataset indexed by *global sample
number*, so the loader can start at `step * global_batch_size` after a resume and continue the exact order."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from mcorekit.errors import ConfigError
from mcorekit.hub import model_dir

if TYPE_CHECKING:  # kept out of import time: preprocessing workers import this package and need no torch
    import torch

    from mcorekit.config.experiment import Experiment
    from mcorekit.models.spec import ModelSpec


def build_dataset(exp: Experiment, spec: ModelSpec, run_dir: Path, validation: bool = False) -> Any:
    """The training data, or with `validation` the held-out data (data.valid_paths; mock: another stream)."""
    d, s = exp.data, exp.schedule
    if d.kind == "mock":
        from mcorekit.train.data.mock import MockDataset

        return MockDataset(d.seed + 1 if validation else d.seed, spec.vocab_size, d.seq_length)
    paths, weights = (d.valid_paths, None) if validation else (d.paths, d.weights)
    if not paths:
        key = "data.valid_paths" if validation else "data.paths"
        raise ConfigError(f"data.kind={d.kind} needs {key} (indexed: .bin/.idx prefixes; sft, dpo: .jsonl files)")
    cache = Path(d.cache_dir or run_dir / "data_cache")
    tokenizer = d.tokenizer and str(model_dir(d.tokenizer, "tokenizer", "data.tokenizer"))  # org/name: from the Hub
    if d.kind == "indexed":
        from mcorekit.train.data.indexed import build_gpt_dataset

        samples = (s.eval_iters if validation else s.train_iters) * s.global_batch_size
        return build_gpt_dataset(paths, weights, d.seq_length, samples, d.seed, cache, tokenizer, spec.vocab_size)
    if d.kind == "dpo":
        from mcorekit.train.data.preference import PreferenceDataset

        if not d.tokenizer:
            raise ConfigError("data.kind=dpo needs data.tokenizer (an HF tokenizer directory; with a chat template for "
                              "chat pairs)")
        return PreferenceDataset(paths, tokenizer, d.seq_length, d.seed, packing=d.packing, vocab_size=spec.vocab_size)
    from mcorekit.train.data.sft import SFTDataset

    if not d.tokenizer:
        raise ConfigError("data.kind=sft needs data.tokenizer (an HF tokenizer directory with a chat template)")
    return SFTDataset(paths, tokenizer, d.seq_length, d.seed, packing=d.packing, vocab_size=spec.vocab_size)


def batches(dataset: Any, micro_batch: int, first_sample: int, dp_rank: int, dp_size: int,
            device: str = "cuda") -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches from global sample `first_sample` on: each global batch is
    consumed in order, rank r taking micro-batch slices r, r + dp, ... of it."""
    import torch

    sample = first_sample + dp_rank * micro_batch
    while True:
        rows = [dataset[sample + i] for i in range(micro_batch)]
        batch: dict[str, torch.Tensor] = {}
        for key in rows[0]:
            if key == "cu_seqlens":  # packed: micro_batch is 1 (a rule in config/rules.py), no batch dimension
                batch[key] = rows[0][key].to(device, non_blocking=True)
            elif key == "max_seqlen":
                batch[key] = rows[0][key]
            else:
                batch[key] = torch.stack([r[key] for r in rows]).to(device, non_blocking=True)
        yield batch
        sample += micro_batch * dp_size
