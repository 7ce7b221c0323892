"""Generate docs/results.md and its plots from the committed results under docs/results/.

    .venv/bin/python tools/results_page.py            # rewrite docs/results.md and docs/results/*.png
    .venv/bin/python tools/results_page.py --check    # exit 1 if docs/results.md is not what the data gives
    .venv/bin/python tools/results_page.py --out DIR  # write DIR/results.md and DIR/results/*.png instead

Each measurement is one folder docs/results/NAME/ holding
  meta.json     title, section, order, kind (how to read results.json), date, commit (null when none was
                recorded; then recorded_in names the commit that added the figures to the docs), hardware,
                software, command (a list of command lines), source (where the numbers come from), notes;
                superseded_by: NAME of a newer measurement of the same thing (then the page gives one line);
                start_save only: in_flight_counts_blocking, true for data of bench/start_save.py before `ff2d94f`
                (its step_s_in_flight counted the async save's blocking part; from `ff2d94f` on it leaves it out);
                unusable: {"async_step_cost": why}, for a run whose step times cannot be compared
  results.json  the numbers: what the benchmark script wrote, or a transcription in the same shape
  */metrics.jsonl, *.log, config.yaml: the runs' own files, where they came back (loss curves are drawn from
                metrics.jsonl)
To add a measurement: copy its results.json (and metrics.jsonl) into a new folder, write meta.json, mark the one
it replaces with superseded_by, run this script, commit the folder, the page and the PNGs together.
tests/test_results_page.py fails when docs/results.md differs from what this script generates.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "results"
BENCH = ROOT / "bench"  # the benchmarks whose own table functions render their results

SECTIONS = [
    ("train", "Training throughput on one GPU"),
    ("scaling", "Two GPUs: scaling and communication overlap"),
    ("correctness", "Correctness on GPUs"),
    ("convert", "Checkpoint conversion"),
    ("data", "Data preprocessing"),
]
SHAPE_LABELS = {"dense": "dense 0.89B", "moe": "MoE 8x top-2", "dense-3b": "dense 3B, seq 4096"}
RUN_LABELS = {"hf-bf16": "HF transformers bf16", "bf16": "mcorekit bf16", "bf16-te-experts": "mcorekit bf16, TE experts"}


# ---------------------------------------------------------------- reading


class Measurement:
    def __init__(self, folder: Path):
        self.name = folder.name
        self.folder = folder
        self.meta: dict[str, Any] = json.loads((folder / "meta.json").read_text())
        self.results: Any = json.loads((folder / "results.json").read_text())
        for key in ("title", "section", "kind", "date", "hardware", "command", "source"):
            if key not in self.meta:
                raise SystemExit(f"results_page: {folder / 'meta.json'}: no {key!r}")
        if self.meta["section"] not in dict(SECTIONS):
            raise SystemExit(f"results_page: {folder / 'meta.json'}: unknown section {self.meta['section']!r}")
        if self.meta["kind"] not in KINDS:
            raise SystemExit(f"results_page: {folder / 'meta.json'}: unknown kind {self.meta['kind']!r}")
        if not self.meta.get("commit") and not self.meta.get("recorded_in"):
            raise SystemExit(f"results_page: {folder / 'meta.json'}: neither commit nor recorded_in")

    @property
    def commit_text(self) -> str:
        if self.meta.get("commit"):
            return f"commit `{self.meta['commit']}`"
        return f"no commit recorded (figures added to the docs in `{self.meta['recorded_in']}`)"

    def metrics(self) -> dict[str, list[dict]]:
        """Each run's metrics.jsonl (NAME/RUN/metrics.jsonl), by run folder name."""
        out = {}
        for path in sorted(self.folder.glob("*/metrics.jsonl")):
            out[path.parent.name] = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return out


def load(data: Path) -> list[Measurement]:
    ms = [Measurement(d) for d in sorted(data.iterdir()) if d.is_dir() and (d / "meta.json").is_file()]
    names = {m.name for m in ms}
    for m in ms:
        if m.meta.get("superseded_by") and m.meta["superseded_by"] not in names:
            raise SystemExit(f"results_page: {m.name}: superseded_by {m.meta['superseded_by']!r} is no folder here")
    return ms


# ---------------------------------------------------------------- formatting


def k(x: float) -> str:
    return f"{x / 1e3:.1f}k"


def pct(x: float, digits: int = 1) -> str:
    return f"{x * 100:.{digits}f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def provenance(m: Measurement, full: bool = True) -> str:
    """The line above every table: date, commit, hardware (tests/test_results_page.py reads it); then the command
    and the source, unless `full` is False (a further table of the same run)."""
    line = f"Measured {m.meta['date']} · {m.commit_text} · on {m.meta['hardware']}"
    if not full:
        return line + " · the same run as above."
    if m.meta.get("software"):
        line += f" · {m.meta['software']}"
    out = [line + ".", "", "```bash", *m.meta["command"], "```",
           f"Source: {m.meta['source']}; data in [results/{m.name}/](results/{m.name}/)."]
    return "\n".join(out)


def notes(lines: list[str]) -> str:
    return "\n\n".join(lines)


def shape_label(r: dict) -> str:
    return r.get("shape_label") or SHAPE_LABELS.get(r["shape"], r["shape"])


def run_label(r: dict) -> str:
    if "label" in r:
        return r["label"]
    run = r["run"]
    if run.startswith("fp8-"):
        return f"mcorekit FP8 {run.removeprefix('fp8-')}"
    return RUN_LABELS.get(run, f"mcorekit {run}")


# ---------------------------------------------------------------- kinds: table, headline


def train_bench_rows(m: Measurement) -> list[dict]:
    return [r for r in m.results if "error" not in r]


def train_bench_table(m: Measurement) -> str:
    rows = train_bench_rows(m)
    hf = {r["shape"]: r["tokens_per_s"] for r in rows if r["run"] == "hf-bf16"}
    one = {(r["shape"], r["run"]): r["tokens_per_s"] for r in rows if r.get("gpus", 1) == 1}
    multi = any(r.get("gpus", 1) > 1 for r in rows)
    layouts = m.meta.get("layouts", {})
    header = ["shape", "run"]
    if multi:
        header += ["GPUs", "layout", "tokens/s per GPU"]
    else:
        header += ["tokens/s"]
    header += ["MFU", "peak mem GB"]
    if hf:
        header.append("vs HF bf16")
    if multi:
        header.append("scaling vs 1 GPU")
    if any("loss_first" in r for r in rows):
        header.append("loss first -> last")
    out = []
    for r in rows:
        gpus = r.get("gpus", 1)
        cells = [shape_label(r), run_label(r)]
        if multi:
            cells += [str(gpus), layouts.get(str(gpus), "")]
        cells += [k(r["tokens_per_s"]), pct(r["mfu"]), f"{r['mem_gb']:.1f}"]
        if hf:
            cells.append(f"{r['tokens_per_s'] / hf[r['shape']]:.2f}x" if r["shape"] in hf else "")
        if multi:
            single = one.get((r["shape"], r["run"]))
            cells.append(f"{r['tokens_per_s'] / single * 100:.0f}%" if single and gpus > 1 else "")
        if "loss first -> last" in header:
            loss = f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}" if "loss_first" in r else ""
            if loss and "steps" in r:
                loss += f" ({r['steps']} steps)"
            cells.append(loss)
        out.append(cells)
    return table(header, out)


