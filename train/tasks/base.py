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

    def __init__(self, exp: Experiment, spec: ModelSpec, run_dir: Path) -> None:
        self.exp, self.spec, self.run_dir = exp, spec, run_dir

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
