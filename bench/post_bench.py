"""What post-training costs on one GPU, on the 0.89B Llama shape (examples/llama-0.9b.yaml): throughput, peak memory,
trainable parameters and checkpoint size of DPO, and of LoRA next to full fine-tuning, in one run (issue: post-training
cost in docs).

    python bench/post_bench.py [--steps 16] [--cases sft-full,sft-lora,...] [--out DIR] [--work DIR] [--dry]

Cases, each its own `python -m mcorekit.train` process (the real entry) on data this script writes:
  sft-full         SFT of all weights (data.kind sft, packing, as examples/sft.yaml); its final checkpoint is the
                   starting checkpoint (checkpoint.load, finetune) of the LoRA cases, which the rules require
  sft-lora         SFT with LoRA rank 16 on qkv, proj, fc1, fc2 (examples/sft-lora.yaml: alpha 32, dropout 0.05)
  dpo-live         DPO of all weights, the reference a frozen bf16 copy on the GPU (examples/dpo.yaml, beta 0.1, with
                   data.packing as examples/dpo-lora.yaml: a pair's two sequences in one row)
  dpo-precomputed  DPO of all weights, reference log-probs computed once before the first step (the copy freed)
  dpo-lora         DPO with LoRA (examples/dpo-lora.yaml: dropout 0), the reference the same model, adapters off
Every case: bf16, seq_length 2048, micro-batch 1 packed row, 8 micro-batches per step (global batch 8 rows),
lr warmup 1 step. The full cases start from random initial weights (the DPO reference is rebuilt from the same
seeds); speed and memory do not depend on the weights' values, only the losses would.

Data (synthetic, written under --work): a word-level tokenizer of 32,000 made-up words (one word = one token, built
offline), plain-text records of random words. SFT: prompt 256 + response 1792 words + eos = 2049 tokens = exactly one
2048-position packed row per example. DPO: prompt 512 + chosen 512 words + eos and prompt + rejected likewise: two
1024-position sequences = exactly one packed row per pair (both sequences of a pair in one row). So no row holds
padding, and the rows' positions are the tokens the model processes.

Columns:
  tokens/s    real tokens per second as the run's metrics.jsonl logs them (a row's positions less its padding; these
              rows hold none), median over the logged 2-step intervals after the first (that one holds warm-up, and
              for dpo-precomputed the reference pass). For DPO both the chosen and the rejected sequence of a pair
              count: a row of 2048 is one pair.
  step s      seconds per optimizer step (8 rows), median over the same intervals, as metrics.jsonl logs it (step_s)
  peak mem    torch.cuda.max_memory_allocated of the training process, GB (1e9), since it started (metrics.jsonl's
              mem_gb): the most the run ever held at once (start-up included: for LoRA loading the base, for
              dpo-precomputed the reference pass), not the caching allocator's reserve nor the CUDA context
  trainable   parameters the optimizer updates, from the model shape (ModelSpec.num_parameters; LoRA:
              train/lora.adapter_shape of each adapted layer); results.json's ckpt_params counts the model tensors in
              the saved checkpoint, and the table says so where the two differ
  checkpoint  bytes on disk of the one save at the end: full cases weights + distributed optimizer state (fp32 main
              weights, Adam moments); LoRA cases the adapters and their optimizer state only
Prints a Markdown table and writes results.json (after every case, so a cut-off run keeps what finished) and, per
case, config.yaml, log.txt and metrics.jsonl under --out. Checkpoints go under --work (up to ~25 GB at once) and are
deleted once measured unless --keep-checkpoints.

--dry does everything short of training, on any machine: writes the data and every case's config.yaml, checks each
with the project's loader and rules (config.experiment.load_experiment, config.rules.problems for one H200 with
Transformer Engine) and builds its dataset with the training code (rows, fill, nothing truncated). A GPU run does
the same first, so a broken config fails before any GPU time is spent.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from results import finish, single_gpu_env

PRESET = "llama-0.9b"
SEQ = 2048
MICRO_BATCHES = 8  # micro-batches of one packed row per step (global batch 8 rows)
LOG_INTERVAL = 2
WORDS = 32_000  # the tokenizer's made-up words (the model's vocabulary is 32,768)
SFT_PROMPT, SFT_RESPONSE = 256, 1792  # + eos: 2049 tokens, 2048 positions
DPO_PROMPT, DPO_RESPONSE = 512, 512  # per sequence, + eos: 1025 tokens, 1024 positions; a pair fills a row
LORA = {"rank": 16, "alpha": 32, "target_modules": ["qkv", "proj", "fc1", "fc2"]}
BASE_CASE = "sft-full"  # its checkpoint is the LoRA cases' checkpoint.load


@dataclass(frozen=True)
class Case:
    label: str
    kind: str  # data.kind: sft or dpo
    lora: bool = False
    reference: str | None = None  # dpo.reference
    lr: float = 1e-5
    lora_dropout: float = 0.0


CASES = {
    "sft-full": Case("SFT, all weights", "sft", lr=1e-5),
    "sft-lora": Case("SFT + LoRA r16 (qkv, proj, fc1, fc2)", "sft", lora=True, lr=2e-4, lora_dropout=0.05),
    "dpo-live": Case("DPO, all weights, live reference (frozen copy)", "dpo", reference="live", lr=5e-7),
    "dpo-precomputed": Case("DPO, all weights, precomputed reference log-probs", "dpo", reference="precomputed",
                            lr=5e-7),
    "dpo-lora": Case("DPO + LoRA r16, reference = adapters off", "dpo", lora=True, reference="live", lr=5e-6),
}


# ---------------------------------------------------------------- data: tokenizer and jsonl, made here


def make_tokenizer(out: Path) -> Path:
    """A word-level HF tokenizer of WORDS made-up words `w0`..: each word of the data is exactly one token."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<pad>", "<eos>"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="<eos>")
    fast.save_pretrained(out)
    return out