def train_bench_headline(m: Measurement) -> str:
    rows = train_bench_rows(m)
    hf = {r["shape"]: r["tokens_per_s"] for r in rows if r["run"] == "hf-bf16"}
    if any(r.get("gpus", 1) > 1 for r in rows):
        one = {r["run"]: r["tokens_per_s"] for r in rows if r.get("gpus", 1) == 1}
        parts = [f"{r.get('gpus', 1)} GPU{'s' if r.get('gpus', 1) > 1 else ''} {k(r['tokens_per_s'])}" for r in rows]
        last = rows[-1]
        return (f"{shape_label(rows[0])} bf16, tokens/s per GPU: " + ", ".join(parts)
                + f" ({last['tokens_per_s'] / one[last['run']] * 100:.0f}% of 1 GPU)")
    parts = []
    for r in rows:
        if r["run"] == "hf-bf16":
            continue
        ratio = f" ({r['tokens_per_s'] / hf[r['shape']]:.2f}x HF)" if r["shape"] in hf else ""
        parts.append(f"{r['shape']} {r['run']} {k(r['tokens_per_s'])}{ratio}")
    return "tokens/s: " + ", ".join(parts)


def overlap_table(m: Measurement) -> str:
    rows = [[r["run"], r.get("layout") or ", ".join(f"{a}={b}" for a, b in r["parallel"].items()),
             f"{r['step_ms']:.1f}", k(r["tokens_per_s_per_gpu"]), pct(r["mfu"]), f"{r['comm_ms']:.1f}",
             pct(r["hidden_frac"], 0), f"{r['exposed_ms']:.1f}"] for r in m.results if "error" not in r]
    return table(["run", "layout", "step ms", "tokens/s/GPU", "MFU", "comm ms/step (GPU 0)", "hidden", "exposed ms"], rows)


def overlap_headline(m: Measurement) -> str:
    return "exposed communication per step: " + ", ".join(f"{r['run']} {r['exposed_ms']:.1f} ms of {r['step_ms']:.0f}"
                                                          for r in m.results if "error" not in r)


def moe_profile_table(m: Measurement) -> str:
    rows = [[r["variant"], f"{r['step_ms']:.1f} ms", f"{r['gpu_busy_ms']:.1f} ms ({pct(r['gpu_busy_frac'], 0)})",
             f"{r['kernels']:,}", r["host_waits"]] for r in m.results]
    return table(["variant", "step (profiled)", "GPU busy per step", "kernels per step", "host waits on GPU per step"], rows)


def moe_profile_headline(m: Measurement) -> str:
    first, last = m.results[0], m.results[-1]
    if len(m.results) == 1:
        return (f"GPU busy {first['gpu_busy_ms']:.0f} ms ({pct(first['gpu_busy_frac'], 0)}) of a {first['step_ms']:.0f} ms "
                f"profiled step, {first['kernels']:,} kernels ({first['variant']}): the host sets the pace")
    return (f"GPU busy {pct(first['gpu_busy_frac'], 0)} of a step with TE's experts, "
            f"{pct(last['gpu_busy_frac'], 0)} with torch._grouped_mm: the host sets the pace")


def levers_row(rows: list[dict], run: str) -> dict | None:
    """The row of one run of bench/levers.py (hf-bf16: transformers; base: the defaults), if it ran."""
    return next((r for r in rows if r["run"] == run), None)


def levers_table(m: Measurement) -> str:
    """bench/levers.py: one row per lever, each process with an empty compile cache (its start is cold)."""
    rows = train_bench_rows(m)
    hf, base = levers_row(rows, "hf-bf16"), levers_row(rows, "base")
    out = []
    for r in rows:
        cold = r.get("cold_step1_s")
        out.append([run_label(r), k(r["tokens_per_s"]), pct(r["mfu"]), f"{r['mem_gb']:.1f}",
                    f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf else "",
                    f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "",
                    f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}", "" if cold is None else f"{cold:.1f}",
                    f"{r['compile_total_s']:.1f}" if "compile_total_s" in r else ""])
    return table(["lever", "tokens/s", "MFU", "peak mem GB", "vs HF bf16", "vs defaults", "loss first -> last",
                  "cold start to step 1, s", "torch.compile, s"], out)


def levers_headline(m: Measurement) -> str:
    rows = train_bench_rows(m)
    hf, base = levers_row(rows, "hf-bf16"), levers_row(rows, "base")
    best = max((r for r in rows if r is not hf), key=lambda r: r["tokens_per_s"])
    vs_hf = f", {best['tokens_per_s'] / hf['tokens_per_s']:.2f}x transformers" if hf else ""
    if base is None:  # a run of levers without the defaults
        return f"best `{best['run']}` {k(best['tokens_per_s'])} tokens/s (MFU {pct(best['mfu'])}{vs_hf})"
    if best is base:  # no lever beat the defaults: the closest one, and by how much it trailed
        defaults = f"defaults {k(base['tokens_per_s'])} tokens/s (MFU {pct(base['mfu'])}{vs_hf})"
        others = [r for r in rows if r is not hf and r is not base]
        if not others:
            return defaults
        best = max(others, key=lambda r: r["tokens_per_s"])
        return (f"{defaults}, ahead of every lever; next `{best['run']}` {k(best['tokens_per_s'])} "
                f"({best['tokens_per_s'] / base['tokens_per_s'] - 1:+.1%})")
    return (f"defaults {k(base['tokens_per_s'])} tokens/s (MFU {pct(base['mfu'])}); best `{best['run']}` "
            f"{k(best['tokens_per_s'])} ({best['tokens_per_s'] / base['tokens_per_s'] - 1:+.1%}{vs_hf})")


def step_profile_table(m: Measurement) -> str:
    """bench/profile_step.py's summary.json: each kernel family's GPU time per step, then the longest kernels."""
    s = m.results
    families = [[kind, f"{ms:.1f}", pct(ms / s["wall_ms"])] for kind, ms in s["kernel_ms_by_kind"].items()]
    families.append(["GPU idle (waiting for the host)", f"{s['wall_ms'] - s['gpu_busy_ms']:.1f}", pct(s["gpu_idle_frac"])])
    kernels = [[f"`{x['name']}`", str(x["calls"]), f"{x['ms']:.1f}"] for x in s["top_kernels"][:10]]
    return (table(["kernel family", "ms per step", "share of the step"], families) + "\n\n"
            + table(["kernel (ten longest)", "calls per step", "ms per step"], kernels))


def step_profile_headline(m: Measurement) -> str:
    s = m.results
    parts = ", ".join(f"{kind.split(' (')[0]} {pct(ms / s['wall_ms'], 0)}" for kind, ms in s["kernel_ms_by_kind"].items())
    return f"GPU busy {pct(1 - s['gpu_idle_frac'], 0)} of a {s['wall_ms']:.0f} ms step: {parts}"


def logits_1gpu_table(m: Measurement) -> str:
    rows = [[r["model"], "yes" if r["tied"] else "no", f"{r['max_abs_diff']:.3e}", f"{r['mean_abs_diff']:.3e}",
             f"{r['cosine']:.6f}", pct(r["top1"]), str(r["near_ties_left_out"])] for r in m.results]
    return table(["model", "tied", "max abs diff", "mean abs diff", "cosine", "top-1", "near-ties left out"], rows)


def logits_1gpu_headline(m: Measurement) -> str:
    return (f"{len(m.results)} converted models: cosine >= {min(r['cosine'] for r in m.results):.6f}, "
            f"top-1 {pct(min(r['top1'] for r in m.results))}")


LAYOUTS = {"dp2": "DP2", "tp2": "TP2", "tp2-sp": "TP2 + SP", "pp2": "PP2", "pp2-vpp2": "PP2 x VPP2", "cp2": "CP2",
           "ep2": "EP2", "tp2-sp-ep2": "TP2 + SP + EP2"}


