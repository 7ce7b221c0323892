"""Start-up and checkpoint speed on one GPU (issue "Speed", part 3): where the time from process start to the end of
step 1 goes, how fast a full checkpoint is saved and loaded next to the disk's own speed, and what an asynchronous
save costs the steps it overlaps.

    python bench/start_save.py [--shape 3b] [--dd-gb 8] [--budget 540] [--out DIR] [--dry]

Per shape (3b: the llama-3b preset, 2.6B parameters, seq 2048, micro-batch 4 x 8; a 35 GB checkpoint), in order,
never holding two checkpoints on disk (the GPU machine's disk is 64 GB):
  dd      the disk's own write and read speed: `dd` with O_DIRECT, --dd-gb GB in the --out folder, deleted after
  save    `python -m mcorekit.train` (the real entry), fresh, its torch.compile cache empty (a user's first run),
          SAVE_STEPS steps, then its end-of-run save (synchronous): the
          start-up phases (its `mcorekit.train: startup` line), the save's seconds and GB/s (its `mcorekit.train:
          checkpoint` line: bytes on disk / seconds), and how long the process lived on after the save ended
  async   the same entry continuing from that checkpoint (its page cache dropped first, so the load reads the disk):
          a run of its own (its own checkpoint folder) whose checkpoint.load is the save run's folder, the whole
          state (finetune: false), as a resume loads it (its records are checked at the start, in the `dist_init`
          phase, where a resume checks them in `resume`); it cannot be the save run resumed, which refuses a
          changed schedule.train_iters (train/run_inputs.py),
          the compile cache the save run left (warm: a later or requeued run; start-up less the load),
          with checkpoint.async_save=true: the load's seconds and GB/s (the `resume` phase), an asynchronous save
          at step ASYNC_AT and the end-of-run save at ASYNC_END. Step times (log_interval 1) of the steps that ran
          while the first save was in flight against the steady ones without (the loop's step times leave a save's
          own time, its blocking part included, out: train/loop.py).
          Bench-only patches keep the disk to one checkpoint: the loaded one is deleted once loaded, each saved
          one once finalized (its time taken out of the step that finalized it: deletions).
Prints a Markdown table and writes results.json (after every part, so a run cut short keeps what it measured).
--dry writes and validates the experiment files only (tests/test_start_save_bench.py runs it on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from results import compile_env, compile_summary, startup_marks
from train_bench import SHAPES, write_config

SHAPES.setdefault("3b", {"preset": "llama-3b", "mbs": 4})  # 2.6B parameters: a 35 GB checkpoint with its optimizer
# A process's first steps are not steady: under the step graph (the one-GPU default) two run eagerly and the third
# captures the graph. The save run's steps after them are the step time without a save; the async run (continuing at
# SAVE_STEPS) warms up again, runs steady steps, saves in the background at ASYNC_AT, keeps training while it
# writes, and ends with the final save at ASYNC_END (save_interval ASYNC_AT).
WARM_STEPS = 3
SAVE_STEPS = WARM_STEPS + 3
ASYNC_AT, ASYNC_END = 12, 24
DEADLINE = [float("inf")]  # time.time() by which every training process must have ended (--budget)

# The async run: the real entry, with the checkpoint folder kept to one checkpoint (bench only).
WORKER = r"""
import shutil, sys, time
from mcorekit.train import checkpoint
load, finalize = checkpoint.load, checkpoint.Saver._finalize
def load_then_delete(path, *args, **kwargs):
    step = load(path, *args, **kwargs)
    start = time.perf_counter()
    shutil.rmtree(path)  # measured; the disk holds one checkpoint
    print(f"bench: deleted the loaded checkpoint in {time.perf_counter() - start:.2f} s", flush=True)
    return step
def finalize_then_delete(self, path, step, *args, **kwargs):
    finalize(self, path, step, *args, **kwargs)
    start = time.perf_counter()
    shutil.rmtree(path, ignore_errors=True)  # measured: after the final save it falls in the exit's `close` phase
    print(f"bench: deleted the saved checkpoint of step {step} in {time.perf_counter() - start:.2f} s", flush=True)
