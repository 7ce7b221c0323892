"""The interface every training task implements (see tasks/__init__.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch

    from mcorekit.config.experiment import Experiment
    from mcorekit.models.spec import ModelSpec
    from mcorekit.train.build import Trainer

# What Megatron's pipeline schedule calls per micro-batch: (data iterator, model chunk) -> (output, loss function),
# where the loss function maps the output to (loss, {metric name: value}). The metrics are averaged over
# micro-batches and data-parallel ranks and logged under their names; "loss" is the one the loop guards and returns.
LossFunc = Callable[["torch.Tensor"], tuple["torch.Tensor", dict[str, "torch.Tensor"]]]


class Task:
    name = "task"
    metrics: tuple[str, ...] = ("loss",)  # the names its loss function reports, "loss" first
    rows_per_sample = 1  # sequences the model sees per sample of the batch sizes (DPO: 2, a chosen and a rejected)
    loop_rates = True  # the loop's tokens/s and MFU mean something (not when a step is mostly generation: GRPO)
    perplexity = False  # its loss is a next-token cross entropy, so exp(val loss) is a perplexity (lm, sft)

    def __init__(self, exp: Experiment, spec: ModelSpec, run_dir: Path) -> None:
        self.exp, self.spec, self.run_dir = exp, spec, run_dir
        # packed rows (SFT, DPO): the attention they compute, for MFU (counted where the task reads its steps)
        self.packed = PackedAttention(exp.data.seq_length) if exp.data.packing else None

    def dataset(self, validation: bool = False) -> Any:
        """The training data (or the held-out data): indexed by global sample number, so a resumed run continues
        the exact order."""
        raise NotImplementedError

    def batches(self, dataset: Any, first_sample: int, dp_rank: int, dp_size: int) -> Iterator[dict[str, Any]]:
        """This data-parallel rank's micro-batches from global sample `first_sample` on."""
        from mcorekit.train.data import batches

        return batches(dataset, self.exp.schedule.micro_batch_size, first_sample, dp_rank, dp_size)

    def forward_step(self, data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[torch.Tensor, LossFunc]:
        raise NotImplementedError

    def prepare_step(self, t: Trainer, data: list[Iterator[dict[str, Any]]],
                     num_microbatches: int) -> list[Iterator[dict[str, Any]]]:
        """The iterators (one per model chunk) the schedule reads for one step of `num_microbatches` micro-batches,
        from the task's persistent ones. Most tasks use them as they are; DPO first runs its reference model over
        the step's micro-batches and attaches the reference log-probs."""
        return data

    def read_counted_step(self, t: Trainer, data: list[Iterator[dict[str, Any]]],
                          num_microbatches: int) -> list[dict[str, Any]]:
        """read_step, and the packed rows of a training step counted for MFU (validation runs in eval mode)."""
        step = read_step(data, num_microbatches)
        if self.packed and t.model[0].training:
            self.packed.count(step)
        return step


def read_step(data: list[Iterator[dict[str, Any]]], num_microbatches: int) -> list[dict[str, Any]]:
    """This step's micro-batches, read from the first model chunk's iterator; the other chunks' iterators (virtual
    pipeline stages read the same micro-batches) are moved past them, and the caller hands every chunk the list."""
    step = [next(data[0]) for _ in range(num_microbatches)]
    for other in data[1:]:
        for _ in range(num_microbatches):
            next(other)
    return step


def step_share(counts: list[Any], device: Any) -> torch.Tensor:
    """What each micro-batch divides its summed loss by so that the step's loss is the mean over all the step's
    tokens (or pairs): their count over the step's micro-batches and the data-parallel ranks, over micro-batches x
    DP ranks (Megatron's schedule then averages the micro-batches, DDP the DP ranks). A mean per micro-batch would
    weigh a token of a micro-batch with few response tokens (or a pair of a packed row with few pairs) more than one
    of a full one. One all-reduce over the DP group, on the device: no host synchronisation."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    total = torch.stack([torch.as_tensor(c, dtype=torch.float32, device=device) for c in counts]).sum()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return total.clamp(min=1) / (len(counts) * ps.get_data_parallel_world_size())


class PackedAttention:
    """The share of full-length causal attention that the packed rows of the training steps computed (attention
    stays within each example: sum of len^2 over rows x seq_length^2), for MFU. Counted on the device as the steps
    are read; read at log time, summed over the data-parallel ranks (every rank reads it: one all-reduce)."""

    def __init__(self, seq_length: int) -> None:
        self.seq_length, self.squares, self.rows = seq_length, 0.0, 0

    def count(self, step: list[dict[str, Any]]) -> None:
        for batch in step:  # one packed row per micro-batch (micro_batch_size 1)
            lengths = batch["cu_seqlens"].diff().double()  # float64: exact sums of squares of lengths
            self.squares = self.squares + (lengths * lengths).sum()
            self.rows += 1

    def fraction(self) -> float:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from mcorekit.runtime.ranks import collective_device

        device = collective_device()
        totals = torch.stack([torch.as_tensor(self.squares, dtype=torch.float64, device=device),
                              torch.tensor(self.rows * self.seq_length**2, dtype=torch.float64, device=device)])
        dist.all_reduce(totals, group=ps.get_data_parallel_group())
        self.squares, self.rows = 0.0, 0
        return float(totals[0] / totals[1]) if totals[1] > 0 else 1.0