def make_data(work: Path, rows: int, seed: int = 0) -> dict[str, Path]:
    """The tokenizer, `rows` SFT examples and `rows` preference pairs (one packed row each)."""
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(f"w{rng.randrange(WORDS)}" for _ in range(n))

    out = {"tokenizer": make_tokenizer(data / "tokenizer")}
    # a second set for the LoRA cases: their base (sft-full's checkpoint) memorised the first set's rows, and a
    # second pass over them showed losses below the data's entropy (9.2 against ln 32000 = 10.4)
    for suffix in ("", "-unseen"):
        sft, dpo = data / f"sft{suffix}.jsonl", data / f"pairs{suffix}.jsonl"
        with open(sft, "w") as f:
            for _ in range(rows):
                f.write(json.dumps({"prompt": text(SFT_PROMPT), "response": text(SFT_RESPONSE)}) + "\n")
        with open(dpo, "w") as f:
            for _ in range(rows):
                f.write(json.dumps({"prompt": text(DPO_PROMPT), "chosen": text(DPO_RESPONSE),
                                    "rejected": text(DPO_RESPONSE)}) + "\n")
        out.update({f"sft{suffix}": sft, f"dpo{suffix}": dpo})
    return out


# ---------------------------------------------------------------- experiment files


def ckpt_root(work: Path, name: str) -> Path:
    return work / f"ckpt-{name}"