def multi_gpu_tables(m: Measurement) -> list[tuple[str, str, list[str]]]:
    res = m.results
    logits = [[r["model"], LAYOUTS.get(r["layout"], r["layout"]), f"{r['max_abs_diff']:.3e}", f"{r['mean_abs_diff']:.3e}",
               pct(r["top1"], 2), r["result"]] for r in res["logits"]]
    training = []
    for r in res["training"]:
        gn = " ".join(f"{x:.4f}" for x in r["grad_norm_1_3"])
        gn1 = " ".join(f"{x:.4f}" for x in r["one_gpu_grad_norm_1_3"])
        training.append([r["model"], LAYOUTS.get(r["layout"], r["layout"]),
                         f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}",
                         f"{r['one_gpu_loss_first']:.4f} -> {r['one_gpu_loss_last']:.4f}", f"{r['step1_diff']:.1e}",
                         f"{r['max_diff']:.1e} / {r['mean_diff']:.1e}", gn, gn1, r["result"]])
    resume = [[r["case"], f"{r['max_diff']:.1e} / {r['mean_diff']:.1e}", r["result"]] for r in res["resume"]]
    return [
        ("Converted checkpoint: logits vs transformers at every layout (fp32; CP in bf16)",
         table(["model", "layout", "max abs diff", "mean abs diff", "top-1", "result"], logits), m.meta.get("notes_logits", [])),
        ("Training from that checkpoint: losses vs one GPU (bf16)",
         table(["model", "layout", "loss first -> last", "1 GPU", "step-1 diff", "max / mean diff", "grad norm steps 1-3",
                "1 GPU", "result"], training), m.meta.get("notes_training", [])),
        ("Save and resume", table(["case", "max / mean loss diff", "result"], resume), []),
    ]


def multi_gpu_table(m: Measurement) -> str:
    return multi_gpu_tables(m)[0][1]


def multi_gpu_headline(m: Measurement) -> str:
    res = m.results
    worst = max(r["max_diff"] for r in res["training"])
    return (f"{len(res['logits'])} layouts give transformers' logits (top-1 >= {pct(min(r['top1'] for r in res['logits']), 2)}); "
            f"{len(res['training'])} layouts train like one GPU (max loss diff {worst:.1e}); {res['summary']}")


def convert_table(m: Measurement) -> str:
    res = m.results
    d = res["disk"]
    head = (f"Checkpoint {res['checkpoint_gb']:.2f} GB in {res['shards']} shards (largest {res['largest_shard_gb']:.2f} GB). "
            f"Disk (dd, O_DIRECT): write {d['write_gb_s']:.2f} GB/s, read {d['read_gb_s']:.2f} GB/s, read+write of every "
            f"byte {d['read_write_gb_s']:.2f} GB/s.\n\n")
    rows = [[r["step"], f"{r['seconds']:.1f}", f"{r['gb_s']:.2f}", pct(r["vs_disk"], 0), f"{r['peak_rss_gb']:.2f}",
             f"{r['rss_vs_largest_shard']:.1f}x"] for r in res["rows"]]
    return head + table(["step", "time (s)", "GB/s", "vs disk read+write", "peak RSS (GB)", "RSS / largest shard"], rows)


def convert_headline(m: Measurement) -> str:
    res = m.results
    return (", ".join(f"{r['label']} {r['gb_s']:.2f} GB/s ({r['peak_rss_gb']:.2f} GB RSS)" for r in res["rows"])
            + f"; the disk reads+writes at {res['disk']['read_write_gb_s']:.2f} GB/s")


def preprocess_table(m: Measurement) -> str:
    rows = [[r["method"], f"{r['seconds']:.1f}", f"{r['mb_s']:.1f}", f"{r['tokens_per_s'] / 1e3:.0f}k", f"{r['speedup']:.2f}x"]
            for r in m.results]
    return table(["method", "seconds", "MB/s", "tokens/s", "speed-up"], rows)


def preprocess_headline(m: Measurement) -> str:
    best = m.results[-1]
    return f"{best['method'].removeprefix('mcorekit data preprocess, ')}: {best['tokens_per_s'] / 1e3:.0f}k tokens/s, {best['speedup']:.2f}x a naive loop"


def size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def post_bench_base(m: Measurement) -> float | None:
    return next((r["tokens_per_s"] for r in m.results if r["case"] == "sft-full" and "error" not in r), None)


