"""Failure diagnosis scanned from logs: each known cause maps to its usual remedy."""

from __future__ import annotations

import pytest

from mcorekit.launch.diagnose import diagnose, last_step

TRACEBACK = """Traceback (most recent call last):
  File "x.py", line 1, in <module>
    main()
ValueError: bad shard
"""


@pytest.mark.parametrize("log,expected", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "CUDA out of memory: lower schedule.micro_batch_size"),
    ("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)", "NCCL timeout"),
    ("step 120 | NaN or Inf found in loss", "NaN/Inf loss: lower optimizer.lr"),
    ("slurmstepd: error: *** JOB 5 ON n1 CANCELLED AT 2026-01-01 DUE TO TIME LIMIT ***", "time limit reached"),
    (TRACEBACK, "Python exception: ValueError: bad shard"),
    ("step 1\nstep 2\n", None),
    # the job's own error line, not the payload's RuntimeError after it
    ("mcorekit: error: /nonexistent: no config.json; give an HF model folder\n" + TRACEBACK.replace(
        "ValueError: bad shard", "RuntimeError: mcorekit convert hf-to-mcore /nonexistent out exited with 2"),
     "mcorekit: error: /nonexistent: no config.json; give an HF model folder"),
    # a training job that stopped at its restart cap: FAILED, exit 1, no traceback (its diagnosis was empty)
    ("step 90/1000 | loss 2.1\nmcorekit.train: error: stopped at its restart cap (resources.max_restarts=2): time "
     "limit near at step 97, checkpoint saved; not requeueing: the job has requeued itself 2 times\n",
     "stopped at its restart cap (resources.max_restarts=2): time limit near at step 97, checkpoint saved"),
])
def test_diagnosis(log: str, expected: str | None) -> None:
    found = diagnose([log])
    assert (found is None) if expected is None else found.startswith(expected)


def test_last_step() -> None:
    assert last_step(["step 3/100 loss 2.0\nstep 14/100 loss 1.5", "step 9"]) == 14
    assert last_step(["nothing"]) is None
