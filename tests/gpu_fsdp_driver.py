"""Run one training in its own process(es) for tests/test_gpu_fsdp.py (Megatron's global state is per process).
usage: gpu_fsdp_driver.py CONFIG RUN_DIR [STOP_AT_STEP] [--no-save]

As tests/gpu_train_driver.py: with STOP_AT_STEP > 0 the process sends itself SIGUSR2 after that step (as Slurm does
before a time limit), so the loop saves a checkpoint and exits for requeue (exit code 3 here). Each rank writes
RUN_DIR/memory.rank<R>.json at the end: its peak allocated and reserved GPU memory in bytes.

--no-save: the 3B runs that measure memory and tokens/s skip the loop's checkpoint writes (the final one included),
so they measure training alone (and keep the suite short); every small run saves as training does."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from single_rank import single_rank_env  # noqa: E402  (this folder is on sys.path: the driver runs as a script)

if "SLURM_PROCID" not in os.environ:  # a single process; under srun (tests/slurm_shim) ranks come from SLURM_*
    os.environ.update(single_rank_env())

from mcorekit.config.experiment import load_experiment  # noqa: E402
from mcorekit.train import checkpoint, loop  # noqa: E402


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--no-save"]
    config, run_dir, stop_at = args[0], Path(args[1]), int(args[2]) if len(args) > 2 else 0
    exp = load_experiment(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    if "--no-save" in sys.argv:
        checkpoint.Saver.save = lambda self, step, *a, **k: self.root  # type: ignore[method-assign]

    def on_step(metrics: dict) -> None:
        if stop_at and metrics["step"] == stop_at:
            os.kill(os.getpid(), signal.SIGUSR2)

    try:
        loop.train(exp, run_dir, on_step=on_step)
    except SystemExit as e:
        print(f"EXITED_FOR_REQUEUE {e.code}", flush=True)
        return 3
    finally:
        import torch

        rank = os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0"))
        if torch.cuda.is_available():
            (run_dir / f"memory.rank{rank}.json").write_text(json.dumps(
                {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