def write_config(name: str, steps: int, run_dir: Path, work: Path, data: dict[str, Path]) -> Path:
    """The experiment file of one case (the schema of config/experiment.py, as the examples write it)."""
    c = CASES[name]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    cfg: dict[str, Any] = {
        "name": f"post-{name}", "model": {"preset": PRESET}, "precision": {"dtype": "bf16"},
        "data": {"kind": c.kind, "paths": [str(data[c.kind + ("-unseen" if c.lora else "")])],
                 "tokenizer": str(data["tokenizer"]),
                 "seq_length": SEQ, "packing": True},
        "optimizer": {"lr": c.lr, "min_lr": round(c.lr / 10, 12), "weight_decay": 0.0},
        "schedule": {"train_iters": steps, "warmup_iters": 1, "micro_batch_size": 1,
                     "global_batch_size": MICRO_BATCHES},
        # one save, at the last step (the loop always saves there); off the --out folder: GBs
        "checkpoint": {"dir": str(ckpt_root(work, name)), "save_interval": 10**6, "keep_last": 1},
        "logging": {"log_interval": LOG_INTERVAL},
    }
    if c.kind == "dpo":
        cfg["dpo"] = {"beta": 0.1, "reference": c.reference}
    if c.lora:
        cfg["peft"] = {"lora": {**LORA, "dropout": c.lora_dropout}}
        # the rules: LoRA adapts a trained model; a training checkpoint is taken as weights only (finetune)
        cfg["checkpoint"].update(load=str(ckpt_root(work, BASE_CASE)), finetune=True)
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def trainable_params(name: str) -> int:
    """What the optimizer updates: every weight, or the adapters (A and B of each adapted layer)."""
    from mcorekit.models.spec import resolve
    from mcorekit.train.lora import adapter_shape

    spec = resolve(PRESET, None, {})
    if not CASES[name].lora:
        return spec.num_parameters()
    per_layer = 0
    for target in LORA["target_modules"]:
        s = adapter_shape(spec, target)
        a, b = s.a_shape(LORA["rank"]), s.b_shape(LORA["rank"])
        per_layer += a[0] * a[1] + b[0] * b[1]
    return spec.num_layers * per_layer


def check_case(name: str, config: Path, run_dir: Path, rows: int) -> dict[str, Any]:
    """The project's own checks of one case's config, on a CPU: the loader, every rule for one rank of an H200 node
    with Transformer Engine (Megatron-Core's TransformerConfig checks included), and its dataset built by the
    training code: how many packed rows, how full, nothing cut. Returns {"problems": [...], ...}."""
    from mcorekit.config.experiment import load_experiment
    from mcorekit.config.rules import Nodes, model_of, problems
    from mcorekit.errors import MCoreKitError
    from mcorekit.train.data import build_dataset

    try:
        exp = load_experiment(config)
        spec = model_of(exp)
        bad = problems(exp, 1, Nodes(transformer_engine=True, gpus=True, where="one H200", capability=(9, 0)), spec)
        if bad:
            return {"problems": bad}
        ds = build_dataset(exp, spec, run_dir)
    except MCoreKitError as e:
        return {"problems": [str(e)]}
    # every word one token (no <unk>, id 0), nothing cut: each example or sequence has exactly its planned tokens
    if exp.data.kind == "dpo":
        examples = [e for pair in ds.pairs for e in pair]
        planned, response = DPO_PROMPT + DPO_RESPONSE + 1, DPO_RESPONSE + 1
        positions = [sum(ds.pairs[j][0].positions + ds.pairs[j][1].positions for j in b) for b in ds.bins]
    else:
        examples = ds.examples
        planned, response = SFT_PROMPT + SFT_RESPONSE + 1, SFT_RESPONSE + 1
        positions = [sum(ds.examples[j].positions for j in b) for b in ds.bins]
    off = sum(len(e.ids) != planned or sum(e.mask) != response or 0 in e.ids for e in examples)
    out: dict[str, Any] = {"problems": [], "rows": len(ds.bins), "fill": sum(positions) / (len(positions) * SEQ)}
    if off or len(examples) != rows * (2 if exp.data.kind == "dpo" else 1):
        out["problems"].append(f"{off} of {len(examples)} sequences are not the {planned} tokens planned (a word "
                               f"split or unknown, a cut, a pair left out)")
    if len(ds.bins) != rows:
        out["problems"].append(f"{len(ds.bins)} packed rows, expected {rows} (one per example or pair)")
    return out


