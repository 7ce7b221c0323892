"""Supervised fine-tuning on chat jsonl: the language-modelling loss on the assistant's tokens only (the dataset's
loss masks), with optional packing of several examples into one sequence (data.packing). The step's loss is the mean
over all of its response tokens, as TRL's and NeMo's SFT take it: examples have different numbers of response tokens,
and a mean per micro-batch would weigh the tokens of a micro-batch with few of them more."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from mcorekit.train.tasks.base import share_of, step_total
from mcorekit.train.tasks.lm import LanguageModelling

if TYPE_CHECKING:
    from mcorekit.train.build import Trainer


class SupervisedFineTuning(LanguageModelling):
    """LanguageModelling's step; its data (train/data/sft.py, chosen by data.kind=sft) carries the masks."""

    name = "sft"
    padded = True

    def prepare_step(self, t: Trainer, data: list[Iterator[dict[str, Any]]],
                     num_microbatches: int) -> list[Iterator[dict[str, Any]]]:
        step = self.read_counted_step(t, data, num_microbatches)
        total = step_total([b["loss_mask"].sum() for b in step], step[0]["loss_mask"].device)
        self.step_counts = {"loss": total}  # validation: the mean over all its batches' response tokens
        share = share_of(total, len(step))
        for batch in step:
            batch["token_share"] = share
        return [iter(step) for _ in data]