def post_bench_table(m: Measurement) -> str:
    base, out = post_bench_base(m), []
    for r in m.results:
        if "error" in r:
            out.append([r["label"], r["error"]] + [""] * 6)
            continue
        out.append([r["label"], k(r["tokens_per_s"]), f"{r['tokens_per_s'] / base:.2f}x" if base else "",
                    f"{r['step_s']:.2f}", f"{r['mem_gb']:.1f}", f"{r['trainable_params'] / 1e6:,.1f}M",
                    size(r["ckpt_bytes"]), f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}"])
    return table(["case", "tokens/s", "vs SFT full", "step s", "peak mem GB", "trainable", "checkpoint",
                  "loss first -> last"], out)


def post_bench_headline(m: Measurement) -> str:
    base, parts = post_bench_base(m), []
    for r in m.results:
        if "error" in r:
            parts.append(f"{r['case']} {r['error'].split(' (')[0]}")
        else:
            ratio = f" ({r['tokens_per_s'] / base:.2f}x)" if base and r["case"] != "sft-full" else ""
            parts.append(f"{r['case']} {k(r['tokens_per_s'])}{ratio} {r['mem_gb']:.1f} GB")
    return "tokens/s (x SFT full), peak memory: " + ", ".join(parts)


Figure = tuple[str, str, str, bool | None]  # figure, value, target, met (None: no target)


def start_save_in_flight_counts_blocking(m: Measurement) -> bool:
    """Whether the bench's step_s_in_flight counts the async save's blocking part, which the first step in flight
    carries: bench/start_save.py before `ff2d94f` counted it, from `ff2d94f` on it leaves it out. meta.json says which
    with in_flight_counts_blocking (true for data of the older bench); without it, the bench as it is now."""
    v = m.meta.get("in_flight_counts_blocking", False)
    if not isinstance(v, bool):
        raise SystemExit(f"results_page: {m.folder / 'meta.json'}: in_flight_counts_blocking must be true or false")
    return v


def start_save_shares(m: Measurement) -> dict[str, float]:
    """The figures the targets are set on: start seconds, save and load as shares of dd, async step-time cost."""
    r = m.results[0]
    save, asy, dd = r["save"], r.get("async", {}), r["dd"]
    out = {"start_s": save["startup"]["step1"], "save_of_dd_write": save["save_gb_per_s"] / dd["dd_write_gb_per_s"]}
    if "load_gb_per_s" in r:
        out["load_of_dd_read"] = r["load_gb_per_s"] / dd["dd_read_gb_per_s"]
    if "step_s_overlapped_after_blocking" in asy:
        out["async_step_cost"] = asy["step_s_overlapped_after_blocking"] / save["step_s"] - 1
    elif asy.get("step_s_in_flight") and asy.get("steps_in_flight"):
        # the first step in flight carries the save's blocking part: the steps' own time leaves it out. The bench
        # took it out itself from `ff2d94f` on; before, its mean counted it (start_save_in_flight_counts_blocking)
        n = len(asy["steps_in_flight"])
        if start_save_in_flight_counts_blocking(m):
            out["async_step_s"] = (n * asy["step_s_in_flight"] - asy["async_blocking_s"]) / n
        else:
            out["async_step_s"] = asy["step_s_in_flight"]
        out["async_step_cost"] = out["async_step_s"] / save["step_s"] - 1
    for key in m.meta.get("unusable", {}):  # meta.json says why this run's figure cannot be compared
        out.pop(key, None)
    return out


def start_save_warm_s(r: dict) -> float | None:
    """The async run's start to the end of step 1 less its resume (the load): it starts after the save run on the same
    machine, so with the compile caches the first process left (from `cf0533b` on the bench gives both one fresh cache)."""
    asy = r.get("async", {})
    if "step1" not in asy.get("startup", {}) or "resume" not in asy.get("phases", {}):
        return None
    return asy["startup"]["step1"] - asy["phases"]["resume"]


def start_save_met(m: Measurement, key: str) -> tuple[str, bool]:
    """(the target in words, whether it is met)."""
    target, got = m.meta["targets"][key], start_save_shares(m)[key]
    if key == "start_s":
        return f"<= {target} s", got <= target
    if key == "async_step_cost":
        return f"< {pct(target, 0)}", got < target
    return f">= {pct(target, 0)}", got >= target


def start_save_figures(m: Measurement) -> list[Figure]:
    r, sh = m.results[0], start_save_shares(m)
    dd, save, asy, ph = r["dd"], r["save"], r.get("async", {}), r["save"]["phases"]
    checks = f", checks {ph['checks']:.2f}" if "checks" in ph else ""
    digits = 2 if checks else 1
    rows: list[Figure] = [
        ("dd O_DIRECT write / read", f"{dd['dd_write_gb_per_s']:.2f} / {dd['dd_read_gb_per_s']:.2f} GB/s", "", None),
        ("start -> end of step 1", f"{sh['start_s']:.{digits}f} s (imports {ph['imports']:.{digits}f}{checks}, distributed "
         f"init {ph['dist_init']:.{digits}f}, model {ph['model']:.{digits}f}, optimizer {ph['optimizer']:.{digits}f}, "
         f"step 1 {ph['step1']:.{digits}f})", *start_save_met(m, "start_s")),
        ("save, synchronous, end of run", f"{save['ckpt_gb']:.1f} GB in {save['save_s']:.1f} s = "
         f"{save['save_gb_per_s']:.2f} GB/s ({pct(sh['save_of_dd_write'], 0)} of dd write)",
         *start_save_met(m, "save_of_dd_write")),
        ("process lived on after the save", f"{save['exit_after_save_s']:.1f} s", "", None),
    ]
    if compiled := save.get("compile_s"):  # the bench's compile_s: torch's dynamo lines, by function
        rows.insert(2, ("of step 1: torch.compile, by function", ", ".join(f"{k} {v:.2f}" for k, v in compiled.items())
                        + f" = {save['compile_total_s']:.1f} s", "", None))
    if (warm := start_save_warm_s(r)) is not None:
        rows.insert(2, ("start -> end of step 1, second process (torch's compile cache warm), less its load",
                        f"{warm:.1f} s (step 1 {asy['phases']['step1']:.1f})", "", None))
    if (probe := r.get("probe")) and "error" not in probe:  # bench/start_save.py --load-probe (from `38af619` on)
        rows.append(("load probe (bench/load_probe.py), page cache dropped, each step alone over all records",
                     f"pread {probe['pread_s']:.1f} s = {probe['pread_gb_per_s']:.2f} GB/s, view "
                     f"{probe['view_s']:.1f} s, copy into the GPU {probe['copy_s']:.1f} s = "
                     f"{probe['copy_gb_per_s']:.2f} GB/s; torch.load (the reader's way before `38af619`) "
                     f"{probe['torch_load_s']:.1f} s = "
                     f"{probe['torch_load_gb_per_s']:.2f} GB/s", "", None))
    if "error" in asy and "load_s" not in asy:  # failed, and no figures taken from its log afterwards
        lines = asy["error"].strip().splitlines()
        said = next((x for x in reversed(lines) if ("Error" in x and "Warning" not in x) or x.startswith("bench:")),
                    None)
        kept = "no error line in the end of its output the bench kept (see below)"
        said = said.removeprefix("[rank0]: ")[:160] if said else kept
        rows.append(("second process (continues from the checkpoint)", f"failed: {said}", "", None))
    if "load_of_dd_read" in sh:
        rows.append(("load on resume, page cache dropped", f"{asy['load_s']:.1f} s = {r['load_gb_per_s']:.2f} GB/s "
                     f"({pct(sh['load_of_dd_read'], 0)} of dd read)", *start_save_met(m, "load_of_dd_read")))
    if "step_s_overlapped_after_blocking" in asy and "async_step_cost" in sh:
        steps = ", ".join(map(str, asy["steps_overlapped_after_blocking"]))
        rows += [
            ("first async save: blocking, then in the background", f"{asy['async_blocking_s']:.2f} s, done after "
             f"{asy['async_save_s']:.1f} s ({asy['async_save_gb_per_s']:.2f} GB/s)", "", None),
            ("second async save: blocking", f"{asy['second_blocking_s']:.2f} s", "", None),
            ("step time: no save / the first async save writing", f"{save['step_s']:.2f} s / "
             f"{asy['step_s_overlapped_after_blocking']:.2f} s (steps {steps}): {sh['async_step_cost'] * 100:+.1f}%",
             *start_save_met(m, "async_step_cost")),
        ]
    elif "async_step_cost" in sh:  # the bench's own figures: steps_in_flight, the first of which carries the blocking part
        steps = ", ".join(map(str, asy["steps_in_flight"]))
        if start_save_in_flight_counts_blocking(m):
            n = len(asy["steps_in_flight"])
            in_flight = (f"the bench before `ff2d94f` counted it, {asy['step_s_in_flight']:.2f} s, so this page takes it "
                         f"out, ({n} x {asy['step_s_in_flight']:.3f} - {asy['async_blocking_s']:.2f}) / {n}")
        else:
            in_flight = "left out of the steps' own times: by the loop since `9f1752c`, by the bench before"
        rows += [
            ("first async save: blocking, then in the background", f"{asy['async_blocking_s']:.2f} s, finalized "
             f"{asy['async_save_s']:.1f} s after it began ({asy['async_save_gb_per_s']:.2f} GB/s)", "", None),
            ("step time: no save / the async save writing", f"{save['step_s']:.2f} s / {sh['async_step_s']:.2f} s "
             f"(steps {steps}, less the blocking part: {in_flight}): {sh['async_step_cost'] * 100:+.1f}%",
             *start_save_met(m, "async_step_cost")),
        ]
    if reason := m.meta.get("unusable", {}).get("async_step_cost"):
        rows.append(("step time with the async save writing", f"not usable: {reason}", "", None))
    if asy.get("final_save_s") is None:
        rows.append(("end-of-run save after an async one", "not measured", "", None))
    else:
        rows.append(("end-of-run save after an async one; process lived on after it", f"{asy['final_save_s']:.1f} s; "
                     f"{asy['exit_after_final_save_s']:.1f} s", "", None))
    return rows


def start_save_table(m: Measurement) -> str:
    met = {True: "met", False: "not met", None: ""}
    return table(["figure", m.results[0]["preset"], "target", "met?"], [[a, b, c, met[d]] for a, b, c, d in start_save_figures(m)])


def start_save_headline(m: Measurement) -> str:
    r, sh = m.results[0], start_save_shares(m)

    def verdict(key: str) -> str:
        target, ok = start_save_met(m, key)
        return f" ({'met' if ok else 'not met'}: {target})"

    parts = [f"start to end of step 1 {sh['start_s']:.1f} s" + verdict("start_s"),
             f"save {r['save']['save_gb_per_s']:.2f} GB/s, {pct(sh['save_of_dd_write'], 0)} of the disk's write"
             + verdict("save_of_dd_write")]
    if "load_of_dd_read" in sh:
        parts.append(f"load {r['load_gb_per_s']:.2f} GB/s, {pct(sh['load_of_dd_read'], 0)} of its read"
                     + verdict("load_of_dd_read"))
    if "async_step_cost" in sh:
        parts.append(f"async save: steps {pct(sh['async_step_cost'])} slower while it writes" + verdict("async_step_cost"))
    return "; ".join(parts)


def grpo_example_table(m: Measurement) -> str:
    r = m.results
    acc, gen, tok = r["accuracy"], r["generation"], r["heldout_tokens_per_s"]
    hf = tok["transformers"]
    rows = [
        ["held-out accuracy (greedy), before GRPO / after", f"{acc['before']:.3f} ({acc['correct_before']}/{acc['prompts']}) / "
         f"{acc['after']:.3f} ({acc['correct_after']}/{acc['prompts']})"],
        ["gain, in standard errors", f"{acc['after'] - acc['before']:+.3f} / {acc['stderr']:.3f} = "
         f"{(acc['after'] - acc['before']) / acc['stderr']:.1f}"],
        ["reward mean, first 5 steps -> last 5", f"{r['reward_mean_first5']:.3f} -> {r['reward_mean_last5']:.3f}"],
        ["at the end: groups with all-equal rewards, kl, response length",
         f"{r['groups_all_equal_end']:.2f}, {r['kl_end']:.4f}, {r['response_length_end']:.2f}"],
        ["generation inside training (median over steps)", f"{gen['tokens_per_s']:,.0f} tokens/s, {pct(gen['share'], 0)} of a "
         f"step, peak {gen['peak_gb']:.2f} GB"],
    ]
    rows += [[f"held-out generation, {name}", f"{v:,.0f} tokens/s ({v / hf:.2f}x transformers)"]
             for name, v in tok.items() if name != "transformers"]
    rows += [["held-out generation, transformers' generate on the converted model", f"{hf:,.0f} tokens/s"],
             ["transformers on the converted model: same completions / accuracy",
              f"{pct(r['transformers_same_completions'], 0)} / {r['transformers_accuracy']:.3f}"]]
    rows += [[f"resume after step {r['resume']['stopped_after']}: step {x['step']} reward / loss, resumed vs uninterrupted",
              f"{x['reward'][0]:.4f} / {x['loss'][0]:.5f} vs {x['reward'][1]:.4f} / {x['loss'][1]:.5f}"]
             for x in r["resume"]["steps"]]
    return table(["figure", "value"], rows)


def grpo_example_headline(m: Measurement) -> str:
    r = m.results
    acc, tok = r["accuracy"], r["heldout_tokens_per_s"]
    return (f"held-out accuracy {acc['before']:.3f} -> {acc['after']:.3f} "
            f"(+{(acc['after'] - acc['before']) / acc['stderr']:.1f} standard errors); generation "
            f"{pct(r['generation']['share'], 0)} of a step; held-out tokens/s {tok['static engine'] / 1e3:.1f}k, "
            f"{tok['static engine'] / tok['transformers']:.2f}x transformers' generate; {r['summary']}")


def save_levers_rows(m: Measurement) -> tuple[dict, list[dict]]:
    disk = next(r for r in m.results if "dd_write_gb_per_s" in r)
    return disk, [r for r in m.results if "lever" in r and "error" not in r]


def staged_label(r: dict) -> str:
    """How a lever staged the tensors in host memory (`ahead` from `916c1d7` on: copied one tensor ahead or when asked)."""
    if not r["per_tensor"]:
        return "all, pinned"
    return {True: "per tensor, one ahead, pinned", False: "per tensor, when asked"}.get(r.get("ahead"), "per tensor")


def load_levers_rows(m: Measurement) -> list[dict]:
    """The resume-load rows of bench/save_levers.py --load-levers (from `0eb02d8` on)."""
    return [r for r in m.results if "load_lever" in r and "error" not in r]


def save_levers_table(m: Measurement) -> str:
    disk, rows = save_levers_rows(m)
    on = {True: "on", False: "off"}
    out = []
    if rows:
        out.append(table(["lever", "CRC-32s", "staged", "writeback", "GB", "save s", "GB/s", "of dd write",
                          "pinned release s", "read back"],
                         [[r["lever"], on[r["crc32"]], staged_label(r), "32 MiB" if r.get("writeback") else "off",
                           f"{r['gb']:.1f}", f"{r['seconds']:.1f}", f"{r['gb_per_s']:.2f}",
                           pct(r["gb_per_s"] / disk["dd_write_gb_per_s"], 0), f"{r['release_s']:.1f}", r["read_back"]]
                          for r in rows]))
    if loads := load_levers_rows(m):
        out.append(table(["load lever (in the order run)", "GB", "load s", "GB/s", "of dd read", "loaded"],
                         [[r["load_lever"], f"{r['gb']:.1f}", f"{r['seconds']:.1f}", f"{r['gb_per_s']:.2f}",
                           pct(r["gb_per_s"] / disk["dd_read_gb_per_s"], 0), r["loaded"]] for r in loads]))
    out.append(f"dd O_DIRECT: write {disk['dd_write_gb_per_s']:.2f} GB/s, read {disk['dd_read_gb_per_s']:.2f} GB/s.")
    return "\n\n".join(out)


def lever_medians(rows: list[dict], key: str, dd: float) -> str:
    by: dict[str, list[float]] = {}
    for r in rows:  # a lever run twice: its median
        by.setdefault(r[key], []).append(r["gb_per_s"])
    return ", ".join(f"{lever} {statistics.median(v):.2f} GB/s ({pct(statistics.median(v) / dd, 0)})"
                     for lever, v in by.items())


def save_levers_headline(m: Measurement) -> str:
    disk, rows = save_levers_rows(m)
    parts = []
    if rows:
        parts.append("save GB/s (of dd write): " + lever_medians(rows, "lever", disk["dd_write_gb_per_s"]))
    if loads := load_levers_rows(m):
        parts.append("load GB/s (of dd read): " + lever_medians(loads, "load_lever", disk["dd_read_gb_per_s"]))
    return "; ".join(parts)


def exit_probe_table(m: Measurement) -> str:
    return table(["pinned GB", "how the process ends", "from ready to its end, s", "of which cudaFreeHost, s"],
                 [[f"{r['gb']:g}", r["mode"], str(r.get("end_s", r.get("error"))), str(r.get("release_s", ""))]
                  for r in m.results])


def exit_probe_headline(m: Measurement) -> str:
    big = max(r["gb"] for r in m.results)
    ends = {r["mode"]: r["end_s"] for r in m.results if r["gb"] == big and "end_s" in r}
    return f"{big:g} GB pinned: " + ", ".join(f"{mode} {s:.2f} s" for mode, s in ends.items())


def pin_probe_table(m: Measurement) -> str:
    rows = []
    for r in m.results:
        while_pinning = "" if "pin_s" not in r else (f"{r['step_ms_while_pinning']:.0f} ms (max {r['step_ms_max_while_pinning']:.0f}, "
                                                     f"{r['steps_while_pinning']} steps in {r['pin_s']:.1f} s of pinning)")
        rows.append([r["mode"], f"{r['gb']:g} GB in {r['tensors']} tensors", f"{r['step_ms_free']:.1f} ms", while_pinning,
                     f"{r['staging_blocks_s']:.2f} s"])
    return table(["mode", "GPU state", "step without pinning", "step while a thread pins", "staging copies block"], rows)


def pin_probe_headline(m: Measurement) -> str:
    by = {r["mode"]: r for r in m.results}
    cold, pre = by["cold"], by["prepin"]
    return (f"staging blocks {cold['staging_blocks_s']:.1f} s cold, {pre['staging_blocks_s']:.2f} s pinned ahead; pinning "
            f"ahead took {pre['pin_s']:.1f} s with GPU steps {pre['step_ms_while_pinning'] / pre['step_ms_free']:.0f}x slower meanwhile")


def _host_alloc(r: dict) -> str:
    threads = r["alloc_conf"].rpartition("pinned_num_register_threads:")[2]
    return f"cudaHostRegister, {threads} threads" if r["alloc_conf"] else "cudaHostAlloc (torch's default)"


def host_alloc_probe_table(m: Measurement) -> str:
    rows = [[_host_alloc(r), f"{r['stage_cold_s']:.2f} s", f"{r['stage_cached_s']:.2f} s", f"{r['release_s']:.2f} s",
             f"{r['pin_s']:.1f} s", f"{r['step_ms_while_pinning']:.1f} ms (free: {r['step_ms_free']:.1f} ms)",
             f"{r['exit_s']:.2f} s"] for r in m.results]
    return table(["pinned memory from", "staging blocks, cold", "staging blocks, cached", "handing back",
                  "pinning on a thread", "GPU step meanwhile", "process exit"], rows)


def host_alloc_probe_headline(m: Measurement) -> str:
    def slower(r: dict) -> str:
        ratio = r["step_ms_while_pinning"] / r["step_ms_free"]
        return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2f}x"

    return "; ".join(f"{_host_alloc(r)}: staging {r['stage_cold_s']:.1f} s cold, GPU steps {slower(r)} while a thread "
                     "pins" for r in m.results)