checkpoint.load, checkpoint.Saver._finalize = load_then_delete, finalize_then_delete
from mcorekit.train.__main__ import main
from mcorekit.train.shutdown import exit_with
exit_with(main(sys.argv[1:]))  # as `python -m mcorekit.train` ends
"""


def bench_config(shape: str, run: str, run_dir: Path, ckpt: Path) -> Path:
    """train_bench's experiment file of this shape, with this bench's steps, checkpointing and per-step logging;
    `ckpt`: the save run's checkpoint folder, which the async run continues from into a folder of its own."""
    steps = SAVE_STEPS if run == "save" else ASYNC_END
    path = write_config(shape, "bf16", steps, run_dir, log_interval=1)
    cfg = yaml.safe_load(path.read_text())
    cfg["name"] = f"start-save-{shape}-{run}"
    if run == "save":
        cfg["checkpoint"] = {"dir": str(ckpt), "keep_last": 1, "async_save": False, "save_interval": 10**6}
    else:
        cfg["checkpoint"] = {"dir": str(async_ckpt(ckpt)), "load": str(ckpt), "finetune": False, "keep_last": 1,
                             "async_save": True, "save_interval": ASYNC_AT}
    path.write_text(yaml.safe_dump(cfg))
    return path


def async_ckpt(ckpt: Path) -> Path:
    return ckpt.with_name(ckpt.name + "-async")


def dd_speed(folder: Path, gb: int) -> dict[str, float]:
    """O_DIRECT write then read of a `gb` GB file in `folder` (no page cache either way), in GB/s."""
    f, count = folder / "dd.bin", gb * 1000 // 16  # 16 MB blocks
    speeds = {}
    for name, cmd in (("dd_write_gb_per_s", ["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={count}",
                                             "oflag=direct", "conv=fsync"]),
                      ("dd_read_gb_per_s", ["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"])):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        speeds[name] = round(count * 16 * 2**20 / 1e9 / (time.perf_counter() - start), 3)
    f.unlink()
    return speeds


def drop_page_cache(folder: Path) -> None:
    """The checkpoint's pages out of the page cache (written and fsynced, so clean): the load then reads the disk."""
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def train(cmd: list[str], run_dir: Path) -> tuple[int, str, float]:
    """(exit code, stdout then stderr, time.time() when the process had exited); output also in run_dir/log.txt.
    A shape's two processes share one torch.compile cache, new for the shape (compile_cache): the save run starts
    cold, the async run after it warm, as a user's first run and their later or requeued runs. Torch's dynamo log
    lines (TORCH_LOGS=dynamo) time what each compiled (compile_seconds)."""
    timeout = max(30.0, DEADLINE[0] - time.time())
    env = compile_env(29593, compile_cache(run_dir.parent))
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code = 124
        out = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        out += f"\nbench: killed after {timeout:.0f} s (--budget)"
    ended = time.time()
    (run_dir / "log.txt").write_text(out)
    return code, out, ended


def compile_cache(out: Path) -> Path:
    return out / "compile-cache"


def parse(out: str) -> dict[str, Any]:
    """The training process's stdout: its startup marks; its checkpoint and shutdown events and each step's line, in
    order; what torch.compile spent."""
    events: list[tuple[str, Any]] = []
    for line in out.splitlines():
        if line.startswith("mcorekit.train: shutdown "):
            events.append(("shutdown", json.loads(line.split(" ", 2)[2])))
        elif line.startswith("mcorekit.train: checkpoint "):
            events.append(("checkpoint", json.loads(line.split(" ", 2)[2])))
        elif m := re.match(r"step (\d+)/\d+ ", line):
            events.append(("step", int(m.group(1))))
    deleted = re.search(r"bench: deleted the loaded checkpoint in ([\d.]+) s", out)
    saved_deleted = {int(m.group(1)): float(m.group(2))
                     for m in re.finditer(r"bench: deleted the saved checkpoint of step (\d+) in ([\d.]+) s", out)}
    return {"startup": startup_marks(out), "events": events, "delete_s": float(deleted.group(1)) if deleted else 0.0,
            "saved_delete_s": saved_deleted, "compile": compile_summary(out)}


