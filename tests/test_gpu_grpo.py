"""On the GPU machine (one H200): the GRPO example end to end (examples/grpo), each stage in its own process as a
user runs it. Data and a character tokenizer are made by the example's generator; a small Llama (random weights) is
SFT-trained briefly on multi-digit addition, its greedy held-out accuracy measured (examples/grpo/evaluate.py,
through train/generate.py), then GRPO-trained from that checkpoint (rollouts from the training model itself through
Megatron-Core's inference engine), converted to HF, and measured again: held-out accuracy after vs before, over
256 prompts; generation tokens/s of our engine(s) next to transformers' generate on the converted model in the same
process; the share of each GRPO step spent generating.

Also: a GRPO run stopped by SIGUSR2 and resumed continues as the uninterrupted one; with 2+ GPUs the same steps at
TP2 and DP2 (ranks through the Slurm shim, as test_gpu_multi.py starts them).

    python3 -m pytest -s tests/test_gpu_grpo.py      # prints both accuracies, tokens/s, generation share
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpus import needs_two

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EXAMPLE = REPO / "examples" / "grpo"
HELD_OUT = 256
GRPO_STEPS = 60  # examples/grpo/grpo.yaml's schedule.train_iters
# the short runs' schedules (tests/test_grpo.py checks them against the rules on CPU: a refused one wastes a GPU call)
RESUME_RUN = ["schedule.train_iters=8", "schedule.warmup_iters=2", "checkpoint.save_interval=100"]
LAYOUT_RUN = ["schedule.train_iters=6", "schedule.warmup_iters=2", "checkpoint.save_interval=100"]


def sh(cmd: list[str], cwd: Path, timeout: int = 600) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def train(tmp: Path, name: str, config: Path, overrides: list[str], stop_at: int = 0, expect: int = 0,
          ntasks: int = 1, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One training run through tests/gpu_train_driver.py (with ntasks > 1 through the Slurm shim's srun, as
    test_gpu_multi.py starts ranks); stop_at: SIGUSR2 after that step (save, exit for requeue: exit code 3)."""
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HERE / "gpu_train_driver.py"), str(config), str(run_dir), str(stop_at), *overrides]
    if ntasks > 1:
        cmd = [str(HERE / "slurm_shim" / "srun"), "-n", str(ntasks), "--output", f"{run_dir}/log.%t", "--error",
               f"{run_dir}/log.%t", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=600, env=env)
    logs = "".join(p.read_text()[-3000:] for p in sorted(run_dir.glob("log.*")))
    assert proc.returncode == expect, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}\n{logs}"
    (tmp / f"{name}.stdout.txt").write_text(proc.stdout + logs)
    print((proc.stdout + logs)[-1200:])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def evaluate(tmp: Path, checkpoint: Path, overrides: list[str], *extra: str) -> dict[str, Any]:
    out = sh([sys.executable, str(EXAMPLE / "evaluate.py"), "--config", str(EXAMPLE / "grpo.yaml"), "--checkpoint",
              str(checkpoint), "--prompts", str(tmp / "data" / "heldout.jsonl"), *extra, *overrides], tmp)
    print(next(line for line in out.splitlines() if line.startswith("held-out accuracy")))
    return json.loads(next(line for line in out.splitlines() if line.startswith("ACCURACY "))[9:])


