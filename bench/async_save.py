"""What an asynchronous checkpoint save costs a training run on one GPU, with its copy staged on the GPU (the
default where the GPU has room: train/checkpoint_writer.room_on_gpu) next to staged in pinned host memory
(Megatron-Core's staging, the fallback), in one command on one machine.

    python bench/async_save.py [--shape 3b] [--steps 25] [--every 10] [--staging gpu,host] [--out DIR] [--dry]

Per staging, one fresh `mcorekit.train` process (start_save's worker: the real entry, each checkpoint deleted once
finalized so the disk holds one) on start_save's async experiment file, `--steps` steps with an async save every
`--every` steps and the end-of-run save (written at once). For each save: the loop's blocking part, where it was
staged, seconds until finalized and GB/s, how long it first waited for the previous background write; the mean
step time while a save was in flight (less its blocking part and its wait) against the steps without one; the
end-of-run save, its wait, and how long the process lived on after it (and where: start_save.exit_phases); peak GPU
memory (max_memory_allocated). The bench's deletions of finalized checkpoints are taken out of the steps and waits
that hold them (deletions). The `host` run stages in host memory through a bench-only patch (room_on_gpu answering
no); `gpu-nohint` stages on the GPU without the writer's writeback hints (WRITEBACK_BYTES out of reach);
`gpu-8conn` stages on the GPU with CUDA_DEVICE_MAX_CONNECTIONS=8 instead of 1 (with one, the writer's copies wait
for the step queued before them: bench/writer_probe.py). Prints a Markdown table and writes results.json after each
run. --dry writes and validates the experiment file only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from start_save import (DEADLINE, SHAPES, WARM_STEPS, WORKER, bench_config, checked, deletions, exit_phases,
                        in_flight_steps, parse, step_seconds, train)

HOST_STAGING = "from mcorekit.train import checkpoint_writer as w\nw.room_on_gpu = lambda nbytes, queue: False\n"
# bench-only patches before the worker: the run's staging, "gpu" being the defaults
STAGINGS = {"gpu": "", "host": HOST_STAGING,
            # staged on the GPU, the writer not handing what it wrote to the kernel's writeback as it goes
            "gpu-nohint": "from mcorekit.train import checkpoint_writer as w\nw.WRITEBACK_BYTES = 1 << 62\n",
            # staged on the GPU, CUDA's default of 8 hardware queues instead of the 1 that jobs are given (read when
            # the CUDA context is made, after this)
            "gpu-8conn": "import os\nos.environ['CUDA_DEVICE_MAX_CONNECTIONS'] = '8'\n"}


def experiment(shape: str, run_dir: Path, ckpt: Path, steps: int, every: int) -> Path:
    """start_save's async experiment file, started fresh (nothing in `ckpt`), with these steps and saves."""
    path = bench_config(shape, "async", run_dir, ckpt)
    cfg = yaml.safe_load(path.read_text())
    cfg["schedule"]["train_iters"], cfg["checkpoint"]["save_interval"] = steps, every
    # its own folder, nothing to continue from (start_save's async run continues from the save run's checkpoint)
    cfg["checkpoint"]["dir"] = str(ckpt)
    for key in ("load", "finetune"):
        cfg["checkpoint"].pop(key)
    cfg["name"] = f"async-save-{shape}"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(shape: str, staging: str, out: Path, steps: int, every: int) -> dict[str, Any]:
    run_dir, ckpt = out / f"{shape}-{staging}", out / f"{shape}-{staging}-ckpt"
    config = experiment(shape, run_dir, ckpt, steps, every)
    worker = STAGINGS[staging] + WORKER
    shutil.rmtree(ckpt, ignore_errors=True)  # a fresh start
    code, log, ended = train([sys.executable, "-c", worker, "--config", str(config), "--run-dir", str(run_dir)],
                             run_dir)
    shutil.rmtree(ckpt, ignore_errors=True)
    if code:
        return {"error": log[-1500:]}
    return summary(shape, log, run_dir, steps, ended)


