"""The launcher's payload: every srun task runs the training loop from the run folder's resolved config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def submitit_result() -> Path | None:
    """Where submitit's runner saves this task's result; None outside the runner."""
    if "SUBMITIT_FOLDER" not in os.environ:
        return None
    import submitit

    return Path(submitit.JobEnvironment().paths.result_pickle)


class TrainJob:
    def __init__(self, config_path: str, run_dir: str, peak_tflops: float | None = None) -> None:
        self.config_path = config_path
        self.run_dir = run_dir
        self.peak_tflops = peak_tflops

    def __call__(self) -> dict[str, Any]:
        from mcorekit.caches import damaged_cache_line
        from mcorekit.errors import MCoreKitError

        try:
            return self._train()
        except (EOFError, ValueError) as e:  # a bytecode file cut short in mcorekit's cache: one line, then removed
            if (line := damaged_cache_line(e)) is None:
                raise
            raise MCoreKitError(line) from None

    def _train(self) -> dict[str, Any]:
        from mcorekit.runtime.env import prepare_training_process

        prepare_training_process()  # before torch and Megatron-Core are imported (see there)
        from mcorekit import quiet
        from mcorekit.config.experiment import load_experiment
        from mcorekit.train.loop import train
        from mcorekit.train.shutdown import leave_after_runner, shut_down

        quiet.install()

        exp = load_experiment(self.config_path)
        losses = train(exp, Path(self.run_dir), self.peak_tflops)
        shut_down()
        leave_after_runner(submitit_result())  # the job ends once submitit has saved this, without the finalization
        return {"steps": len(losses), "final_loss": losses[-1] if losses else None}

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Unused while the loop runs (it handles USR2 itself); lets submitit treat the job as checkpointable."""
        import submitit

        return submitit.helpers.DelayedSubmission(self)