def async_run_table(m: Measurement) -> str:
    r = m.results
    rows = [["async save: the loop blocked", f"{r['async_blocking_s']:.2f} s"],
            ["async save: begun to finalized",
             f"{r['async_save_s']:.1f} s ({r['async_save_gb_per_s']:.2f} GB/s, {r['ckpt_gb']:.1f} GB)"],
            ["step without a save (steps " + ", ".join(map(str, r["steps_free"])) + ")", f"{r['step_s_free']:.3f} s"],
            ["step while the thread writes (steps " + ", ".join(map(str, r["steps_in_flight"])) + ")",
             f"{r['step_s_in_flight']:.3f} s ({(r['step_s_in_flight'] / r['step_s_free'] - 1) * 100:+.1f}%)"],
            ["end-of-run save", f"{r['final_save_s']:.1f} s ({r['final_save_gb_per_s']:.2f} GB/s)"],
            ["then: pinned memory handed back / exit handlers",
             f"{r['host_cache_s']:.2f} s / {r['exit_handlers_s']:.2f} s"]]
    return table(["3B shape, one run", "measured"], rows)


def async_run_headline(m: Measurement) -> str:
    r = m.results
    return (f"async save blocked {r['async_blocking_s']:.1f} s; steps while it wrote "
            f"{(r['step_s_in_flight'] / r['step_s_free'] - 1) * 100:+.1f}%; pinned memory handed back at the end "
            f"{r['host_cache_s']:.1f} s")


