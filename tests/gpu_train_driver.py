"""Run one training in its own process(es) (Megatron's global state is per process).
usage: gpu_train_driver.py CONFIG RUN_DIR [STOP_AT_STEP] [key=value ...]
With STOP_AT_STEP > 0 the process sends itself SIGUSR2 after that step, as Slurm does before a time limit:
the loop saves a checkpoint at the next step boundary and exits for requeue."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from single_rank import single_rank_env  # noqa: E402  (this folder is on sys.path: the driver runs as a script)

if "SLURM_PROCID" not in os.environ:  # a single process; under srun (tests/slurm_shim) ranks come from SLURM_*
    os.environ.update(single_rank_env())

from mcorekit.launch.config import load_experiment  # noqa: E402
from mcorekit.train.loop import train  # noqa: E402


def main() -> int:
    config, run_dir, stop_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0
    exp = load_experiment(config, sys.argv[4:])
    run_dir.mkdir(parents=True, exist_ok=True)

    def on_step(metrics: dict) -> None:
        if stop_at and metrics["step"] == stop_at:
            os.kill(os.getpid(), signal.SIGUSR2)

    try:
        train(exp, run_dir, on_step=on_step)
    except SystemExit as e:
        print(f"EXITED_FOR_REQUEUE {e.code}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