def step_seconds(run_dir: Path, tokens_per_step: int) -> dict[int, float]:
    """Each logged step's seconds (log_interval 1: tokens per step / tokens/s of that step's row)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"tokens_per_s"' in x]
    return {r["step"]: tokens_per_step / r["tokens_per_s"] for r in rows}


def phases(startup: dict[str, float]) -> dict[str, float]:
    """Cumulative marks -> each phase's own seconds."""
    order = ["imports", "checks", "dist_init", "model", "optimizer", "resume", "step1"]
    marks = [(k, startup[k]) for k in order if k in startup]
    return {k: round(t - (marks[i - 1][1] if i else 0.0), 2) for i, (k, t) in enumerate(marks)}


def exit_phases(events: list[tuple[str, Any]], saved_end: float, ended: float) -> dict[str, float]:
    """Where the time after the last save went: closing the run (saver, metrics), releasing torch's cached pinned
    host memory, the final barrier (`barrier`; in results from before the process groups were left to the process's
    exit, the barrier and their teardown: `destroy`), the exit handlers (atexit), and the rest (the process's exit),
    in seconds."""
    marks = next((e for kind, e in events if kind == "shutdown"), None)
    if not marks:
        return {}
    out, last = {}, saved_end
    for mark, name in (("trained", "close"), ("host_cache_released", "host_cache"), ("destroyed", "destroy"),
                       ("ranks_through", "barrier"), ("exit_handlers", "exit_handlers")):
        if mark in marks:
            out[name], last = round(marks[mark] - last, 2), marks[mark]
    out["exit"] = round(ended - last, 2)
    return out


def in_flight_steps(events: list[tuple[str, Any]], save_step: int) -> set[int]:
    """The steps logged after the async save of `save_step` was scheduled and before it was finalized."""
    steps, inside = set(), False
    for kind, e in events:
        if kind == "checkpoint" and e["step"] == save_step:
            inside = e["event"] == "scheduled"
        elif kind == "step" and inside:
            steps.add(e)
    return steps


def deletions(events: list[tuple[str, Any]], deleted: dict[int, float], steps: int) -> dict[tuple[str, int], float]:
    """The bench deletes each checkpoint once finalized, which is no cost of a save. A save is finalized in the
    loop's poll before a step (the deletion then is in that step's time) or while a later save waits for its write
    (in that save's wait). {("step", n) or ("scheduled", n) or ("saved", steps): the deletion's seconds in it}."""
    out, pending = {}, 0.0
    for kind, e in events:
        if kind == "checkpoint" and e["event"] == "saved" and e["step"] != steps:
            pending += deleted.get(e["step"], 0.0)
        elif pending and kind == "step":
            out["step", e], pending = pending, 0.0
        elif pending and kind == "checkpoint" and (e["event"] == "scheduled" or e["step"] == steps):
            out[e["event"], e["step"]], pending = pending, 0.0
    return out


def failure(log: str) -> str:
    """The end of a failed process's output, without torch's dynamo timing lines (TORCH_LOGS), which fill it."""
    return "\n".join(x for x in log.splitlines() if "torch/_dynamo/" not in x)[-1500:]


def save_run(shape: str, out: Path, ckpt: Path) -> dict[str, Any]:
    run_dir = out / f"{shape}-save"
    config = bench_config(shape, "save", run_dir, ckpt)
    code, log, ended = train([sys.executable, "-m", "mcorekit.train", "--config", str(config), "--run-dir",
                              str(run_dir)], run_dir)
    if code:
        return {"error": failure(log)}
    got = parse(log)
    saved = [e for kind, e in got["events"] if kind == "checkpoint" and e["event"] == "saved"]
    s = SHAPES[shape]
    steps = step_seconds(run_dir, s["mbs"] * 8 * 2048)
    return {"startup": got["startup"], "phases": phases(got["startup"]), **got["compile"],
            "step_s": round(statistics.mean(v for k, v in steps.items() if k > WARM_STEPS), 3),
            "save_s": saved[-1]["seconds"], "ckpt_gb": saved[-1]["gb"], "save_gb_per_s": saved[-1]["gb_per_s"],
            "exit_after_save_s": round(ended - saved[-1]["end"], 2),
            "exit_phases": exit_phases(got["events"], saved[-1]["end"], ended)}