def bench_table(script: str) -> Callable[[Any], str]:
    """The `table` function of bench/<script>.py, which renders its own results.json."""
    bench = str(BENCH)
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(script).table


def async_save_table(m: Measurement) -> str:
    """bench/async_save.py's own table, from its results.json."""
    return bench_table("async_save")(m.results)


def cold_start_table(m: Measurement) -> str:
    """bench/cold_start.py's own table, from its results.json (its first row, the environment, left out)."""
    return bench_table("cold_start")([r for r in m.results if r["case"] != "environment"])


def cold_start_headline(m: Measurement) -> str:
    by = {r["case"]: r.get("step1_s") for r in m.results}
    env = next(r for r in m.results if r["case"] == "environment")
    later = " and ".join(f"{by[c]:.1f}" for c in ("warm", "warm-again") if by.get(c))
    serial = f" ({by['first-serial']:.1f} s compiling on its own)" if by.get("first-serial") else ""
    if by.get("first-machine"):
        serial += f", {by['first-machine']:.1f} s as the bench's first process on the machine"
    if env.get("cold_disk"):
        serial += ", the installs' files out of the page cache before each"
    text = f"the first run (its caches empty) {by['first']:.1f} s{serial}"
    text += f", later runs {later} s" if later else ""
    text += f"; without the bytecode cache {by['no-bytecode']:.1f} s" if by.get("no-bytecode") else ""
    text += f"; with the CUDA driver's cache empty {by['no-cuda-cache']:.1f} s" if by.get("no-cuda-cache") else ""
    return (f"start to the end of step 1: {text} (PYTHONDONTWRITEBYTECODE="
            f"{env['PYTHONDONTWRITEBYTECODE'] or 'unset'}, torch installed "
            f"{'with' if env['torch_installed_with_bytecode'] else 'without'} bytecode)")


def async_save_headline(m: Measurement) -> str:
    def one(name: str, r: dict) -> str:
        blocked = " and ".join(f"{s['blocking_s']:.1f}" for s in r["saves"])
        cost = (r["step_s_in_flight"] / r["step_s_free"] - 1) * 100
        return (f"staged on the {name}: the loop blocked {blocked} s, steps while it wrote {cost:+.1f}%, the process "
                f"lived on {r['exit_after_final_save_s']:.1f} s after its end-of-run save")

    return "; ".join(one(name, r) for name, r in m.results.items() if "error" not in r)


def writer_probe_table(m: Measurement) -> str:
    def cell(v: Any) -> str:
        return "" if v is None else str(v)

    by_connections = any("connections" in r for r in m.results)
    header = ["scenario", *(["CUDA_DEVICE_MAX_CONNECTIONS"] if by_connections else []), "writer GB/s",
              "step s (median)"]
    return table(header, [[r["scenario"], *([cell(r.get("connections"))] if by_connections else []),
                           cell(r.get("writer_gb_per_s")), cell(r.get("step_s"))] for r in m.results])


WRITER_PROBE_WORDS = {"gpu-steps": "the writer copying from the GPU one tensor ahead",
                      "gpu-window-steps": "the writer copying from the GPU 4 GiB ahead",
                      "host-steps": "the writer from pinned host memory", "copy-steps": "the copies alone",
                      "copy-window-steps": "the copies alone, 4 GiB ahead"}


def writer_probe_headline(m: Measurement) -> str:
    """Beside the GPU steps, per CUDA_DEVICE_MAX_CONNECTIONS where the rows give it."""
    parts = []
    for connections in dict.fromkeys(r.get("connections") for r in m.results):
        rows = {r["scenario"]: r for r in m.results if r.get("connections") == connections}
        said = ", ".join(f"{words} {rows[name]['writer_gb_per_s']} GB/s" for name, words in WRITER_PROBE_WORDS.items()
                         if name in rows)
        where = f"{connections} CUDA connection(s)" if connections else "beside GPU steps"
        parts.append(f"{where}: {said}")
    return "; ".join(parts)


def attention_probe_kernel_ms(r: dict, direction: str) -> float | None:
    """The longest forward (fprop, flash_fwd) or backward (bprop, flash_bwd) kernel of one iteration, ms."""
    marks = ("fprop", "flash_fwd") if direction == "fwd" else ("bprop", "flash_bwd")
    return next((ms for name, ms in r.get("kernels", []) if any(mark in name for mark in marks)), None)


def attention_probe_table(m: Measurement) -> str:
    def kernel(r: dict, direction: str) -> str:
        ms = attention_probe_kernel_ms(r, direction)
        call_ms, tflops = r[f"{direction}_ms"], r[f"{direction}_tflops"]
        return "" if ms is None else f"{ms:.3f} ({tflops * call_ms / ms:.0f})"

    rows = []
    for r in m.results:
        if "error" in r:
            rows.append([r["variant"], "failed", "", "", "", "", "", ""])
            continue
        rows.append([r["variant"], f"{r['fwd_ms']:.3f}", f"{r['bwd_ms']:.3f}", kernel(r, "fwd"), kernel(r, "bwd"),
                     f"{r['peak_gb']:.2f}", f"{r['dq_rel_diff']:.1e}", f"{r['out_rel_diff']:.1e}"])
    return table(["variant", "forward ms (call)", "backward ms (call)", "forward kernel ms (TFLOP/s)",
                  "backward kernel ms (TFLOP/s)", "peak GB", "dq vs te-sbhd", "output vs te-sbhd"], rows)


def attention_probe_headline(m: Measurement) -> str:
    rows = {r["variant"]: r for r in m.results if "error" not in r}
    ref = rows["te-sbhd"]
    out = (f"TE (cuDNN): forward kernel {attention_probe_kernel_ms(ref, 'fwd'):.2f} ms, backward kernel "
           f"{attention_probe_kernel_ms(ref, 'bwd'):.2f} ms")
    if "torch-flash" in rows:
        fa = rows["torch-flash"]
        out += (f"; FlashAttention-2 (torch) {attention_probe_kernel_ms(fa, 'fwd'):.2f} and "
                f"{attention_probe_kernel_ms(fa, 'bwd'):.2f} ms")
    return out


