"""Training tasks: what a run optimises. A task supplies its data and its forward-and-loss step; the loop
(train/loop.py) is the same for every task. A new task (DPO, GRPO, ...) is a new file here plus one line in TASKS.

Tasks today:
  lm   language modelling on mock or indexed (pretraining) data: next-token loss on every token
  sft  supervised fine-tuning on chat jsonl: next-token loss on the assistant's tokens only (loss masks), packing
  dpo  direct preference optimisation on {prompt, chosen, rejected} jsonl: sigmoid DPO loss against a reference
  grpo group relative policy optimisation on prompt jsonl: rollouts from the policy itself, rewards, clipped loss
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mcorekit.train.tasks.base import Task
from mcorekit.train.tasks.dpo import DirectPreferenceOptimization
from mcorekit.train.tasks.grpo import GroupRelativePolicyOptimization
from mcorekit.train.tasks.lm import LanguageModelling
from mcorekit.train.tasks.sft import SupervisedFineTuning

if TYPE_CHECKING:
    from pathlib import Path

    from mcorekit.config.experiment import Experiment
    from mcorekit.models.spec import ModelSpec

TASKS: dict[str, type[Task]] = {"lm": LanguageModelling, "sft": SupervisedFineTuning,
                                "dpo": DirectPreferenceOptimization, "grpo": GroupRelativePolicyOptimization}


def task_for(exp: Experiment, spec: ModelSpec, run_dir: Path) -> Task:
    """The task an experiment trains; today chosen by its data kind (chat jsonl is SFT, preference pairs DPO, the
    rest LM)."""
    name = exp.data.kind if exp.data.kind in ("sft", "dpo", "grpo") else "lm"
    return TASKS[name](exp, spec, run_dir)


__all__ = ["TASKS", "Task", "task_for"]