def async_run(shape: str, out: Path, ckpt: Path) -> dict[str, Any]:
    run_dir = out / f"{shape}-async"
    config = bench_config(shape, "async", run_dir, ckpt)
    drop_page_cache(ckpt)
    code, log, ended = train([sys.executable, "-c", WORKER, "--config", str(config), "--run-dir", str(run_dir)],
                             run_dir)
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(async_ckpt(ckpt), ignore_errors=True)
    if code:
        return {"error": failure(log)}
    got = parse(log)
    ckpts = [e for kind, e in got["events"] if kind == "checkpoint"]
    scheduled = next(e for e in ckpts if e["event"] == "scheduled" and e["step"] == ASYNC_AT)
    saved = {e["step"]: e for e in ckpts if e["event"] == "saved"}
    s = SHAPES[shape]
    steps = step_seconds(run_dir, s["mbs"] * 8 * 2048)
    for (kind, n), seconds in deletions(got["events"], got["saved_delete_s"], ASYNC_END).items():
        if kind == "step":
            steps[n] -= seconds
    overlapped = in_flight_steps(got["events"], ASYNC_AT)
    busy = [v for k, v in steps.items() if k in overlapped]
    free = [v for k, v in steps.items() if k not in overlapped and k > SAVE_STEPS + WARM_STEPS]
    ph = phases(got["startup"])
    load_s = round(ph["resume"] - got["delete_s"], 2)  # the bench's deletion of the loaded checkpoint is not loading
    # nor is its deletion of the final checkpoint (in the save's finalize, after its report: the exit's `close`
    # phase) part of the run's exit
    deleted = got["saved_delete_s"].get(ASYNC_END, 0.0)
    final_end = saved[ASYNC_END]["end"] + deleted
    return {"startup": got["startup"], "phases": ph, "load_s": load_s, **got["compile"],
            "start_warm_s": round(got["startup"]["step1"] - ph["resume"], 2),  # its compile cache warm, less the load
            "async_blocking_s": scheduled["blocking_s"], "async_save_s": saved[ASYNC_AT]["seconds"],
            "async_save_gb_per_s": saved[ASYNC_AT]["gb_per_s"], "steps_in_flight": sorted(overlapped),
            "step_s_in_flight": round(statistics.mean(busy), 3) if busy else None,
            "step_s_free": round(statistics.mean(free), 3) if free else None,
            "final_save_s": saved[ASYNC_END]["seconds"], "bench_delete_final_s": deleted,
            "exit_after_final_save_s": round(ended - final_end, 2),
            "exit_phases": exit_phases(got["events"], final_end, ended)}


