"""On the GPU machine: DPO (data.kind=dpo) learns a preference, its reference is the starting model, and both
reference modes agree.

- A tiny Llama trained with DPO on synthetic pairs whose preferred answer depends on the prompt (the prompt holds
  "yes" or "no" somewhere among filler words; chosen repeats it, rejected says the other) reaches
  rewards/accuracies > 0.9 and its mean margin rises quarter by quarter; at step 1 the policy IS the reference,
  so the loss is ln 2 and every reward 0. Run with the live reference and the precomputed one (tokens/s of both
  printed), and with pairs packed into rows.
- fp32: the live and the precomputed reference give the same losses (step 1: ln 2).
- From a converted HF checkpoint (checkpoint.load): the live reference loads the same weights (step-1 loss ln 2).
- USR2 -> save -> resume continues the uninterrupted run's losses (live: the reference rebuilt from the start;
  precomputed: the stored log-probs read back, not recomputed).
- With 2 GPUs: DP2, TP2, PP2, PP2xVPP2 and CP2 follow the one-GPU run.

Each run is `python -m mcorekit.train` in its own process (torchrun for 2 GPUs; the resume test goes through
tests/gpu_train_driver.py, which sends the USR2). Run from tests/ on the GPU machine:
    cd tests && python3 -m pytest test_gpu_dpo.py -v -s
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpus import needs_two
from hf_models import WORDS, make_tokenizer
from single_rank import single_rank_env

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent
LN2 = math.log(2)
MODEL = {"preset": "llama-tiny", "overrides": {"hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
                                               "kv_channels": 32, "ffn_hidden_size": 704, "vocab_size": 512}}
FILLER = [w for w in WORDS if w not in ("yes", "no")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def preference_file(path: Path, n: int, seed: int) -> Path:
    """Pairs whose preferred answer is the word ("yes" or "no") hidden at a random place in the prompt; half plain
    text, half chat (rendered with the tokenizer's chat template)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        key = rng.choice(["yes", "no"])
        other = "no" if key == "yes" else "yes"
        words = [rng.choice(FILLER) for _ in range(rng.randint(2, 8))]
        words.insert(rng.randint(0, len(words)), key)
        if i % 2:
            lines.append({"prompt": [{"role": "user", "content": " ".join(words)}], "chosen": key, "rejected": other})
        else:
            lines.append({"prompt": " ".join(words) + " answer", "chosen": key, "rejected": other})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return preference_file(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 2000, seed=11)


def dpo_config(tokenizer: Path, pairs: Path, **sections: dict) -> dict:
    cfg = {"name": "dpo-test", "model": MODEL, "precision": {"dtype": "bf16"},
           "data": {"kind": "dpo", "paths": [str(pairs)], "tokenizer": str(tokenizer), "seq_length": 64, "seed": 3},
           "dpo": {"beta": 0.5, "reference": "live"},
           "schedule": {"train_iters": 100, "warmup_iters": 5, "decay": "constant", "micro_batch_size": 4,
                        "global_batch_size": 16},
           "optimizer": {"lr": 1e-3, "min_lr": 1e-3, "weight_decay": 0.0},
           "checkpoint": {"save_interval": 1000, "keep_last": 1},
           "logging": {"log_interval": 1}}
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    s = cfg["schedule"]  # a short run keeps a warmup shorter than itself (the rules refuse warmup >= train_iters)
    s["warmup_iters"] = min(s["warmup_iters"], s["train_iters"] - 1)
    return cfg


def train(tmp: Path, name: str, cfg: dict, nproc: int = 1) -> list[dict]:
    """`python -m mcorekit.train` (torchrun with nproc > 1) on CFG in TMP/NAME; the per-step metrics rows."""
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    entry = ["-m", "mcorekit.train", "--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir)]
    if nproc == 1:
        cmd, env = [sys.executable, *entry], {**os.environ, **single_rank_env()}
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *entry[1:]]
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    # from the run folder: the checkout's mcorekit/ folder must not shadow the installed package
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=run_dir, env=env)
    (run_dir / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def quarters(values: list[float]) -> list[float]:
    q = len(values) // 4
    return [statistics.mean(values[i * q:(i + 1) * q]) for i in range(4)]


def check_learns(m: list[dict], label: str) -> None:
    margins = [x["rewards/margins"] for x in m]
    acc = statistics.mean(x["rewards/accuracies"] for x in m[-10:])
    speed = statistics.median(x["tokens_per_s"] for x in m[5:])
    print(f"{label}: step-1 loss {m[0]['loss']:.6f} (ln 2 = {LN2:.6f}), last-10 accuracy {acc:.3f}, margin by "
          f"quarter {[round(v, 3) for v in quarters(margins)]}, last loss {m[-1]['loss']:.4f}, "
          f"{speed:,.0f} tokens/s (chosen + rejected sequences, padded), peak {m[-1]['mem_gb']:.2f} GB")
    assert len(m) == 100
    assert abs(m[0]["loss"] - LN2) < 5e-3 and abs(m[0]["rewards/margins"]) < 1e-2  # policy == reference at step 1
    assert acc > 0.9
    q = quarters(margins)
    assert all(a < b for a, b in zip(q, q[1:])) and q[-1] > 0, q  # the margin rises on average
    assert m[-1]["loss"] < m[0]["loss"]


@pytest.mark.parametrize("reference", ["live", "precomputed"])
def test_dpo_learns_the_preferred_answer(tmp_path: Path, tokenizer: Path, pairs: Path, reference: str) -> None:
    m = train(tmp_path, reference, dpo_config(tokenizer, pairs, dpo={"reference": reference}))
    check_learns(m, f"DPO, {reference} reference")
    stored = tmp_path / reference / "reference_logps" / "train.safetensors"
    assert stored.is_file() == (reference == "precomputed")


def test_dpo_learns_with_packed_pairs(tmp_path: Path, tokenizer: Path, pairs: Path) -> None:
    # rows of 256 positions, each holding several whole pairs; 4 rows per step
    cfg = dpo_config(tokenizer, pairs, data={"packing": True, "seq_length": 256},
                     schedule={"micro_batch_size": 1, "global_batch_size": 4})
    check_learns(train(tmp_path, "packed", cfg), "DPO, packed pairs")


def test_live_and_precomputed_reference_give_the_same_losses(tmp_path: Path, tokenizer: Path, pairs: Path) -> None:
    """fp32, so that only the order of operations differs: the stored log-probs were computed over the data in
    file order, the live ones over each step's micro-batches."""
    runs = {}
    for reference in ("live", "precomputed"):
        cfg = dpo_config(tokenizer, pairs, precision={"dtype": "fp32"}, dpo={"reference": reference},
                         schedule={"train_iters": 5})
        runs[reference] = train(tmp_path, reference, cfg)
    live, pre = ([x["loss"] for x in runs[k]] for k in ("live", "precomputed"))
    print("fp32 losses, live reference:", [round(v, 6) for v in live], "precomputed:", [round(v, 6) for v in pre])
    assert abs(live[0] - LN2) < 1e-5 and abs(pre[0] - LN2) < 1e-5
    assert all(abs(a - b) < 1e-4 for a, b in zip(live, pre))
    for k in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert abs(runs["live"][2][k] - runs["precomputed"][2][k]) < 1e-3 * max(1.0, abs(runs["live"][2][k])), k


def test_live_reference_loads_the_starting_checkpoint(tmp_path: Path, tokenizer: Path, pairs: Path) -> None:
    """Policy and reference start from a converted HF model (peaked logits, far from a random init's): step 1 is
    ln 2 only if the reference holds the same weights as the policy."""
    from test_gpu_train import converted_llama

    converted_llama(tmp_path, initializer_range=0.2)
    cfg = dpo_config(tokenizer, pairs, model={"hf_config": str(tmp_path / "hf")}, precision={"dtype": "fp32"},
                     schedule={"train_iters": 3}, checkpoint={"load": str(tmp_path / "mcore"), "finetune": True})
    cfg["model"].pop("preset"), cfg["model"].pop("overrides")
    m = train(tmp_path, "from-hf", cfg)
    print("from a converted checkpoint: losses", [round(x["loss"], 6) for x in m], "logps/chosen",
          round(m[0]["logps/chosen"], 3))
    assert abs(m[0]["loss"] - LN2) < 1e-5 and m[0]["rewards/chosen"] == pytest.approx(0, abs=1e-4)


@pytest.mark.parametrize("reference", ["live", "precomputed"])
def test_signal_save_resume_reproduces_losses(tmp_path: Path, tokenizer: Path, pairs: Path, reference: str) -> None:
    from test_gpu_train import run

    cfg = dpo_config(tokenizer, pairs, dpo={"reference": reference},
                     schedule={"train_iters": 12}, checkpoint={"save_interval": 4})
    full = run(tmp_path, "full", cfg)
    first = run(tmp_path, "interrupted", cfg, stop_at=6, expect=3)  # USR2 after step 6: save at 6, exit
    assert [x["step"] for x in first] == list(range(1, 7))
    stored = tmp_path / "interrupted" / "reference_logps" / "train.safetensors"
    written = stored.stat().st_mtime_ns if reference == "precomputed" else None
    resumed = [x for x in run(tmp_path, "interrupted", cfg) if x["step"] > 6]
    assert [x["step"] for x in resumed] == list(range(7, 13))
    if written is not None:
        assert stored.stat().st_mtime_ns == written  # read back, not recomputed
    print(f"{reference}: resumed losses", [round(x["loss"], 5) for x in resumed], "uninterrupted",
          [round(x["loss"], 5) for x in full[6:]])
    for a, b in zip(resumed, full[6:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"]) + 1e-4, (a, b)


@needs_two
@pytest.mark.parametrize("layout", [{}, {"tp": 2}, {"pp": 2}, {"pp": 2, "vpp": 2}, {"cp": 2}],
                         ids=["dp2", "tp2", "pp2", "pp2-vpp2", "cp2"])
def test_layouts_follow_one_gpu(tmp_path: Path, tokenizer: Path, pairs: Path, layout: dict) -> None:
    """bf16 on two GPUs: the pairs of each step are the same, so the losses follow the one-GPU run's (only the order
    of floating-point reductions differs); step 1 is ln 2 at every layout (the reference runs the same layout)."""
    cfg = dpo_config(tokenizer, pairs, schedule={"train_iters": 8})
    one = train(tmp_path, "one", cfg)
    two = train(tmp_path, "two", {**cfg, "parallel": layout}, nproc=2)
    print(f"{layout or 'dp2'}: losses", [round(x["loss"], 4) for x in two], "one GPU", [round(x["loss"], 4) for x in one])
    assert abs(two[0]["loss"] - LN2) < 5e-3
    assert all(abs(a["loss"] - b["loss"]) < 0.03 for a, b in zip(one, two))