@pytest.fixture(scope="module")
def sft(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The example's data and its SFT run (the starting point of every GRPO run here)."""
    tmp = tmp_path_factory.mktemp("grpo-example")
    data = tmp / "data"
    sh([sys.executable, str(EXAMPLE / "make_data.py"), "--out", str(data), "--heldout", str(HELD_OUT)], tmp)
    model = [f"model.hf_config={data}/model", f"data.tokenizer={data}/model"]
    ckpt = tmp / "sft" / "checkpoints"
    metrics = train(tmp, "sft", EXAMPLE / "sft.yaml", [*model, f"data.paths=[{data}/sft.jsonl]", f"checkpoint.dir={ckpt}"])
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    rewards = json.dumps([{"function": "mcorekit.train.rewards:exact_match", "weight": 1.0},
                          {"function": f"{EXAMPLE}/rewards.py:digits_correct", "weight": 0.5}])
    grpo = [*model, f"data.paths=[{data}/train.jsonl]", f"checkpoint.load={ckpt}", f"grpo.rewards={rewards}"]
    return {"tmp": tmp, "data": data, "model": model, "checkpoint": ckpt, "grpo": grpo}


def test_grpo_example_raises_held_out_accuracy(sft: dict[str, Any]) -> None:
    tmp, data, model = sft["tmp"], sft["data"], sft["model"]
    before = evaluate(tmp, sft["checkpoint"], model)
    grpo_ckpt = tmp / "grpo" / "checkpoints"
    grpo = train(tmp, "grpo", EXAMPLE / "grpo.yaml", [*sft["grpo"], f"checkpoint.dir={grpo_ckpt}"])
    hf = tmp / "hf"
    sh([sys.executable, "-m", "mcorekit.cli", "convert", "mcore-to-hf", str(grpo_ckpt), str(hf), "--hf-config",
        str(data / "model"), "--quiet"], tmp)
    after = evaluate(tmp, grpo_ckpt, model, "--hf", str(hf), "--backend", "auto,plain")

    # the share of each step spent generating: a step logs the one before's (prev_gen_share), from step 2 on
    shares = [x["prev_gen_share"] for x in grpo[2:]]
    first, last = grpo[:5], grpo[-5:]
    print(f"GRPO reward_mean first 5 steps {statistics.mean(x['reward_mean'] for x in first):.3f} -> last 5 "
          f"{statistics.mean(x['reward_mean'] for x in last):.3f}; groups all equal {last[-1]['groups_all_equal']:.2f}; "
          f"kl {last[-1]['kl']:.4f}; response length {last[-1]['response_length']:.2f}")
    print(f"generation: {statistics.median(x['gen_tokens_per_s'] for x in grpo[1:]):.0f} tokens/s in training "
          f"(median), {statistics.median(shares):.0%} of a step (median of prev_gen_share), peak "
          f"{max(x['gen_mem_gb'] for x in grpo):.2f} GB")
    engines = after["backends"]
    print("held-out generation tokens/s: " + ", ".join(f"{k} {v['tokens_per_s']:.0f}" for k, v in engines.items())
          + f", transformers generate {after['hf_tokens_per_s']:.0f} (same completions as ours: "
          f"{after['same_completion']:.0%}; transformers' accuracy {after['hf_accuracy']:.3f})")
    se = math.sqrt(max(before["accuracy"] * (1 - before["accuracy"]), 0.05) / HELD_OUT)
    print(f"HELD-OUT ACCURACY before GRPO {before['accuracy']:.3f} ({before['correct']}/{HELD_OUT}), after "
          f"{after['accuracy']:.3f} ({after['correct']}/{HELD_OUT}), standard error {se:.3f}")

    assert len(grpo) == GRPO_STEPS and all(math.isfinite(x["loss"]) for x in grpo)
    assert all(x["clip_fraction"] == 0.0 for x in grpo)  # one optimizer step per generation batch: ratio 1
    assert all(x["gen_tokens_per_s"] > 0 for x in grpo[1:]) and all(0 < s < 1 for s in shares)
    assert not {"tokens_per_s", "mfu"} & set(grpo[-1])  # the loop's rates would count generation as training
    assert statistics.mean(x["reward_mean"] for x in last) > statistics.mean(x["reward_mean"] for x in first)
    assert engines["plain"]["same_as_first"] > 0.95  # greedy: the engine and the plain loop agree (bf16 ties aside)
    assert after["same_completion"] > 0.9  # and transformers on the converted model
    assert after["accuracy"] > before["accuracy"] + 3 * se, (before, after)


def test_grpo_resume_continues_the_run(sft: dict[str, Any]) -> None:
    """Stopped by SIGUSR2 after step 4 (save, exit for requeue), restarted: steps 5-8 generate from the same prompts
    with the same seeds and train to the losses and rewards of the uninterrupted run."""
    tmp = sft["tmp"]
    short = [*sft["grpo"], *RESUME_RUN]
    whole = train(tmp, "grpo-8", EXAMPLE / "grpo.yaml", [*short, f"checkpoint.dir={tmp}/grpo-8/checkpoints"])
    cut = [*short, f"checkpoint.dir={tmp}/grpo-cut/checkpoints"]
    train(tmp, "grpo-cut", EXAMPLE / "grpo.yaml", cut, stop_at=4, expect=3)
    both = train(tmp, "grpo-cut", EXAMPLE / "grpo.yaml", cut)
    assert [x["step"] for x in both] == list(range(1, 5)) + list(range(5, 9))
    for a, b in zip(whole[4:], both[4:]):
        print(f"step {a['step']}: reward {a['reward_mean']:.4f} / {b['reward_mean']:.4f}, loss {a['loss']:.5f} / "
              f"{b['loss']:.5f}")
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=0.02)
        assert a["loss"] == pytest.approx(b["loss"], abs=0.02)


@needs_two
def test_grpo_at_tp2_and_dp2(sft: dict[str, Any]) -> None:
    """The same GRPO steps at TP2 (the engine on a tensor-parallel model) and DP2 (each rank its own prompts) as on
    one GPU: the first step's rewards agree with one GPU's (TP2: the same samples but for bf16 near-ties; DP2: the
    same prompts, other samples on rank 1), every step is finite."""
    tmp = sft["tmp"]
    for tool in ("sbatch", "srun", "scontrol"):
        (HERE / "slurm_shim" / tool).chmod(0o755)
    (tmp / "slurm-state").mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{HERE / 'slurm_shim'}:{os.environ['PATH']}", "UB_SKIPMC": "1",
           "SLURM_SHIM_STATE": str(tmp / "slurm-state")}
    short = [*sft["grpo"], *LAYOUT_RUN]
    one = train(tmp, "grpo-1gpu", EXAMPLE / "grpo.yaml", [*short, f"checkpoint.dir={tmp}/g1/checkpoints"])
    for name, layout in (("tp2", ["parallel.tp=2"]), ("dp2", [])):
        got = train(tmp, f"grpo-{name}", EXAMPLE / "grpo.yaml", [*short, *layout, f"checkpoint.dir={tmp}/{name}/ckpt"],
                    ntasks=2, env=env)
        print(f"{name}: reward_mean {[round(x['reward_mean'], 3) for x in got]} (1 GPU "
              f"{[round(x['reward_mean'], 3) for x in one]}), gen tokens/s {got[-1]['gen_tokens_per_s']:.0f}")
        assert len(got) == 6 and all(math.isfinite(x["loss"]) for x in got)
        assert abs(got[0]["reward_mean"] - one[0]["reward_mean"]) < 0.1
