"""What the benchmark scripts share: a fresh work folder; a worker snippet run in its own Python process that
reports one `RESULT ...` line; each run timed and printed as a JSON line as soon as it ends; results.json and the
Markdown table at the end, with an exit code that says whether any run failed; what a training run's metrics and
output say (its steady tokens/s, its start-up marks, what torch.compile spent)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import statistics
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from mcorekit.runtime.env import COMPILE_CACHE


def timed(run: Callable[[], dict]) -> dict:
    start = time.perf_counter()
    result = run()
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result), flush=True)
    return result


def finish(results: list[dict], out: Path, table: Callable[[list[dict]], str]) -> int:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0 if all("error" not in r for r in results) else 1


def fresh_dir(path: str | Path) -> Path:
    work = Path(path)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def single_gpu_env(port: int) -> dict[str, str]:
    """This environment plus the rendezvous of a one-process training run (no torchrun) on `port`."""
    return {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def die_with_parent() -> None:
    """In a child, before it executes: the kernel kills it (SIGKILL) when the process that started it dies, however
    that dies. A benchmark cut by a time limit must not leave its training process holding the GPU and the port the
    next command needs (on 2026-12-02 a profile cut at the GPU machine's 600 s limit did). Linux's
    prctl(PR_SET_PDEATHSIG); torchrun's ranks are children of torchrun, not of the bench, and are not covered."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def run_training(cmd: list[str], env: dict[str, str], run_dir: Path, timeout: float = 900.0) -> subprocess.CompletedProcess:
    """One training process of a benchmark: its output goes to run_dir/log.txt, and its final checkpoint is
    deleted (not needed; ~20 GB for the MoE shape, which filled the GPU machine's 64 GB disk). A process still
    running (or whose output pipe is still open) after `timeout` seconds is killed and counts as failed (124)."""
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                          start_new_session=True,  # its own process group: torchrun's ranks go with it
                          preexec_fn=die_with_parent) as p:
        try:
            out, err = p.communicate(timeout=timeout)
            proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            proc = subprocess.CompletedProcess(cmd, 124, out + err + f"\nbench: killed after {timeout:.0f} s", "")
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    (run_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    return proc


def run_worker(code: str, *args: str, env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """`python -c CODE ARGS` in its own process: (what follows its last `RESULT ` line, or None when it failed
    or printed none; the tail of its output, for the error message)."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    payload = lines[-1][len("RESULT "):] if lines and proc.returncode == 0 else None
    return payload, (proc.stdout + proc.stderr)[-2000:]


def metrics_summary(run_dir: Path) -> dict[str, Any]:
    """A training run's figures from its metrics.jsonl: tokens/s and MFU as the median of the logged intervals after
    the first (which holds start-up and warm-up), peak memory, the losses."""
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"tokens_per_s"' in x]
    steady = m[1:] or m
    return {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in steady),
            "mfu": statistics.median(x["mfu"] for x in steady), "mem_gb": max(x["mem_gb"] for x in m),
            "loss_first": m[0]["loss"], "loss_last": m[-1]["loss"], "losses": [x["loss"] for x in m]}


# caches a training process keeps outside mcorekit's, each given a folder of its own by a bench: the CUDA driver's cache
# of the kernels it compiles from PTX (~/.nv/ComputeCache by default: 1.3 MB and 3.2-3.3 s of a 3B run's step 1 on one
# H200, 2026-12-04) and Triton's for kernels not compiled by inductor (~/.triton/cache); inductor's own kernels follow
# TRITON_CACHE_DIR when it is set
OTHER_CACHES = {"CUDA_CACHE_PATH": "cuda", "TRITON_CACHE_DIR": "triton"}


def compile_env(port: int, cache: Path) -> dict[str, str]:
    """A one-process training run whose torch.compile cache is `cache`, the CUDA driver's and Triton's caches in it too
    (empty: its start is cold; before 2026-12-04 the driver's stayed in the home folder, so a machine's first training
    process paid for the later ones), and whose dynamo log lines (TORCH_LOGS=dynamo) time what it compiles
    (compile_seconds)."""
    return {**with_kernel_caches(single_gpu_env(port), cache), COMPILE_CACHE: str(cache), "TORCH_LOGS": "dynamo"}


def with_kernel_caches(env: dict[str, str], folder: Path) -> dict[str, str]:
    """`env` with the CUDA driver's and Triton's caches (OTHER_CACHES) in `folder`, the driver's cache switched on."""
    kept = {k: v for k, v in env.items() if k != "CUDA_CACHE_DISABLE"}
    return {**kept, **{var: str(folder / name) for var, name in OTHER_CACHES.items()}}


def startup_marks(out: str) -> dict[str, float]:
    """The `mcorekit.train: startup {json}` line of a training process's output: seconds from its start to the end of
    each start-up phase (imports, checks, dist_init, model, optimizer, resume, step1)."""
    line = next((x for x in out.splitlines() if x.startswith("mcorekit.train: startup ")), None)
    return json.loads(line.split(" ", 2)[2]) if line else {}


DYNAMO_LINE = re.compile(r"I\d{4} (\d\d):(\d\d):(\d\d\.\d+) \d+ \S+\] \[(\d+/\d+)\] Step (?:1: torchdynamo start "
                         r"tracing (\S+)|2: done compiler function)")


def compile_seconds(out: str) -> dict[str, float]:
    """Seconds torch.compile spent on each function, from torch's dynamo log lines (TORCH_LOGS=dynamo: one line when
    it starts tracing a frame, one when inductor has compiled it; each with the time of day). A frame compiled again
    (a recompile, after midnight never) counts its last compile."""
    started: dict[str, tuple[str, float]] = {}
    seconds: dict[str, float] = {}
    for m in DYNAMO_LINE.finditer(out):
        at = int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])
        if m[5]:
            started[m[4]] = (m[5], at)
        elif m[4] in started:
            name, began = started.pop(m[4])
            seconds[name] = round(at - began, 2)
    return seconds


def compile_summary(out: str) -> dict[str, Any]:
    compiled = compile_seconds(out)
    return {"compile_s": compiled, "compile_total_s": round(sum(compiled.values()), 2)}
