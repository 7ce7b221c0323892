"""Training tasks: what a run optimises. A task supplies its data and its forward-and-loss step; the loop
(train/loop.py) is the same for every task. A new task (DPO, GRPO, ...) is a new file here plus one line in TASKS.

Tasks today:
  lm   language modelling on mock or indexed (pretraining) data: next-token loss on every token
  sft  supervised fine-tuning on chat jsonl: next-token loss on the assistant's tokens only (loss masks), packing
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mcorekit.train.tasks.base import Task
from mcorekit.train.tasks.lm import LanguageModelling
from mcorekit.train.tasks.sft import SupervisedFineTuning

if TYPE_CHECKING:
    from pathlib import Path

    from mcorekit.config.experiment import Experiment
    from mcorekit.models.spec import ModelSpec

TASKS: dict[str, type[Task]] = {"lm": LanguageModelling, "sft": SupervisedFineTuning}


def task_for(exp: Experiment, spec: ModelSpec, run_dir: Path) -> Task:
    """The task an experiment trains; today chosen by its data kind (chat jsonl is SFT, the rest is LM)."""
    name = "sft" if exp.data.kind == "sft" else "lm"
    return TASKS[name](exp, spec, run_dir)


__all__ = ["TASKS", "Task", "task_for"]