def summary(shape: str, log: str, run_dir: Path, steps: int, ended: float) -> dict[str, Any]:
    """The figures of one run from its output (`log`), its metrics.jsonl and the time its process ended."""
    got = parse(log)
    ckpts = [e for kind, e in got["events"] if kind == "checkpoint"]
    saved = {e["step"]: e for e in ckpts if e["event"] == "saved"}
    step_s = step_seconds(run_dir, SHAPES[shape]["mbs"] * 8 * 2048)
    deleted = deletions(got["events"], got["saved_delete_s"], steps)
    for (kind, n), seconds in deleted.items():
        if kind == "step":
            step_s[n] -= seconds
    saves, busy, flight = [], [], set()
    for e in (e for e in ckpts if e["event"] == "scheduled"):
        overlapped = in_flight_steps(got["events"], e["step"])
        flight |= overlapped
        # the save's blocking part and its wait for the previous write are reported on their own: the loop's step
        # times leave them out (train/loop.py); the bench's deletion in that wait is no part of it
        waited = e.get("waited_for_previous_s", 0.0) - deleted.get(("scheduled", e["step"]), 0.0)
        busy += [step_s[k] for k in overlapped if k in step_s]
        done = saved.get(e["step"], {})
        saves.append({"step": e["step"], "staged_on": e.get("staged_on"), "blocking_s": e["blocking_s"],
                      "waited_for_previous_s": round(waited, 2), "seconds": done.get("seconds"),
                      "gb_per_s": done.get("gb_per_s")})
    free = [v for k, v in step_s.items() if k not in flight and k > WARM_STEPS + 1 and k < steps]
    final = saved[steps]
    final_end = final["end"] + got["saved_delete_s"].get(steps, 0.0)  # the bench's deletion is not the run's exit
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"mem_gb"' in x]
    return {"saves": saves, "gb": final["gb"], "step_s_free": round(statistics.mean(free), 3) if free else None,
            "step_s_in_flight": round(statistics.mean(busy), 3) if busy else None, "final_save_s": final["seconds"],
            "final_waited_for_previous_s": round(final.get("waited_for_previous_s", 0.0)
                                                 - deleted.get(("saved", steps), 0.0), 2),
            "exit_after_final_save_s": round(ended - final_end, 2),
            "exit_phases": exit_phases(got["events"], final_end, ended),
            "peak_mem_gb": round(max(r["mem_gb"] for r in rows), 1) if rows else None}


def table(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    lines = ["| | " + " | ".join(f"{n} run" for n in names) + " |", "|---|" + "---|" * len(names)]

    def row(label: str, get: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(get(results[n]) for n in names) + " |")

    for i in range(max((len(r.get("saves", [])) for r in results.values()), default=0)):
        def save(r: dict[str, Any], key: str, i: int = i) -> str:
            s = r.get("saves", [])
            return "" if i >= len(s) or s[i].get(key) is None else str(s[i][key])
        row(f"async save {i + 1}: step", lambda r: save(r, "step"))
        row("  staged on", lambda r: save(r, "staged_on"))
        row("  loop blocked, s", lambda r: save(r, "blocking_s"))
        row("  first waited for the previous write, s", lambda r: save(r, "waited_for_previous_s"))
        row("  until finalized, s / GB/s", lambda r: f"{save(r, 'seconds')} / {save(r, 'gb_per_s')}")
    row("step s without a save in flight", lambda r: str(r.get("step_s_free", "")))
    row("step s with one in flight (less the blocking part and the wait)", lambda r: str(r.get("step_s_in_flight", "")))
    row("end-of-run save, s (first waited for the previous write, s)",
        lambda r: f"{r.get('final_save_s', '')} ({r.get('final_waited_for_previous_s', '')})")
    row("process lived on after it, s", lambda r: str(r.get("exit_after_final_save_s", "")))
    row("  close / pinned host memory / barrier / exit handlers / process exit, s",
        lambda r: " / ".join(str(v) for v in r.get("exit_phases", {}).values()))
    row("peak GPU memory (max allocated), GB", lambda r: str(r.get("peak_mem_gb", "")))
    for n, r in results.items():
        if "error" in r:
            lines.append(f"\n{n} failed: {r['error'].strip().splitlines()[-1][:200]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="3b", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--every", type=int, default=10, help="an async save every this many steps")
    p.add_argument("--staging", default="gpu,host", help=f"comma-separated, of {', '.join(STAGINGS)}; in this order")
    p.add_argument("--out", default="/tmp/mcorekit-async-save")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole bench (a process still running "
                   "then is killed), so one GPU call always returns")
    p.add_argument("--dry", action="store_true", help="write and validate the experiment file, train nothing")
    a = p.parse_args(argv)
    stagings = a.staging.split(",")
    if bad := [s for s in stagings if s not in STAGINGS]:
        p.error(f"unknown staging {bad}: {', '.join(STAGINGS)}")
    if not WARM_STEPS + 2 < a.every < a.steps:
        p.error(f"--every must lie between {WARM_STEPS + 2} and --steps: steady steps come first")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.dry:
        path = experiment(a.shape, out / f"{a.shape}-dry", out / f"{a.shape}-dry-ckpt", a.steps, a.every)
        return 0 if checked(path, a.shape) else 1
    DEADLINE[0] = time.time() + a.budget
    results: dict[str, dict[str, Any]] = {}
    for staging in stagings:
        start = time.perf_counter()
        try:
            results[staging] = run(a.shape, staging, out, a.steps, a.every)
        except Exception as e:  # noqa: BLE001 - one failed run must not lose the other's figures
            results[staging] = {"error": f"{type(e).__name__}: {e}"}
        results[staging]["wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps({staging: results[staging]}), flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
