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
    padded = False  # its rows end in padding (SFT, DPO): tokens/s counts their real tokens (RealTokens)
    packed: PackedAttention | None = None
    tokens: RealTokens | None = None
    # each metric's count in the step last prepared (tokens, pairs; on the device, over the DP ranks), where the
    # metric is a mean over that count: validation weighs its batches by it (mean_over_steps)
    step_counts: dict[str, torch.Tensor] | None = None

    def __init__(self, exp: Experiment, spec: ModelSpec, run_dir: Path) -> None:
        self.exp, self.spec, self.run_dir = exp, spec, run_dir
        # packed rows (SFT, DPO): the attention they compute, for MFU (counted where the task reads its steps)
        self.packed = PackedAttention(exp.data.seq_length) if exp.data.packing else None
        self.tokens = RealTokens() if self.padded else None

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
        """read_step, and a training step's rows counted: packed rows' attention for MFU, padded rows' real tokens
        for tokens/s (validation runs in eval mode: not counted)."""
        step = read_step(data, num_microbatches)
        if (self.packed or self.tokens) and t.model[0].training:
            if self.packed:
                self.packed.count(step)
            if self.tokens:
                self.tokens.count(step)
        return step

    def mean_over_steps(self, values: list[dict[str, float]],
                        counts: list[dict[str, float]]) -> dict[str, float]:
        """The metrics of several steps (validation's batches) as one: each the mean over all their tokens (pairs), as
        one step's is over its own, i.e. each step's value weighed by its count (`counts`: step_counts per step); a
        metric without a count weighs every step alike (lm: every batch holds the same tokens)."""
        return {k: weighted_mean([v[k] for v in values], [c.get(k) for c in counts]) for k in values[0]}


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
    return share_of(step_total(counts, device), len(counts))


def step_total(counts: list[Any], device: Any) -> torch.Tensor:
    """The micro-batches' counts (tokens, pairs) summed over the step and the data-parallel ranks: one all-reduce
    over the DP group, on the device."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    total = torch.stack([torch.as_tensor(c, dtype=torch.float32, device=device) for c in counts]).sum()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return total


def share_of(total: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """step_share from the step's total (step_total)."""
    from megatron.core import parallel_state as ps

    return total.clamp(min=1) / (micro_batches * ps.get_data_parallel_world_size())


def weighted_mean(values: list[float], weights: list[float | None]) -> float:
    """The values weighed by their counts; the plain mean where a count is missing or all are 0 (no token)."""
    counts = [w for w in weights if w is not None]
    if len(counts) < len(values) or not sum(counts):
        return sum(values) / len(values)
    return sum(v * w for v, w in zip(values, counts)) / sum(counts)


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


class RealTokens:
    """The real (non-padding) tokens of the training steps' rows, for tokens/s: padding is no trained token, though
    the GPU computes it (MFU counts it). The data's padding (data/packing.pack, pad_one) is a row's last segment:
    its positions restart at 0 after the last example's and it holds no loss token (every example holds one: SFT
    skips examples without a response, a DPO response is never empty). Counted on the device as the steps are read;
    read at log time, summed over the data-parallel ranks (every rank reads it: one all-reduce)."""

    def __init__(self) -> None:
        self.total: Any = 0

    def count(self, step: list[dict[str, Any]]) -> None:
        import torch

        for batch in step:
            positions, mask = batch["position_ids"], batch["loss_mask"]
            seq = positions.shape[-1]
            index = torch.arange(seq, device=positions.device)
            last = torch.where(positions == 0, index, 0).amax(dim=-1, keepdim=True)  # each row's last segment
            padding = (last > 0) & ((mask * (index >= last)) == 0).all(dim=-1, keepdim=True)
            self.total = self.total + torch.where(padding, last, seq).sum()

    def read(self) -> int:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from mcorekit.runtime.ranks import collective_device

        total = torch.as_tensor(self.total, dtype=torch.int64).to(collective_device()).reshape(1)
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        self.total = 0
        return int(total)
