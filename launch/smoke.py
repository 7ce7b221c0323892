"""The smallest real job: every task joins one torch.distributed group and all-reduces its rank.

`mcorekit launch smoke --cluster X` runs it to prove a cluster profile works end to end (srun, SLURM_*
environment, rendezvous, collective, accounting) before spending GPU hours.
"""

from __future__ import annotations

import socket
from typing import Any


def allreduce_check() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from mcorekit.runtime.env import init_process_group

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    d = init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(d.local_rank)
    device = "cuda" if backend == "nccl" else "cpu"
    value = torch.tensor([float(d.rank + 1)], device=device)
    dist.all_reduce(value)
    result = {
        "rank": d.rank,
        "world_size": d.world_size,
        "sum": value.item(),
        "expected": d.world_size * (d.world_size + 1) / 2,
        "backend": backend,
        "host": socket.gethostname(),
        "env_source": d.source,
        "master_port": d.master_port,
    }
    dist.destroy_process_group()
    return result


class CountingJob:
    """A checkpointing CPU payload that exercises the requeue protocol exactly as train/ uses it.

    Each step appends its number to steps.log; a checkpoint is the last finished step, written atomically with
    a `latest` tracker. On USR2/TERM it saves at the step boundary, then requeues (USR2) or stops (TERM); on every
    start it resumes from its own latest checkpoint. Every step therefore runs exactly once across restarts.
    Run it as one task (tasks_per_node=1): it makes no process group, so each task would decide alone, and one that
    exits first ends the others (srun --kill-on-bad-exit) before rank 0 has saved or requeued.
    """

    def __init__(self, run_dir: str, total_steps: int, step_seconds: float = 1.0, save_every: int = 1000,
                 max_restarts: int = 3) -> None:
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.step_seconds = step_seconds
        self.save_every = save_every
        self.max_restarts = max_restarts

    def _latest(self) -> int:
        from pathlib import Path

        tracker = Path(self.run_dir) / "ckpt" / "latest"
        return int(tracker.read_text()) if tracker.exists() else 0

    def _save(self, step: int) -> None:
        import os
        from pathlib import Path

        ckpt = Path(self.run_dir) / "ckpt"
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / f"step_{step}.json").write_text(f'{{"step": {step}}}')
        tmp = ckpt / "latest.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, ckpt / "latest")  # the tracker moves only after the checkpoint is complete

    def __call__(self) -> dict[str, Any]:
        import os
        import time
        from pathlib import Path

        from mcorekit.runtime.requeue import RestartGuard, StopSignal, restart_count, stop_and_exit

        stop = StopSignal()
        rank = int(os.environ.get("SLURM_PROCID", "0"))
        start = self._latest()
        guard = RestartGuard(Path(self.run_dir), self.max_restarts)
        if rank == 0:
            guard.check(start)
        print(f"restart {restart_count()}: resuming at step {start}", flush=True)
        step = start
        while step < self.total_steps:
            if stop.requested(group=False):
                if rank == 0:
                    self._save(step)
                    print(f"signal {stop.signum} at step {step}: saved checkpoint", flush=True)
                stop_and_exit(stop, guard, rank, step)
            time.sleep(self.step_seconds)
            step += 1
            if rank == 0:
                with open(Path(self.run_dir) / "steps.log", "a") as f:
                    f.write(f"{step} {restart_count()}\n")
                print(f"step {step}/{self.total_steps}", flush=True)
                if step % self.save_every == 0:
                    self._save(step)
        if rank == 0:
            self._save(step)
        stop.work_done()
        return {"final_step": step, "restarts": restart_count()}

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's hook; unused while __call__ runs (its handler is replaced), kept so submitit treats the job
        as checkpointable if the signal arrives before the payload starts."""
        import submitit

        return submitit.helpers.DelayedSubmission(self)
