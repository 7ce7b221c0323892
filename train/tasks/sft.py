"""Supervised fine-tuning on chat jsonl: the language-modelling loss on the assistant's tokens only (the dataset's
loss masks), with optional packing of several examples into one sequence (data.packing)."""

from __future__ import annotations

from mcorekit.train.tasks.lm import LanguageModelling


class SupervisedFineTuning(LanguageModelling):
    """Same step as LanguageModelling; its data (train/data/sft.py, chosen by data.kind=sft) carries the masks."""

    name = "sft"
