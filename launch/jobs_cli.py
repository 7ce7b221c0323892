"""`mcorekit status`, `mcorekit logs JOB`, `mcorekit cancel JOB`: the jobs this project submitted."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mcorekit.errors import LaunchError
from mcorekit.launch import accounting, diagnose
from mcorekit.launch.config import load_profile
from mcorekit.launch.submit import REGISTRY


def _registry(run_root: Path) -> list[dict[str, Any]]:
    path = run_root / REGISTRY
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _find(run_root: Path, job_id: str) -> dict[str, Any]:
    base = job_id.split("_")[0]
    for entry in reversed(_registry(run_root)):
        if entry["job_id"] in (job_id, base) or entry["job_id"].split("_")[0] == base:
            return entry
    raise LaunchError(f"job {job_id} is not in {run_root / REGISTRY}; was it submitted from this project (see `mcorekit status`)?")


def _run_root(args: argparse.Namespace) -> Path:
    return Path(args.runs) if args.runs else Path(load_profile(args.cluster).run_root)


def status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    entries = _registry(_run_root(args))[-args.last:]
    if not entries:
        print(f"no jobs recorded under {_run_root(args)}")
        return 0
    records = accounting.sacct([e["job_id"] for e in entries])
    table = Table(title="mcorekit jobs")
    for col in ("job", "name", "kind", "state", "exit", "elapsed", "restarts", "last step", "diagnosis"):
        table.add_column(col)
    for e in entries:
        ids = [k for k in records if k == e["job_id"] or k.startswith(e["job_id"] + "_")] or [e["job_id"]]
        for jid in ids:
            rec = records.get(jid)
            texts = [p.read_text(errors="replace") for p in diagnose.log_files(Path(e["run_dir"]), jid)]
            step = diagnose.last_step(texts)
            why = diagnose.diagnose(texts) if rec and rec.state not in ("COMPLETED", "RUNNING", "PENDING") else None
            table.add_row(jid, e["name"], e.get("kind", ""), rec.state if rec else "UNKNOWN", rec.exit_code if rec else "",
                          rec.elapsed if rec else "", str(rec.restarts) if rec else "", "" if step is None else str(step), why or "")
    Console(width=200).print(table)
    return 0


def logs(args: argparse.Namespace) -> int:
    entry = _find(_run_root(args), args.job)
    path = Path(entry["run_dir"]) / "logs" / f"{args.job}_{args.rank}_log.{'err' if args.stderr else 'out'}"
    if not path.exists() and not args.follow:
        raise LaunchError(f"no log yet at {path} (the job may still be pending; try --follow)")
    pos = 0
    while True:
        if path.exists():
            with open(path, errors="replace") as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
            sys.stdout.write(chunk)
            sys.stdout.flush()
        if not args.follow:
            return 0
        rec = accounting.sacct([args.job]).get(args.job)
        if rec is not None and rec.final:
            return 0
        time.sleep(1.0)


def cancel(args: argparse.Namespace) -> int:
    _find(_run_root(args), args.job)  # only this project's jobs
    proc = subprocess.run(["scancel", args.job], capture_output=True, text=True)
    if proc.returncode != 0:
        raise LaunchError(f"scancel {args.job} failed: {proc.stderr.strip()}")
    print(f"cancelled {args.job}")
    return 0


def main(command: str, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"mcorekit {command}", description={
        "status": "Table of this project's jobs: state, elapsed, restarts, last logged step, and a diagnosis for failures.",
        "logs": "Print a job's log for one rank (task); --follow streams it until the job ends.",
        "cancel": "Cancel one of this project's jobs (scancel).",
    }[command])
    parser.add_argument("--cluster", default="local", help="profile whose run_root holds the job registry")
    parser.add_argument("--runs", default=None, help="run root to read instead of the profile's")
    if command == "status":
        parser.add_argument("--last", type=int, default=20, help="how many recent jobs to show")
    else:
        parser.add_argument("job", help="Slurm job id (array tasks as ID_N)")
    if command == "logs":
        parser.add_argument("--rank", type=int, default=0, help="task (rank) whose log to show")
        parser.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
        parser.add_argument("--stderr", action="store_true", help="show stderr instead of stdout")
    args = parser.parse_args(argv)
    return {"status": status, "logs": logs, "cancel": cancel}[command](args)
