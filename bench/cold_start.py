"""Start-up to the end of step 1 through the real entry (`python -m mcorekit.train`), by the state of the caches a
process finds: the bytecode of torch, Megatron-Core and TE (mcorekit/caches.use_bytecode_cache), torch.compile's
kernels (runtime/env.use_compile_cache) and the CUDA driver's kernels compiled from PTX. One fresh process per case,
in this order, stopped (its process group killed) once it prints its `mcorekit.train: startup` line at the end of
step 1: nothing is saved.

    python bench/cold_start.py [--shape 3b] [--out DIR] [--cold-disk] [--dry]

  first-serial  every cache empty, the background compile of a first run held off (the bench holds its lock): a
                user's first run as it was before mcorekit/caches.precompile_in_background
  first         every cache empty: a user's first run
  warm          every cache as `first` left them: every later or requeued run
  no-cuda-cache as `warm` but for the CUDA driver's cache of the kernels it compiles from PTX (CUDA_CACHE_PATH
                naming an empty folder): what a first run pays for it (on one H200, 2026-12-04, 3.2-3.3 s of step 1;
                before 2026-12-04 the bench left that cache in the user's home, and whichever first run came first on
                a machine paid it alone)
  no-bytecode   torch.compile's cache warm, the bytecode cache out of use (PYTHONPYCACHEPREFIX naming an empty
                folder that is not written: where the environment sets PYTHONDONTWRITEBYTECODE and the packages have
                no bytecode, every import compiles, as before use_bytecode_cache)
  warm-again    as `warm`, for the spread between two equal processes

The caches live under --out (XDG_CACHE_HOME, and CUDA's and Triton's own: OTHER_CACHES), never the user's; each case
reports the sizes of those it used, after it. The shape is start_save's (3b: the llama-3b preset, seq 2048,
micro-batch 4 x 8). Prints a Markdown table and writes results.json (with whether the environment writes bytecode and
whether torch was installed with it). --cold-disk drops the installed packages' files (the folders holding torch,
transformers, Megatron-Core and TE, and the standard library) from the page cache before each first run, as on a node
that has not read them since the install. --dry writes the experiment file only.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mcorekit.caches import LOCK_NAME, cache_folder, user_cache
from results import (OTHER_CACHES, die_with_parent, finish, fresh_dir, single_gpu_env, startup_marks,
                     with_kernel_caches)
from start_save import bench_config, checked, drop_page_cache, phases

CASES = ("first-serial", "first", "warm", "no-cuda-cache", "no-bytecode", "warm-again")
TIMEOUT_S = 300.0


def case_env(case: str, out: Path) -> dict[str, str]:
    inherited = {k: v for k, v in single_gpu_env(29597).items()
                 if k not in ("TORCHINDUCTOR_CACHE_DIR", "PYTHONPYCACHEPREFIX")}
    env = with_kernel_caches(inherited, out / "cache")
    env["XDG_CACHE_HOME"] = str(out / "cache")
    if case == "no-bytecode":
        empty = fresh_dir(out / "no-bytecode-prefix")
        env["PYTHONPYCACHEPREFIX"] = str(empty)  # named by the environment: use_bytecode_cache leaves it alone
    if case == "no-cuda-cache":
        env["CUDA_CACHE_PATH"] = str(fresh_dir(out / "no-cuda-cache-folder"))  # not the case's run folder
    return env


def until_step1(cmd: list[str], env: dict[str, str], log: Path) -> tuple[dict[str, float], str]:
    """Run `cmd` until its startup line, then kill its process group (also after TIMEOUT_S without it); (the startup
    marks, the output so far)."""
    lines: list[str] = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                          start_new_session=True, preexec_fn=die_with_parent) as p:
        assert p.stdout is not None

        def stop() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)

        timer = threading.Timer(TIMEOUT_S, stop)
        timer.start()
        try:
            for line in p.stdout:
                lines.append(line)
                if line.startswith("mcorekit.train: startup "):
                    break
        finally:
            timer.cancel()
            stop()
            p.wait()
    out = "".join(lines)
    log.write_text(out)
    return startup_marks(out), out


def bytecode_facts() -> dict[str, Any]:
    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec and spec.origin else ""
    return {"PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE", ""),
            "torch_installed_with_bytecode": bool(origin) and Path(importlib.util.cache_from_source(origin)).exists()}


def install_folders() -> list[Path]:
    """The folders holding the heavy packages (site-packages, or a --target folder) and the standard library."""
    found = (importlib.util.find_spec(p) for p in ("torch", "transformers", "transformer_engine", "megatron"))
    sites = {Path(s.origin).parent.parent for s in found if s is not None and s.origin}
    return sorted(sites) + [Path(sysconfig.get_paths()["stdlib"])]


@contextlib.contextmanager
def caches_for(case: str, out: Path, cold_disk: bool) -> Iterator[None]:
    """Empty caches for the first runs (with --cold-disk, the installs' files out of the page cache too); for
    `first-serial` the background compile's lock held meanwhile."""
    if not case.startswith("first"):
        yield
        return
    if cold_disk:
        for folder in install_folders():
            drop_page_cache(folder)
    fresh_dir(out / "cache")
    pycache = user_cache({"XDG_CACHE_HOME": str(out / "cache")}, "pycache")  # the folder the run will use
    assert pycache is not None
    with open(pycache / LOCK_NAME, "a") as lock:
        if case == "first-serial":
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run(case: str, config: Path, out: Path, cold_disk: bool = False) -> dict[str, Any]:
    run_dir = out / case
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mcorekit.train", "--config", str(config), "--run-dir", str(run_dir)]
    start = time.time()
    env = case_env(case, out)
    with caches_for(case, out, cold_disk):
        marks, log = until_step1(cmd, env, run_dir / "log.txt")
    if "step1" not in marks:
        return {"case": case, "error": log[-1500:]}
    return {"case": case, "step1_s": marks["step1"], "phases": phases(marks), "wall_s": round(time.time() - start, 1),
            "cache_mb": cache_sizes(env)}


def cache_sizes(env: dict[str, str]) -> dict[str, float]:
    """MB in each cache folder a case used (`env` is its environment), after it: the bytecode, torch.compile's, the
    CUDA driver's and Triton's."""
    folders = {"bytecode": Path(env.get("PYTHONPYCACHEPREFIX") or cache_folder(env, "pycache")),
               "torch_compile": cache_folder(env, "torchinductor"),
               **{name: Path(env[var]) for var, name in OTHER_CACHES.items()}}
    return {name: round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6, 1)
            for name, folder in folders.items()}