def fp8_quant_table(m: Measurement) -> str:
    quant = [r for r in m.results if "eager_ms" in r]
    gemms = [r for r in m.results if "tflops" in r]
    totals = [r for r in m.results if "bf16_ms" in r]

    def ms(r: dict, key: str) -> str:  # one call's time; the per-step total (no per_step) in bold
        return f"{r[key]:.3f}" if r.get("per_step") else f"**{r[key]:.1f}**"

    out = table(["quantize", "eager ms", "torch.compile ms", "bf16 copy ms", "compiled bitwise equal", "per step"],
                [[r["what"].removeprefix("quantize "), ms(r, "eager_ms"), ms(r, "compiled_ms"), ms(r, "bf16_copy_ms"),
                  {True: "yes", False: "no"}.get(r.get("compiled_bitwise_equal"), ""), str(r.get("per_step", ""))]
                 for r in quant])
    out += "\n\n" + table(["GEMM", "ms", "TFLOP/s"], [[r["what"].removesuffix(" (GEMM only)"), f"{r['ms']:.3f}",
                                                     f"{r['tflops']:.0f}"] for r in gemms])
    for r in totals:
        out += f"\n\n{r['what']}: bf16 {r['bf16_ms']:.1f} ms, FP8 {r['fp8_ms']:.1f} ms."
    return out


def fp8_quant_headline(m: Measurement) -> str:
    step = next(r for r in m.results if "eager_ms" in r and not r.get("per_step"))
    gemm = next((r for r in m.results if "bf16_ms" in r), None)
    saved = f"; FP8 GEMMs save {gemm['bf16_ms'] - gemm['fp8_ms']:.1f} ms" if gemm else ""
    return (f"quantization per step: eager {step['eager_ms']:.1f} ms, torch.compile {step['compiled_ms']:.1f} ms "
            f"(bf16 copy {step['bf16_copy_ms']:.1f} ms){saved}")


KINDS: dict[str, tuple[Callable[[Measurement], str], Callable[[Measurement], str]]] = {
    "train_bench": (train_bench_table, train_bench_headline),
    "overlap_bench": (overlap_table, overlap_headline),
    "moe_profile": (moe_profile_table, moe_profile_headline),
    "logits_1gpu": (logits_1gpu_table, logits_1gpu_headline),
    "multi_gpu": (multi_gpu_table, multi_gpu_headline),
    "convert_bench": (convert_table, convert_headline),
    "preprocess_bench": (preprocess_table, preprocess_headline),
    "post_bench": (post_bench_table, post_bench_headline),
    "start_save": (start_save_table, start_save_headline),
    "grpo_example": (grpo_example_table, grpo_example_headline),
    "save_levers": (save_levers_table, save_levers_headline),
    "fp8_quant": (fp8_quant_table, fp8_quant_headline),
    "levers": (levers_table, levers_headline),
    "step_profile": (step_profile_table, step_profile_headline),
    "exit_probe": (exit_probe_table, exit_probe_headline),
    "pin_probe": (pin_probe_table, pin_probe_headline),
    "host_alloc_probe": (host_alloc_probe_table, host_alloc_probe_headline),
    "async_run": (async_run_table, async_run_headline),
    "async_save": (async_save_table, async_save_headline),
    "cold_start": (cold_start_table, cold_start_headline),
    "writer_probe": (writer_probe_table, writer_probe_headline),
    "attention_probe": (attention_probe_table, attention_probe_headline),
}


def superseded_line(old: Measurement) -> str:
    return (f"Earlier measurement, superseded: {old.meta['date']}, {old.commit_text}, on {old.meta['hardware']}, "
            f"`{'; '.join(old.meta['command'])}`: {KINDS[old.meta['kind']][1](old)} "
            f"([results/{old.name}/](results/{old.name}/)).")


# ---------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "svg.hashsalt": "mcorekit", "figure.dpi": 100})
    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100, metadata={"Software": None})
    fig.clf()


