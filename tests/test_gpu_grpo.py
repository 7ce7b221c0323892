"""On the GPU machine (one H200): the GRPO example end to end (examples/grpo), each stage in its own process as a
user runs it. Data and a character tokenizer are made by the example's generator; a small Llama (random weights) is
SFT-trained briefly on multi-digit addition, its greedy held-out accuracy measured (examples/grpo/evaluate.py,
through train/generate.py), then GRPO-trained from that checkpoint (rollouts from the training model itself through
Megatron-Core's inference engine), converted to HF, and measured again: held-out accuracy after vs before, over
256 prompts; generation tokens/s of our engine(s) next to transformers' generate on the converted model in the same
process; the share of each GRPO step spent generating.

    python3 -m pytest -s tests/test_gpu_grpo.py      # prints both accuracies, tokens/s, generation share
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EXAMPLE = REPO / "examples" / "grpo"
HELD_OUT = 256


def sh(cmd: list[str], cwd: Path, timeout: int = 600) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def train(tmp: Path, name: str, config: Path, overrides: list[str]) -> list[dict[str, Any]]:
    run_dir = tmp / name
    out = sh([sys.executable, str(HERE / "gpu_train_driver.py"), str(config), str(run_dir), "0", *overrides], tmp)
    (tmp / f"{name}.stdout.txt").write_text(out)
    print(out[-1200:])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def evaluate(tmp: Path, checkpoint: Path, overrides: list[str], *extra: str) -> dict[str, Any]:
    out = sh([sys.executable, str(EXAMPLE / "evaluate.py"), "--config", str(EXAMPLE / "grpo.yaml"), "--checkpoint",
              str(checkpoint), "--prompts", str(tmp / "data" / "heldout.jsonl"), *extra, *overrides], tmp)
    print(next(line for line in out.splitlines() if line.startswith("held-out accuracy")))
    return json.loads(next(line for line in out.splitlines() if line.startswith("ACCURACY "))[9:])


def test_grpo_example_raises_held_out_accuracy(tmp_path: Path) -> None:
    data = tmp_path / "data"
    sh([sys.executable, str(EXAMPLE / "make_data.py"), "--out", str(data), "--heldout", str(HELD_OUT)], tmp_path)
    model = [f"model.hf_config={data}/model", f"data.tokenizer={data}/model"]
    sft_ckpt, grpo_ckpt = tmp_path / "sft" / "checkpoints", tmp_path / "grpo" / "checkpoints"

    sft = train(tmp_path, "sft", EXAMPLE / "sft.yaml", [*model, f"data.paths=[{data}/sft.jsonl]",
                                                        f"checkpoint.dir={sft_ckpt}"])
    assert sft[-1]["loss"] < sft[0]["loss"] - 1.0
    before = evaluate(tmp_path, sft_ckpt, model)

    rewards = json.dumps([{"function": "mcorekit.train.rewards:math_answer", "weight": 1.0},
                          {"function": f"{EXAMPLE}/rewards.py:digits_only", "weight": 0.1}])
    grpo = train(tmp_path, "grpo", EXAMPLE / "grpo.yaml", [*model, f"data.paths=[{data}/train.jsonl]",
                                                           f"checkpoint.load={sft_ckpt}", f"checkpoint.dir={grpo_ckpt}",
                                                           f"grpo.rewards={rewards}"])
    hf = tmp_path / "hf"
    sh([sys.executable, "-m", "mcorekit.cli", "convert", "mcore-to-hf", str(grpo_ckpt), str(hf), "--hf-config",
        str(data / "model"), "--quiet"], tmp_path)
    after = evaluate(tmp_path, grpo_ckpt, model, "--hf", str(hf), "--backend", "auto,plain")

    # the share of each step spent generating: the loop logs tokens/s of the whole step (gbs x seq_length tokens)
    tokens_per_step = 256 * 16
    shares = [x["gen_seconds"] / (tokens_per_step / x["tokens_per_s"]) for x in grpo[1:]]
    first, last = grpo[:5], grpo[-5:]
    print(f"GRPO reward_mean first 5 steps {statistics.mean(x['reward_mean'] for x in first):.3f} -> last 5 "
          f"{statistics.mean(x['reward_mean'] for x in last):.3f}; groups all equal {last[-1]['groups_all_equal']:.2f}; "
          f"kl {last[-1]['kl']:.4f}; response length {last[-1]['response_length']:.2f}")
    print(f"generation: {statistics.median(x['gen_tokens_per_s'] for x in grpo[1:]):.0f} tokens/s in training "
          f"(median), {statistics.median(shares):.0%} of a step (median; prev_gen_share "
          f"{statistics.median(x['prev_gen_share'] for x in grpo[2:]):.0%}), peak {max(x['gen_mem_gb'] for x in grpo):.2f} GB")
    engines = after["backends"]
    print("held-out generation tokens/s: " + ", ".join(f"{k} {v['tokens_per_s']:.0f}" for k, v in engines.items())
          + f", transformers generate {after['hf_tokens_per_s']:.0f} (same completions as ours: "
          f"{after['same_completion']:.0%}; transformers' accuracy {after['hf_accuracy']:.3f})")
    se = math.sqrt(max(before["accuracy"] * (1 - before["accuracy"]), 0.05) / HELD_OUT)
    print(f"HELD-OUT ACCURACY before GRPO {before['accuracy']:.3f} ({before['correct']}/{HELD_OUT}), after "
          f"{after['accuracy']:.3f} ({after['correct']}/{HELD_OUT}), standard error {se:.3f}")

    assert len(grpo) == 60 and all(math.isfinite(x["loss"]) for x in grpo)
    assert all(x["clip_fraction"] == 0.0 for x in grpo)  # one optimizer step per generation batch: ratio 1
    assert all(x["gen_tokens_per_s"] > 0 and 0 < s < 1 for x, s in zip(grpo[1:], shares))
    assert statistics.mean(x["reward_mean"] for x in last) > statistics.mean(x["reward_mean"] for x in first)
    assert engines["plain"]["same_as_first"] > 0.95  # greedy: the engine and the plain loop agree (bf16 ties aside)
    assert after["same_completion"] > 0.9  # and transformers on the converted model
    assert after["accuracy"] > before["accuracy"] + 3 * se, (before, after)