def table(results: list[dict[str, Any]]) -> str:
    keys = ("imports", "checks", "dist_init", "model", "optimizer", "resume", "step1")
    rows = ["| case | start to the end of step 1, s | " + " | ".join(k.replace("_", " ") for k in keys) + " |",
            "|---" * (len(keys) + 2) + "|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['case']} | failed |" + " |" * len(keys))
            continue
        p = r["phases"]
        rows.append(f"| {r['case']} | {r['step1_s']:.2f} | " + " | ".join(f"{p.get(k, 0):.2f}" for k in keys) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="3b")
    p.add_argument("--out", default="/tmp/mcorekit-cold-start")
    p.add_argument("--cold-disk", action="store_true", help="the installs' files out of the page cache before the "
                   "first runs")
    p.add_argument("--dry", action="store_true", help="write and validate the experiment file, train nothing")
    a = p.parse_args(argv)
    out = fresh_dir(a.out)
    config = bench_config(a.shape, "save", out / "config", out / "ckpt")
    if a.dry:
        return 0 if checked(config, "cold start") else 1
    results: list[dict[str, Any]] = [{"case": "environment", **bytecode_facts(), "cold_disk": a.cold_disk}]
    print(json.dumps(results[0]), flush=True)
    for case in CASES:
        results.append(run(case, config, out, a.cold_disk))
        print(json.dumps(results[-1]), flush=True)
    return finish(results, out, lambda rs: table([r for r in rs if r["case"] != "environment"]))


if __name__ == "__main__":
    raise SystemExit(main())