def plot_train_section(ms: list[Measurement], out: Path) -> str | None:
    """tokens/s per shape, every 1-GPU training measurement of the section, HF transformers in grey."""
    bench = [m for m in ms if m.meta["kind"] == "train_bench"]
    if not bench:
        return None
    plt = _plt()
    shapes = []
    for m in bench:
        for r in train_bench_rows(m):
            if r["shape"] not in shapes:
                shapes.append(r["shape"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(11, 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        labels, values, colors = [], [], []
        for i, m in enumerate(bench, 1):
            for r in train_bench_rows(m):
                if r["shape"] != shape or r.get("gpus", 1) != 1:
                    continue
                labels.append(f"{run_label(r)} [{i}]")
                values.append(r["tokens_per_s"] / 1e3)
                colors.append("#9a9a9a" if r["run"] == "hf-bf16" else ("#d98c1f" if r["run"].startswith("fp8") else "#2f6db5"))
        y = list(range(len(labels)))[::-1]
        ax.barh(y, values, color=colors)
        ax.set_yticks(y, [textwrap.fill(lab, 34) for lab in labels])
        for yi, v in zip(y, values):
            ax.text(v, yi, f" {v:.1f}k", va="center")
        ax.set_xlim(0, max(values) * 1.22)
        ax.set_xlabel("tokens/s (thousands), one H200")
        ax.set_title(SHAPE_LABELS.get(shape, shape))
    _save(fig, out / "train-1gpu.png")
    plt.close(fig)
    keys = "; ".join(f"[{i}] {m.meta['date']}, {m.commit_text}: {m.meta['title']}" for i, m in enumerate(bench, 1))
    return (f"![tokens/s per shape, mcorekit next to HF transformers](results/train-1gpu.png)\n\n"
            f"Bars from: {keys}. Grey: HF transformers; blue: mcorekit bf16; orange: mcorekit FP8.")


def plot_scaling_section(ms: list[Measurement], out: Path) -> str | None:
    bench = [m for m in ms if m.meta["kind"] == "train_bench" and any(r.get("gpus", 1) > 1 for r in train_bench_rows(m))]
    if not bench:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.38
    names = []
    for i, m in enumerate(bench):
        rows = train_bench_rows(m)
        one = next(r for r in rows if r.get("gpus", 1) == 1)
        names.append(shape_label(one).split(" (")[0])
        for j, r in enumerate(sorted(rows, key=lambda r: r.get("gpus", 1))):
            g = r.get("gpus", 1)
            x = i + (j - 0.5) * width
            v = r["tokens_per_s"] / 1e3
            ax.bar(x, v, width * 0.95, color="#2f6db5" if g == 1 else "#64a36b", label=f"{g} GPU{'s' if g > 1 else ''}" if i == 0 else None)
            note = f"{v:.1f}k" + (f"\n{r['tokens_per_s'] / one['tokens_per_s'] * 100:.0f}%" if g > 1 else "")
            ax.text(x, v, note, ha="center", va="bottom")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("tokens/s per GPU (thousands)")
    ax.set_ylim(0, max(r["tokens_per_s"] for m in bench for r in train_bench_rows(m)) / 1e3 * 1.3)
    ax.legend(loc="upper right")
    dates = ", ".join(dict.fromkeys(f"{m.meta['date']} {m.meta.get('commit') or ''}".strip() for m in bench))
    ax.set_title(f"weak scaling, bf16: tokens/s per GPU and % of one GPU ({dates})")
    _save(fig, out / "scaling.png")
    plt.close(fig)
    src = "; ".join(dict.fromkeys(f"{m.meta['date']}, {m.commit_text}, {m.meta['hardware']}" for m in bench))
    return f"![tokens/s per GPU on one and two GPUs](results/scaling.png)\n\nFrom the tables below ({src})."


def plot_loss(m: Measurement, out: Path) -> str | None:
    metrics = m.metrics() if m.meta["kind"] == "train_bench" else {}  # other kinds' runs are timings, not training
    if not metrics:
        return None
    import yaml

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for run, rows in metrics.items():
        label = run
        cfg = m.folder / run / "config.yaml"
        if cfg.is_file():
            gbs = yaml.safe_load(cfg.read_text()).get("schedule", {}).get("global_batch_size")
            label += f" (global batch {gbs})" if gbs else ""
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker="o", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.set_title(f"{m.meta['title']}: loss ({m.meta['date']} {m.meta.get('commit') or ''})".replace(" )", ")"))
    name = f"{m.name}-loss.png"
    _save(fig, out / name)
    plt.close(fig)
    return (f"![loss per step of each run](results/{name})\n\nLoss per logged step from each run's metrics.jsonl "
            f"(a short benchmark run on mock data; the 2-GPU run takes twice the tokens per step).")


def plot_overlap(m: Measurement, out: Path) -> str | None:
    rows = [r for r in m.results if "error" not in r]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    y = list(range(len(rows)))[::-1]
    hidden = [r["comm_ms"] - r["exposed_ms"] for r in rows]
    exposed = [r["exposed_ms"] for r in rows]
    ax.barh(y, exposed, color="#c0504d", label="exposed")
    ax.barh(y, hidden, left=exposed, color="#9bbb59", label="hidden behind compute")
    ax.set_yticks(y, [r.get("layout", r["run"]) for r in rows])
    for yi, r in zip(y, rows):
        ax.text(r["comm_ms"], yi, f" {r['comm_ms']:.1f} ms of a {r['step_ms']:.0f} ms step", va="center")
    ax.set_xlim(0, max(r["comm_ms"] for r in rows) * 2.3)
    ax.set_xlabel("communication kernel time per step on GPU 0 (ms)")
    ax.set_title(f"communication per step, exposed and hidden ({m.meta['date']})")
    ax.legend(loc="upper right")
    _save(fig, out / f"{m.name}.png")
    plt.close(fig)
    return f"![communication per step, exposed and hidden](results/{m.name}.png)"


def plot_convert(m: Measurement, out: Path) -> str | None:
    res = m.results
    d = res["disk"]
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 2.9), gridspec_kw={"width_ratios": [3, 2]})
    labels = ["disk write (dd)", "disk read (dd)", "disk read+write"] + [r["label"] for r in res["rows"]]
    values = [d["write_gb_s"], d["read_gb_s"], d["read_write_gb_s"]] + [r["gb_s"] for r in res["rows"]]
    colors = ["#bbbbbb"] * 3 + ["#9a9a9a" if r["label"].startswith("naive") else "#2f6db5" for r in res["rows"]]
    y = list(range(len(labels)))[::-1]
    ax.barh(y, values, color=colors)
    ax.set_yticks(y, labels)
    for yi, v in zip(y, values):
        ax.text(v, yi, f" {v:.2f}", va="center")
    ax.set_xlim(0, max(values) * 1.2)
    ax.set_xlabel("GB/s")
    ax.set_title(f"conversion of a {res['checkpoint_gb']:.2f} GB checkpoint next to the disk ({m.meta['date']})")
    y2 = list(range(len(res["rows"])))[::-1]
    ax2.barh(y2, [r["peak_rss_gb"] for r in res["rows"]],
             color=["#9a9a9a" if r["label"].startswith("naive") else "#2f6db5" for r in res["rows"]])
    ax2.set_yticks(y2, [r["label"] for r in res["rows"]])
    for yi, r in zip(y2, res["rows"]):
        ax2.text(r["peak_rss_gb"], yi, f" {r['peak_rss_gb']:.2f}", va="center")
    ax2.set_xlim(0, max(r["peak_rss_gb"] for r in res["rows"]) * 1.25)
    ax2.set_xlabel("peak RSS (GB)")
    ax2.set_title("peak memory")
    _save(fig, out / f"{m.name}.png")
    plt.close(fig)
    return f"![conversion GB/s next to the disk, and peak memory](results/{m.name}.png)"


MEASUREMENT_PLOTS: dict[str, Callable[[Measurement, Path], str | None]] = {
    "overlap_bench": plot_overlap,
    "convert_bench": plot_convert,
}
SECTION_PLOTS: dict[str, Callable[[list[Measurement], Path], str | None]] = {
    "train": plot_train_section,
    "scaling": plot_scaling_section,
}


# ---------------------------------------------------------------- the page


def anchor(title: str) -> str:
    """GitHub's heading anchor."""
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


def render(ms: list[Measurement], images: Path) -> str:
    images.mkdir(parents=True, exist_ok=True)
    latest = [m for m in ms if not m.meta.get("superseded_by")]
    by_section = {s: sorted((m for m in latest if m.meta["section"] == s), key=lambda m: (m.meta.get("order", 0), m.name))
                  for s, _ in SECTIONS}
    older = {}
    for m in ms:
        if m.meta.get("superseded_by"):
            older.setdefault(m.meta["superseded_by"], []).append(m)

    out = ["# Results", "",
           "<!-- Generated by tools/results_page.py from docs/results/*/ (meta.json, results.json, metrics.jsonl). "
           "Do not edit by hand: change the data and run `.venv/bin/python tools/results_page.py`. -->", "",
           "Every measurement of this project in one place: the latest of each benchmark, each table headed by its date, "
           "commit, hardware and command. Older measurements of the same thing are named in one line under the newer one. "
           "The numbers live in [results/](results/), one folder per measurement; this page and its plots are generated "
           "from them by `tools/results_page.py`, and a test fails when the page is out of date.", "",
           "Where a figure was copied from an earlier version of the docs and that version gave no commit, the page "
           "says so and names the commit that added the figure to the docs: the code measured was work in progress "
           "between that commit's parent and that commit.", "",
           "## At a glance", ""]
    rows = []
    for s, title in SECTIONS:
        for m in by_section[s]:
            rows.append([f"[{m.meta['title']}](#{anchor(m.meta['title'])})", KINDS[m.meta["kind"]][1](m), m.meta["date"],
                         m.commit_text, m.meta["hardware"]])
    out += [table(["result", "figures", "date", "commit", "hardware"], rows), ""]

    for s, title in SECTIONS:
        if not by_section[s]:
            continue
        out += [f"## {title}", ""]
        plot = SECTION_PLOTS.get(s)
        if plot:
            text = plot(by_section[s], images)
            if text:
                out += [text, ""]
        for m in by_section[s]:
            out += [f"### {m.meta['title']}", ""]
            if m.meta["kind"] == "multi_gpu":
                for i, (sub, tbl, extra) in enumerate(multi_gpu_tables(m)):
                    out += [f"**{sub}**", "", provenance(m, full=i == 0), "", tbl, ""]
                    if extra:
                        out += [notes(extra), ""]
            else:
                out += [provenance(m), "", KINDS[m.meta["kind"]][0](m), ""]
            for plot_m in (MEASUREMENT_PLOTS.get(m.meta["kind"]), plot_loss):
                text = plot_m(m, images) if plot_m else None
                if text:
                    out += [text, ""]
            if m.meta.get("notes"):
                out += [notes(m.meta["notes"]), ""]
            for old in sorted(older.get(m.name, []), key=lambda o: o.meta["date"]):
                out += [superseded_line(old), ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA, help="the results folders (default docs/results)")
    p.add_argument("--out", type=Path, default=None, help="write OUT/results.md and OUT/results/*.png (default docs/)")
    p.add_argument("--check", action="store_true", help="generate into a temporary folder; exit 1 if docs/results.md differs")
    a = p.parse_args(argv)
    ms = load(a.data)
    if a.check:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            page = render(ms, Path(tmp) / "results")
        current = (ROOT / "docs" / "results.md").read_text() if (ROOT / "docs" / "results.md").is_file() else ""
        if page != current:
            print("results_page: docs/results.md is out of date: run .venv/bin/python tools/results_page.py", file=sys.stderr)
            return 1
        return 0
    out = a.out or (ROOT / "docs")
    page = render(ms, out / "results")
    (out / "results.md").write_text(page)
    print(f"results_page: wrote {out / 'results.md'} and {len(list((out / 'results').glob('*.png')))} plots "
          f"from {len(ms)} measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