# ---------------------------------------------------------------- runs


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def params_in_checkpoint(root: Path) -> int | None:
    """Model tensors (not optimizer state) in the run's last checkpoint, by numel from its metadata: a check on
    `trainable` (LoRA: the adapters only; full: every weight). None where it cannot be read."""
    from mcorekit.convert.torch_dist import TorchDistReader
    from mcorekit.train.checkpoint import latest

    try:
        path = latest(root)
        keys = TorchDistReader(path).tensor_keys() if path else {}
    except Exception:  # noqa: BLE001  (a check beside the measurement: never what fails a case)
        return None
    return sum(math.prod(v.size) for k, v in keys.items()
               if k.startswith(("decoder.", "embedding.", "output_layer.")) and "_extra_state" not in k) or None


def run_case(name: str, steps: int, out: Path, work: Path, port: int, timeout_s: float) -> dict[str, Any]:
    from mcorekit.train.checkpoint import TRACKER

    c = CASES[name]
    row: dict[str, Any] = {"case": name, "label": c.label, "steps": steps, "trainable_params": trainable_params(name)}
    run_dir = out / name
    ckpt = ckpt_root(work, name)
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(run_dir / "reference_logps", ignore_errors=True)  # a rerun must compute it again, not read it
    if c.lora and not (ckpt_root(work, BASE_CASE) / TRACKER).is_file():
        return {**row, "error": f"no {BASE_CASE} checkpoint under {work} to adapt (run {BASE_CASE} first, or keep "
                                f"its checkpoint with --keep-checkpoints)"}
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "mcorekit.train", "--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir)]
    # cwd: the run folder, not a checkout's root, whose mcorekit/ folder would shadow the installed package
    try:
        proc = subprocess.run(cmd, env=single_gpu_env(port), cwd=run_dir, capture_output=True, text=True,
                              timeout=timeout_s)
        log, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        log, code = log + f"\npost_bench: timed out after {timeout_s:.0f} s", -1
    (run_dir / "log.txt").write_text(log)
    row["ckpt_bytes"], row["ckpt_params"] = dir_bytes(ckpt), params_in_checkpoint(ckpt)
    if code:
        return {**row, "error": log[-1500:]}
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"tokens_per_s"' in x]
    if not m:
        return {**row, "error": "no metrics.jsonl rows with tokens_per_s"}
    steady = m[1:] or m
    tps, step_s = (statistics.median(x[k] for x in steady) for k in ("tokens_per_s", "step_s"))
    first_steps, first_s = m[0]["step"], m[0]["step"] * m[0]["step_s"]
    return {**row, "tokens_per_s": tps, "step_s": step_s, "seq_length": SEQ, "rows_per_step": MICRO_BATCHES,
            # a row is one sequence, or one pair (its chosen and rejected sequence)
            **({"pairs_per_s": MICRO_BATCHES / step_s} if c.kind == "dpo" else
               {"sequences_per_s": MICRO_BATCHES / step_s}),
            "mem_gb": max(x["mem_gb"] for x in m),
            # the first logged interval beyond its steps at the steady pace: warm-up, and for dpo-precomputed the
            # reference pass over every pair
            "first_interval_s": first_s, "first_interval_steps": first_steps,
            "first_interval_extra_s": first_s - first_steps * step_s,
            "loss_first": m[0]["loss"], "loss_last": m[-1]["loss"]}


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def fmt_bytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def cause(error: str) -> str:
    """The line of a failed run's output that names the error (else its last line), for the table."""
    lines = [x.strip() for x in error.strip().splitlines() if x.strip()] or ["?"]
    named = [x for x in lines if "Error" in x or "error:" in x or "timed out" in x]
    return (named or lines)[-1][:120].replace("|", "/")


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["case"] == BASE_CASE and "error" not in r), None)
    rows = ["| case | tokens/s | step s | peak mem GB | trainable params | checkpoint | tokens/s vs SFT full | "
            "mem vs SFT full |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            params = fmt_params(r["trainable_params"])
            rows.append(f"| {r['case']} | failed: {cause(r['error'])} | | | {params} | | | |")
            continue
        vs_t = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        vs_m = f"{r['mem_gb'] / base['mem_gb']:.2f}x" if base else ""
        # the checkpoint's model tensors should be exactly the trainable ones (LoRA) or every weight (full)
        saved = f" (checkpoint holds {fmt_params(r['ckpt_params'])})" if r.get("ckpt_params") not in (
            None, r["trainable_params"]) else ""
        rows.append(f"| {r['case']} | {r['tokens_per_s'] / 1e3:.1f}k | {r['step_s']:.3f} | {r['mem_gb']:.1f} | "
                    f"{fmt_params(r['trainable_params'])}{saved} | {fmt_bytes(r['ckpt_bytes'])} | {vs_t} | {vs_m} |")
    rows.append(f"\n{PRESET}, bf16, 1 GPU; rows of {SEQ} packed tokens, micro-batch 1, {MICRO_BATCHES} per step; "
                f"tokens = real tokens, here every row position (DPO: chosen + rejected of a pair in one row); "
                f"peak mem = max_memory_allocated since the process started")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per case (logged every 2)")
    p.add_argument("--out", default="/tmp/mcorekit-post-bench", help="results.json and each case's logs")
    p.add_argument("--work", default="/tmp/mcorekit-post-bench-work", help="data and checkpoints (GBs)")
    p.add_argument("--dry", action="store_true", help="write data and configs and check them; train nothing")
    p.add_argument("--timeout-s", type=float, default=200, help="per case")
    p.add_argument("--budget-s", type=float, default=420,
                   help="the whole run, seconds: a case is skipped when less than 45 s are left, one running is "
                        "cut at it (results.json and the table are still written)")
    p.add_argument("--keep-checkpoints", action="store_true")
    a = p.parse_args(argv)
    start = time.perf_counter()
    names = [n for n in a.cases.split(",") if n]
    if unknown := [n for n in names if n not in CASES]:
        p.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if a.steps < 2 * LOG_INTERVAL:
        p.error(f"--steps must be at least {2 * LOG_INTERVAL} (the first logged interval is left out)")
    out, work = Path(a.out).resolve(), Path(a.work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = a.steps * MICRO_BATCHES  # one epoch: every row seen once (and dpo-precomputed's pass covers as many)
    data = make_data(work, rows)
    checks = {}
    for name in names:
        config = write_config(name, a.steps, out / name, work, data)
        checks[name] = check_case(name, config, out / name, rows)
        c = checks[name]
        status = "; ".join(c["problems"]) or f"ok: {c['rows']} rows, {c['fill']:.1%} full"
        print(f"{name}: {config}: {status}; trainable {fmt_params(trainable_params(name))}", flush=True)
    if any(c["problems"] for c in checks.values()):
        print("post_bench: a config does not pass the checks; nothing trained", file=sys.stderr)
        return 1
    if a.dry:
        return 0
    results: list[dict] = []
    for i, name in enumerate(names):
        left = a.budget_s - (time.perf_counter() - start)
        if left < 45:
            results.append({"case": name, "label": CASES[name].label, "trainable_params": trainable_params(name),
                            "error": f"skipped: --budget-s {a.budget_s:.0f} spent"})
        else:
            t0 = time.perf_counter()
            r = run_case(name, a.steps, out, work, 29591 + i, min(a.timeout_s, left))
            r["wall_s"] = round(time.perf_counter() - t0, 1)
            results.append(r)
            print(json.dumps({**r, "error": r["error"][-300:]} if "error" in r else r), flush=True)
            if not a.keep_checkpoints and name != BASE_CASE:
                shutil.rmtree(ckpt_root(work, name), ignore_errors=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    if not a.keep_checkpoints:
        shutil.rmtree(ckpt_root(work, BASE_CASE), ignore_errors=True)
    print(f"post_bench: {time.perf_counter() - start:.0f} s", flush=True)
    return finish(results, out, table)


if __name__ == "__main__":
    sys.exit(main())