def load_probe(ckpt: Path) -> dict[str, Any]:
    """bench/load_probe.py on the saved checkpoint, its page cache dropped: the read-ahead thread's pread (from the
    disk), the consumer's view of each record and its copy into the GPU, and torch.load of the same bytes for
    comparison; in a process of its own, so this one never holds a CUDA context."""
    drop_page_cache(ckpt)
    (iteration,) = ckpt.glob("iter_*")
    cmd = [sys.executable, str(Path(__file__).with_name("load_probe.py")), str(iteration), "--device", "cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30.0, DEADLINE[0] - time.time()))
    if proc.returncode:
        raise RuntimeError((proc.stdout + proc.stderr).strip()[-400:])
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def measure(shape: str, out: Path, dd_gb: int, results: list[dict[str, Any]], probe: bool = False) -> None:
    r: dict[str, Any] = {"shape": shape, "preset": SHAPES[shape]["preset"]}
    results.append(r)
    ckpt = out / f"{shape}-ckpt"  # outside the run folders: the async run loads it
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(async_ckpt(ckpt), ignore_errors=True)
    shutil.rmtree(compile_cache(out), ignore_errors=True)  # each shape's first process starts cold
    parts = [("dd", lambda: dd_speed(out, dd_gb)), ("save", lambda: save_run(shape, out, ckpt)),
             ("probe", lambda: load_probe(ckpt)), ("async", lambda: async_run(shape, out, ckpt))]
    for part, run in (p for p in parts if p[0] != "probe" or probe):
        start = time.perf_counter()
        try:
            got = run()
        except Exception as e:  # noqa: BLE001 - one failed part must not lose the others' figures
            got = {"error": f"{type(e).__name__}: {e}"}
        r[part] = {**got, "wall_s": round(time.perf_counter() - start, 1)}
        print(json.dumps({"shape": shape, part: r[part]}), flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        if part == "save" and "error" in got:
            shutil.rmtree(ckpt, ignore_errors=True)
            break
    if "error" not in r.get("async", {"error": 1}) and "error" not in r["save"]:
        r["load_gb_per_s"] = round(r["save"]["ckpt_gb"] / r["async"]["load_s"], 3)
    (out / "results.json").write_text(json.dumps(results, indent=1))


def checked(path: Path, label: str) -> bool:
    """Whether the experiment file passes the project's loader and rules for one GPU (printed either way)."""
    from mcorekit.config.experiment import load_experiment
    from mcorekit.config.rules import Nodes, problems

    exp = load_experiment(path)
    if bad := problems(exp, 1, Nodes(transformer_engine=True, gpus=False)):
        print(f"{label}: {path}: {bad}", file=sys.stderr)
        return False
    print(f"{label}: {path} ok ({exp.model.preset}, {exp.schedule.train_iters} steps, "
          f"async_save={exp.checkpoint.async_save}, save_interval={exp.checkpoint.save_interval})")
    return True


def table(results: list[dict[str, Any]]) -> str:
    def cell(r: dict[str, Any], part: str, key: str, fmt: str = "{:.1f}") -> str:
        v = r.get(part, {}).get(key) if part else r.get(key)
        return "" if v is None else fmt.format(v)

    def share(r: dict[str, Any], num: tuple[str, str], den: str) -> str:
        a, b = (r.get(num[0], {}).get(num[1]) if num[0] else r.get(num[1])), r.get("dd", {}).get(den)
        return f" ({a / b * 100:.0f}% of dd)" if a and b else ""

    rows = [("start -> end of step 1 (compile cache cold), s",
             lambda r: cell({"x": r.get("save", {}).get("startup", {})}, "x", "step1"))]
    for ph in ("imports", "checks", "dist_init", "model", "optimizer", "step1"):
        rows.append((f"  {ph}, s", lambda r, ph=ph: cell({"x": r.get("save", {}).get("phases", {})}, "x", ph)))
    rows += [("  of which torch.compile (cold), s", lambda r: cell(r, "save", "compile_total_s")),
             ("start -> end of step 1, compile cache warm (async run, less its load), s",
              lambda r: cell(r, "async", "start_warm_s")),
             ("  step1 (warm), s", lambda r: cell({"x": r.get("async", {}).get("phases", {})}, "x", "step1")),
             ("  of which torch.compile (warm), s", lambda r: cell(r, "async", "compile_total_s"))]
    rows += [
        ("checkpoint, GB", lambda r: cell(r, "save", "ckpt_gb")),
        ("save (sync, end of run), s", lambda r: cell(r, "save", "save_s")),
        ("save GB/s", lambda r: cell(r, "save", "save_gb_per_s", "{:.2f}") + share(r, ("save", "save_gb_per_s"),
                                                                                    "dd_write_gb_per_s")),
        ("process lived on after the save, s", lambda r: cell(r, "save", "exit_after_save_s")),
        ("  of which close / pinned host memory / barrier (and teardown, before) / exit handlers / process exit, s",
         lambda r: " / ".join(str(v) for v in r.get("save", {}).get("exit_phases", {}).values())),
        ("load (resume), s", lambda r: cell(r, "async", "load_s")),
        ("load GB/s (page cache dropped)", lambda r: cell(r, "", "load_gb_per_s", "{:.2f}") +
         share(r, ("", "load_gb_per_s"), "dd_read_gb_per_s")),
        ("  load probe, each step alone: pread (disk) / view / copy into the GPU / torch.load (not used), GB/s",
         lambda r: " / ".join(cell(r, "probe", f"{k}_gb_per_s", "{:.2f}") for k in ("pread", "view", "copy",
                                                                                       "torch_load"))),
        ("dd O_DIRECT write / read, GB/s", lambda r: f"{cell(r, 'dd', 'dd_write_gb_per_s', '{:.2f}')} / "
                                                     f"{cell(r, 'dd', 'dd_read_gb_per_s', '{:.2f}')}"),
        ("async save: blocking part, s", lambda r: cell(r, "async", "async_blocking_s")),
        ("async save: until finalized, s", lambda r: cell(r, "async", "async_save_s")),
        (f"step s without a save (save run, steps {WARM_STEPS + 1}-{SAVE_STEPS})", lambda r: cell(r, "save", "step_s", "{:.2f}")),
        ("step s with the async save in flight (its blocking part not counted)",
         lambda r: cell(r, "async", "step_s_in_flight", "{:.2f}") + f" (steps {r.get('async', {}).get('steps_in_flight', '')})"),
        ("step s without a save in flight (async run)", lambda r: cell(r, "async", "step_s_free", "{:.2f}")),
        ("end-of-run save after the async one, s", lambda r: cell(r, "async", "final_save_s")),
        ("  the bench's own deletion of that checkpoint, after it (not counted below), s",
         lambda r: cell(r, "async", "bench_delete_final_s", "{:.2f}")),
        ("process lived on after it, s", lambda r: cell(r, "async", "exit_after_final_save_s")),
        ("  of which close / pinned host memory / barrier / exit handlers / process exit, s",
         lambda r: " / ".join(str(v) for v in r.get("async", {}).get("exit_phases", {}).values())),
    ]
    lines = ["| | " + " | ".join(r["shape"] for r in results) + " |", "|---|" + "---|" * len(results)]
    for name, get in rows:
        lines.append(f"| {name} | " + " | ".join(get(r) for r in results) + " |")
    for r in results:
        for part in ("dd", "save", "probe", "async"):
            if "error" in r.get(part, {}):
                lines.append(f"\n{r['shape']} {part} failed: {r[part]['error'].strip().splitlines()[-1][:200]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="3b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--dd-gb", type=int, default=8, help="size of dd's test file, GB")
    p.add_argument("--out", default="/tmp/mcorekit-start-save")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole bench: a training process still "
                   "running then is killed (its part reports what it printed), so one GPU call always returns")
    p.add_argument("--dry", action="store_true", help="write and validate the experiment files, train nothing")
    p.add_argument("--load-probe", action="store_true", help="between the save and the async run, time the load's "
                   "host steps on the saved checkpoint (bench/load_probe.py, targets on the GPU, page cache dropped)")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = a.shape.split(",")
    if bad := [s for s in shapes if s not in SHAPES]:
        p.error(f"unknown shape(s) {bad}: {', '.join(SHAPES)}")
    if a.dry:
        for shape in shapes:
            for run in ("save", "async"):
                if not checked(bench_config(shape, run, out / f"{shape}-{run}", out / f"{shape}-ckpt"),
                               f"{shape} {run}"):
                    return 1
        return 0
    DEADLINE[0] = time.time() + a.budget
    results: list[dict[str, Any]] = []
    for shape in shapes:
        measure(shape, out, a.dd_gb, results, a.load_probe)
    print(table(results))
    return 0 if all("error" not in r.get(part, {}) for r in results for part in ("dd", "save", "probe", "async")) else 1


if __name__ == "__main__":
    sys.exit(main())
