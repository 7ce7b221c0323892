"""Scan a failed job's logs for the usual causes and say what to do about each."""

from __future__ import annotations

import re
from pathlib import Path

# (pattern, cause, remedy); the first pattern found wins, in this order.
KNOWN_FAILURES = [
    (re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED"), "CUDA out of memory",
     "lower schedule.micro_batch_size, set recompute.granularity=selective (or full), or raise parallel.tp / parallel.pp"),
    (re.compile(r"Watchdog caught collective operation timeout|NCCL.*[Tt]imeout|ProcessGroupNCCL.*timed out"), "NCCL timeout",
     "a rank hung or died first: read the other ranks' logs (mcorekit logs JOB --rank N); rerun with NCCL_DEBUG=INFO"),
    (re.compile(r"NaN or Inf (?:found )?in (?:loss|grad)|loss is nan|non-finite loss", re.I), "NaN/Inf loss",
     "lower optimizer.lr or lengthen schedule.warmup_iters, keep optimizer.clip_grad on, check the data near that step"),
    (re.compile(r"DUE TO TIME LIMIT"), "time limit reached",
     "raise resources.time, or keep checkpoint.save_interval short enough that requeue resumes close to where it stopped"),
]
STEP_RE = re.compile(r"\bstep (\d+)(?:/\d+)?\b")
OWN_ERROR_RE = re.compile(r"^mcorekit: error: .*$", re.M)  # what mcorekit itself said before it exited 2
# a training job that stopped at resources.max_restarts on its time limit (runtime/requeue.stop_and_exit): FAILED,
# exit 1, with no traceback to show
RESTART_CAP_RE = re.compile(r"^mcorekit\.train: error: (stopped at its restart cap .*)$", re.M)


def log_files(run_dir: Path, job_id: str) -> list[Path]:
    logs = run_dir / "logs"
    return sorted(logs.glob(f"{job_id}_*_log.out")) + sorted(logs.glob(f"{job_id}_*_log.err"))


def diagnose(texts: list[str]) -> str | None:
    """The job's own `mcorekit: error: ...` line when it printed one (the payload's RuntimeError that follows says
    only that it exited 2), else its stop at the restart cap, else the first known failure, else the last Python
    exception."""
    for text in texts:
        if m := OWN_ERROR_RE.search(text):
            return m.group(0).strip()
    for text in texts:
        if m := RESTART_CAP_RE.search(text):
            return m.group(1).strip()
    joined = "\n".join(texts)
    for pattern, cause, remedy in KNOWN_FAILURES:
        if pattern.search(joined):
            return f"{cause}: {remedy}"
    for text in texts:
        if "Traceback (most recent call last)" in text:
            tail = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith((" ", "\t"))]
            exc = next((ln for ln in reversed(tail) if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", ln)), None)
            return f"Python exception: {exc or tail[-1]}"
    return None


def last_step(texts: list[str]) -> int | None:
    steps = [int(m) for text in texts for m in STEP_RE.findall(text)]
    return max(steps) if steps else None
