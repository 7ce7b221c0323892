"""`mcorekit status`, `mcorekit logs JOB`, `mcorekit cancel JOB`: the jobs this project submitted.

The job registry (`<run_root>/jobs.jsonl`, one JSON object per submitted job or array task) says which jobs are
this project's: logs and cancel act only on ids it holds. A malformed registry line (a write cut short, an edit)
is skipped with one warning naming the file and line, so one bad line never hides the other jobs.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcorekit.config.cluster import load_profile
from mcorekit.config.values import CONTROL_RE, shown
from mcorekit.errors import LaunchError
from mcorekit.launch import accounting, diagnose
from mcorekit.launch.api import SWEEP_SUFFIX
from mcorekit.options import count, index, nonempty, positive_float
from mcorekit.launch.submit import REGISTRY

JOB_ID_RE = re.compile(r"(\d+)(?:_(\d+))?", re.ASCII)  # a job or one array task, as the registry and logs name them
# what `mcorekit cancel` takes per comma-separated item: JOB, JOB_N or JOB_[a-b,c,...]
CANCEL_ID_RE = re.compile(r"(\d+)(?:_(\d+)|_\[(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)\])?", re.ASCII)
MAX_CANCEL_TASKS = 100_000  # an array range larger than any array we submit (sweeps stop at 1000 points)
POLL_S = 1.0
UNKNOWN_GRACE_S = 2.0  # how long a job Slurm does not know may be an accounting lag, not a wrong id
REUSED = "ID REUSED"  # status's state for a job id whose Slurm job is another one (reused())


# ---------------------------------------------------------------- the registry


def _registry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return f"a JSON {type(entry).__name__}, not an object"
    for key in ("job_id", "name", "run_dir"):
        value = entry.get(key)
        if not isinstance(value, str) or CONTROL_RE.search(value):
            return f"{key} missing or not a one-line string"
    if not JOB_ID_RE.fullmatch(entry["job_id"]):
        return f"job_id {entry['job_id']!r} is not a Slurm job id"
    return None


def _registry(run_root: Path) -> list[dict[str, Any]]:
    """The registry's entries, skipping (with one warning line) lines that are not a complete entry."""
    path = run_root / REGISTRY
    if not path.is_file():
        return []
    entries, bad = [], []
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw.decode("utf-8"))
            problem = _registry_problem(entry)
        except (UnicodeDecodeError, ValueError) as e:
            entry, problem = None, f"not JSON ({type(e).__name__})"
        if problem:
            bad.append((number, problem))
        else:
            entries.append(entry)
    if bad:  # each line with its own reason
        lines = ", ".join(f"{n} ({why})" for n, why in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        print(f"mcorekit: warning: {shown(path)}: skipped malformed line{'s' if len(bad) > 1 else ''} {lines} "
              f"and read the rest", file=sys.stderr)
    return entries


@dataclass(frozen=True)
class Owned:
    """Which job ids the registry holds: whole jobs, and array tasks as (job, task)."""

    jobs: dict[int, dict[str, Any]]
    tasks: dict[tuple[int, int], dict[str, Any]]

    @classmethod
    def of(cls, entries: list[dict[str, Any]]) -> Owned:
        jobs, tasks = {}, {}
        for e in entries:
            base, task = JOB_ID_RE.fullmatch(e["job_id"]).groups()
            if task is None:
                jobs[int(base)] = e
            else:
                tasks[(int(base), int(task))] = e
        return cls(jobs, tasks)

    def task_ids(self, base: int) -> list[int]:
        return sorted(t for b, t in self.tasks if b == base)

    def entry(self, base: int, task: int | None) -> dict[str, Any] | None:
        """The registry entry covering JOB (a whole job or array) or JOB_N (a task, or a task of a whole job)."""
        if base in self.jobs:
            return self.jobs[base]
        if task is None:
            return self.tasks[(base, self.task_ids(base)[0])] if self.task_ids(base) else None
        return self.tasks.get((base, task))


def _not_ours(job: str, owned: Owned, path: Path) -> str:
    base = int(job.split("_")[0])
    if owned.task_ids(base):
        tasks = owned.task_ids(base)
        return (f"job {job} is not in {shown(path)}: array {base} has tasks {base}_{tasks[0]} to {base}_{tasks[-1]}")
    return f"job {job} is not in {shown(path)} (this project's jobs; see `mcorekit status`)"


def slurm_names(entries: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Job id (an array's base id) -> the job names Slurm shows for it: the registry's name, and a sweep's array
    name (its first point's name + SWEEP_SUFFIX). Slurm reuses ids (a reset cluster, another cluster sharing this
    run root): an id of ours whose job bears another name is someone else's job."""
    names: dict[str, set[str]] = {}
    for e in entries:
        own = {e["name"], e["name"] + SWEEP_SUFFIX} if e.get("kind") == "sweep" else {e["name"]}
        names.setdefault(e["job_id"].split("_")[0], set()).update(own)
    return names


# slurmdbd's name for a job whose name has not reached it yet: sacct shows it for a second or so after submission,
# longer on a busy machine (the Slurm CI at 4ad1e75 and 0eaf908 saw status call our failed job 'ID REUSED')
UNNAMED = "allocation"


def reused(rec: accounting.JobRecord | None, names: dict[str, set[str]]) -> str | None:
    """'Slurm's job 12 is named 'x', not 'y'' when Slurm's job of that id is not the one the registry holds."""
    base = (rec.job_id if rec else "").split("_")[0]
    if rec is None or rec.name in ("", UNNAMED) or base not in names or rec.name in names[base]:
        return None  # an empty name (some squeue outputs) or accounting's placeholder proves nothing either way
    ours = " or ".join(repr(n) for n in sorted(names[base]))
    return f"Slurm's job {rec.job_id} is named {rec.name!r}, not {ours}: the id was reused by another job"


def _run_root(args: argparse.Namespace) -> Path:
    """--runs as given (from here), else the profile's run root, absolute whatever the current directory."""
    return Path(args.runs).resolve() if args.runs else Path(load_profile(args.cluster).run_root)


def _job_id(text: str) -> str:
    """argparse type for one job or array task: ID or ID_N."""
    m = JOB_ID_RE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a job id (ID, or ID_N for an array task)")
    base, task = m.groups()
    return str(int(base)) + ("" if task is None else f"_{int(task)}")  # as Slurm writes it (no leading zeros)


# ---------------------------------------------------------------- status


def _parents(entry: dict[str, Any]) -> list[str]:
    """The job ids a chain stage waits for, from its registry entry's dependency (afterok:12:13)."""
    dep = entry.get("dependency")
    if not isinstance(dep, str):
        return []
    return [jid for part in dep.split(",") for jid in part.split(":")[1:] if JOB_ID_RE.fullmatch(jid)]


def _dependency_failed(entry: dict[str, Any], records: dict[str, accounting.JobRecord],
                       names: dict[str, str], slurm: dict[str, set[str]]) -> str | None:
    """'dependency failed: job 34 (x-train) ended FAILED' for a child that Slurm ended because a parent did not
    complete (--kill-on-invalid-dep: the child shows only CANCELLED)."""
    for parent in _parents(entry):
        rec = records.get(parent)
        if rec is not None and rec.final and rec.state != "COMPLETED" and not reused(rec, slurm):
            named = f" ({names[parent]})" if parent in names else ""
            return f"dependency failed: job {parent}{named} ended {rec.state}"
    return None


def status_rows(root: Path, last: int) -> list[dict[str, Any]]:
    """One row per job or array task of the last `last` registry entries: what Slurm says and what the logs say."""
    entries = _registry(root)[-last:]
    if not entries:
        return []
    parents = [p for e in entries for p in _parents(e)]
    # an array's pending tasks are one line (BASE_[a-b]) that only the array's own id finds
    arrays = [e["job_id"].split("_")[0] for e in entries if "_" in e["job_id"]]
    records = accounting.sacct(list(dict.fromkeys([e["job_id"] for e in entries] + parents + arrays)))
    everything = _registry_quiet(root)
    names, slurm = {e["job_id"]: e["name"] for e in everything}, slurm_names(everything)
    rows = []
    for e in entries:
        ids = [k for k in records if k == e["job_id"] or k.startswith(e["job_id"] + "_")] or [e["job_id"]]
        for jid in ids:
            rec = accounting.record_for(records, jid)
            texts = [_tail(p) for p in diagnose.log_files(Path(e["run_dir"]), jid)]
            step = diagnose.last_step(texts)
            why = reused(rec, slurm)
            if why:  # another job's state, exit code and times are not this run's: none of them is shown
                rec, state = None, REUSED
            else:
                state = rec.state if rec else "UNKNOWN"
            if rec and rec.state not in ("COMPLETED", "RUNNING", "PENDING"):
                failed = _dependency_failed(e, records, names, slurm) if rec.state == "CANCELLED" else None
                why = failed or diagnose.diagnose(texts)
            rows.append({"job": jid, "name": e["name"], "kind": str(e.get("kind", "")),
                         "state": state, "exit": rec.exit_code if rec else "",
                         "elapsed": rec.elapsed if rec else "", "restarts": rec.restarts if rec else None,
                         "last_step": step, "diagnosis": why, "run_dir": e["run_dir"],
                         "dependency": e.get("dependency")})
    return rows


# status reads this much of the end of each log: what it shows (the last step, why the job ended) is there, and a
# long job's logs (every rank's) would otherwise be read whole for each row
LOG_TAIL_BYTES = 256 * 1024


def _tail(path: Path, size: int = LOG_TAIL_BYTES) -> str:
    """The last `size` bytes of a log as text, from its first whole line."""
    with open(path, "rb") as f:
        start = max(f.seek(0, os.SEEK_END) - size, 0)
        f.seek(start)
        data = f.read(size)
    if start > 0:  # cut inside a line (or a character): that line starts before what is read
        data = data.partition(b"\n")[2]
    return data.decode("utf-8", errors="replace")


def _registry_quiet(root: Path) -> list[dict[str, Any]]:
    """The registry again, without a second warning about its malformed lines."""
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()):
        return _registry(root)


def status(args: argparse.Namespace) -> int:
    root = _run_root(args)
    rows = status_rows(root, args.last)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no jobs recorded under {shown(root)}")
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # rich reads strings as markup: a log line's "[enforce fail at x.cc:603]" would vanish or raise; data is escaped
    table = Table(title=escape(f"mcorekit jobs ({shown(root)})"))
    for col in ("job", "name", "kind", "state", "exit", "elapsed", "restarts", "last step", "diagnosis"):
        table.add_column(col)
    for r in rows:
        cells = (r["job"], r["name"], r["kind"], r["state"], r["exit"], r["elapsed"], r["restarts"], r["last_step"],
                 r["diagnosis"])
        table.add_row(*(escape("" if c is None else str(c)) for c in cells))
    Console(width=200).print(table)
    return 0


# ---------------------------------------------------------------- logs


PRINT_CHUNK = 1 << 20  # logs prints a log in pieces of this many bytes: never the whole file in memory


def _print_new(path: Path, pos: int) -> int:
    """Print what was appended to path since byte pos; the new position."""
    if not path.exists():
        return pos
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split between pieces stays whole
    with open(path, "rb") as f:
        f.seek(pos)
        while chunk := f.read(PRINT_CHUNK):
            sys.stdout.write(decoder.decode(chunk))
            pos += len(chunk)
    sys.stdout.write(decoder.decode(b"", final=True))
    sys.stdout.flush()
    return pos


def _slurm_record(job: str, names: dict[str, set[str]]) -> accounting.JobRecord | None:
    """accounting.job_record; a LaunchError when Slurm's job of that id is another one than the registry's."""
    rec = accounting.job_record(job)
    if why := reused(rec, names):
        raise LaunchError(f"{why}; its state says nothing about this project's job")
    return rec


def _follow(job: str, path: Path, wait_s: float, names: dict[str, set[str]]) -> int:
    """Print the log as it grows until the job ends: exit 0 if it COMPLETED, 1 if it ended otherwise (after the
    log's last lines and one line saying how it ended). Stops with an error when Slurm knows no such job or task,
    or when the log has not appeared after wait_s seconds while the job is pending or running."""
    pos, start, unknown_since, said_pending = 0, time.monotonic(), None, False
    while True:
        pos = _print_new(path, pos)
        rec = _slurm_record(job, names)
        now = time.monotonic()
        if rec is None:
            unknown_since = unknown_since or now
            if now - unknown_since >= UNKNOWN_GRACE_S:
                raise LaunchError(f"job {job}: Slurm has no such job or array task (never submitted, or purged from "
                                  f"accounting); check the id with `mcorekit status`")
        elif rec.final:
            _print_new(path, pos)  # the last lines, written just before the end
            if not path.exists():
                raise LaunchError(f"{shown(path)}: no log, and job {job} has ended {rec.state}; check --rank "
                                  f"(tasks count from 0)")
            if rec.state == "COMPLETED":
                return 0
            print(f"mcorekit: job {job} ended {rec.state} (exit code {rec.exit_code or 'unknown'}); "
                  f"`mcorekit status` shows a diagnosis", file=sys.stderr)
            return 1
        else:
            unknown_since = None
            if not path.exists() and now - start >= wait_s:
                raise LaunchError(f"{shown(path)}: no log after {wait_s:g} s while job {job} is {rec.state}; check --rank "
                                  f"(tasks count from 0), or follow again later / with a longer --wait")
            if rec.state == "PENDING" and not said_pending:
                print(f"mcorekit: job {job} is pending; waiting up to {wait_s:g} s for its log", file=sys.stderr)
                said_pending = True
        time.sleep(POLL_S)


def task_count(run_dir: Path, job: str) -> int | None:
    """How many tasks (ranks) the job runs, from the sbatch script submitit kept for it (logs/JOB_submission.sh;
    an array's tasks share BASE_submission.sh): --nodes x --ntasks-per-node. None when the script is not there."""
    script = run_dir / "logs" / f"{job.split('_')[0]}_submission.sh"
    try:
        text = script.read_text(errors="replace")
    except OSError:
        return None
    nodes = re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M)
    per_node = re.search(r"^#SBATCH --ntasks-per-node=(\d+)$", text, re.M)
    return int(nodes.group(1) if nodes else 1) * int(per_node.group(1) if per_node else 1)


def _check_rank(job: str, rank: int, run_dir: Path) -> None:
    tasks = task_count(run_dir, job)
    if tasks is not None and rank >= tasks:
        ranks = "rank 0" if tasks == 1 else f"ranks 0-{tasks - 1}"
        raise LaunchError(f"job {job} has {tasks} task{'s' if tasks > 1 else ''} ({ranks}); --rank {rank} is not one of them")


def logs(args: argparse.Namespace) -> int:
    root = _run_root(args)
    entries = _registry(root)
    owned, names = Owned.of(entries), slurm_names(entries)
    base, task = JOB_ID_RE.fullmatch(args.job).groups()
    entry = owned.entry(int(base), None if task is None else int(task))
    if entry is None:
        raise LaunchError(_not_ours(args.job, owned, root / REGISTRY))
    if task is None and int(base) not in owned.jobs:
        tasks = owned.task_ids(int(base))
        raise LaunchError(f"job {base} is an array: name one task, {base}_{tasks[0]} to {base}_{tasks[-1]} "
                          f"(mcorekit logs {base}_{tasks[0]})")
    _check_rank(args.job, args.rank, Path(entry["run_dir"]))
    path = Path(entry["run_dir"]) / "logs" / f"{args.job}_{args.rank}_log.{'err' if args.stderr else 'out'}"
    if args.follow:
        return _follow(args.job, path, args.wait, names)
    if not path.exists():
        rec = _slurm_record(args.job, names)
        if rec is None:
            raise LaunchError(f"job {args.job}: Slurm has no such job or array task; check the id with `mcorekit status`")
        if rec.final:
            raise LaunchError(f"job {args.job} finished ({rec.state}), no log for rank {args.rank} ({shown(path)} was "
                              f"never written: the job ended before that task started)")
        raise LaunchError(f"{shown(path)}: no log yet (job {args.job} is {rec.state}; try --follow)")
    _print_new(path, 0)
    return 0


# ---------------------------------------------------------------- cancel


def parse_cancel_ids(text: str) -> list[tuple[str, int, list[int] | None]]:
    """'12_0,13,14_[1-3,5]' -> [(item, job, tasks or None for the whole job)]; commas inside [] belong to the range."""
    items = []
    for item in re.split(r",(?![^\[]*\])", text):
        m = CANCEL_ID_RE.fullmatch(item.strip())
        if m is None:
            raise LaunchError(f"{item!r} is not a job id (JOB, JOB_N or JOB_[a-b,c]); nothing was cancelled")
        base, one, ranges = m.groups()
        tasks = [int(one)] if one is not None else None
        if ranges is not None:
            tasks = []
            for part in ranges.split(","):
                low, _, high = part.partition("-")
                if int(high or low) < int(low):
                    raise LaunchError(f"{item!r}: range {part} runs backwards; nothing was cancelled")
                if len(tasks) + int(high or low) - int(low) + 1 > MAX_CANCEL_TASKS:
                    raise LaunchError(f"{item!r} names more than {MAX_CANCEL_TASKS:,} array tasks; nothing was cancelled")
                tasks += range(int(low), int(high or low) + 1)
        items.append((item.strip(), int(base), tasks))
    return items


def _ended(records: dict[str, accounting.JobRecord], base: int, tasks: list[int] | None) -> str | None:
    """The final state(s) of a job, or of the named tasks of an array, when all of them have ended (COMPLETED,
    FAILED, ...), from sacct's records of job `base`; None while any still pends or runs, or when Slurm does not
    know it yet (scancel then answers)."""
    if tasks is None:
        mine = [r for k, r in records.items() if k == str(base) or k.startswith(f"{base}_")]
    else:
        mine = []
        for t in tasks:
            task_id = f"{base}_{t}"
            found = records.get(task_id) or next((r for k, r in records.items() if accounting.in_array_range(task_id, k)), None)
            if found is None:
                return None
            mine.append(found)
    if not mine or not all(r.final for r in mine):
        return None
    return "/".join(sorted({r.state for r in mine}))


def cancel(args: argparse.Namespace) -> int:
    root = _run_root(args)
    entries = _registry(root)
    owned = Owned.of(entries)
    items = [it for text in args.job for it in parse_cancel_ids(text)]
    foreign = []
    for item, base, tasks in items:  # every id is checked before scancel sees any
        if base in owned.jobs:
            continue
        if tasks is None and owned.task_ids(base):
            continue  # a whole array of ours
        missing = [t for t in (tasks or [None]) if (base, t) not in owned.tasks]
        if missing:
            foreign.append(item if tasks is None or len(missing) == len(tasks) else f"{base}_{missing[0]} (of {item})")
    if foreign:
        raise LaunchError(f"not this project's job{'s' if len(foreign) > 1 else ''}: {', '.join(foreign)} (not in "
                          f"{shown(root / REGISTRY)}); nothing was cancelled")
    ids = [item for item, _, _ in items]
    records = {base: accounting.sacct([str(base)]) for _, base, _ in items}
    names = slurm_names(entries)
    arrays = {e["job_id"].split("_")[0] for e in entries if "_" in e["job_id"]}
    # the records of the shape we submitted tell whether Slurm's job of that id is ours: an array's tasks (BASE_N,
    # which share its name), else the job BASE; accounting may also list an earlier job that had the id (a reset
    # cluster's), which is not the one queued now
    for base, found in records.items():
        for key, rec in found.items():
            if (("_" in key) == (str(base) in arrays) and key.split("_")[0] == str(base)
                    and (why := reused(rec, names))):
                raise LaunchError(f"{why}; nothing was cancelled")
    states = {item: _ended(records[base], base, tasks) for item, base, tasks in items}
    ended = [f"{item} already {state}" for item, state in states.items() if state]
    if ended:
        live = [item for item, state in states.items() if not state]
        hint = f" (cancel the others alone: mcorekit cancel {','.join(live)})" if live else ""
        raise LaunchError(f"job {'; '.join(ended)}; nothing was cancelled{hint}")
    proc = subprocess.run(["scancel", *ids], capture_output=True, text=True)
    if proc.returncode != 0:
        raise LaunchError(f"scancel {' '.join(ids)} failed: {' '.join(proc.stderr.split())}")
    print(f"cancelled {', '.join(ids)}")
    return 0


def main(command: str, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog=f"mcorekit {command}", description={
        "status": "Table of this project's jobs: state, elapsed, restarts, last logged step, and a diagnosis for failures.",
        "logs": "Print a job's log for one rank (task). --follow streams it until the job ends, then exits 0 if the "
                "job COMPLETED and 1 otherwise; it stops with an error if Slurm knows no such job or task, or if no "
                "log appears within --wait seconds while the job is pending or running.",
        "cancel": "Cancel jobs of this project (scancel); every id must be in the project's job registry, or "
                  "nothing is cancelled.",
    }[command])
    parser.add_argument("--cluster", type=nonempty, default="local",
                        help="profile whose run_root holds the job registry (default: local; a profile without "
                             "run_root uses $MCOREKIT_RUN_ROOT or ~/.local/state/mcorekit/runs)")
    parser.add_argument("--runs", type=nonempty, default=None, help="run root to read instead of the profile's")
    if command == "status":
        parser.add_argument("--last", type=count, default=20, help="how many recent jobs to show (>= 1)")
        parser.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of a table "
                            "(job, name, kind, state, exit, elapsed, restarts, last_step, diagnosis, run_dir, dependency)")
    elif command == "logs":
        parser.add_argument("job", type=_job_id, help="Slurm job id (an array task as ID_N)")
        parser.add_argument("--rank", type=index, default=0, help="task (rank) whose log to show, from 0")
        parser.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
        parser.add_argument("--wait", type=positive_float, default=300.0, metavar="SECONDS",
                            help="with --follow: how long to wait for the log to appear while the job is pending or "
                                 "running (default 300)")
        parser.add_argument("--stderr", action="store_true", help="show stderr instead of stdout")
    else:
        parser.add_argument("job", nargs="+", help="job ids, comma-separated or several: ID, ID_N, ID_[a-b]")
    args = parser.parse_args(argv)
    return {"status": status, "logs": logs, "cancel": cancel}[command](args)
