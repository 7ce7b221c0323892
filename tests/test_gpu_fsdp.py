"""On a machine with 2+ GPUs: Megatron-FSDP (parallel.fsdp) trains correctly, what each strategy costs, and its
checkpoints move to and from plain data parallelism.

- At FSDP2 (DP2), each strategy (optim, optim_grads, optim_grads_params) gives the one-GPU run's losses within the
  agreement tolerances of tests/test_gpu_multi.py (same seed, so the same initial weights, same batches).
- On the 3B shape (24 x 3072, GQA 24/8, FFN 8192, vocab 32768; seq 2048, mbs 1), each strategy's peak memory per
  GPU next to the launcher's estimate (launch/plan.py), and its tokens/s next to the distributed optimizer's
  (these runs go one at a time, so the two GPUs are theirs alone).
- Checkpoints (train/checkpoint.py): every small run saves at its last step (fsdp_dtensor under FSDP). Saved at
  FSDP2 after step 10 and resumed at FSDP2, steps 11-20 give the uninterrupted run's losses (model, optimizer,
  scheduler, step all restored). Across formats only the weights, scheduler and step move (the optimizer starts
  fresh): saved at FSDP2 and resumed at DP2, and the reverse, step 11's loss (computed with the loaded weights,
  before any update) equals the uninterrupted run's step 11, and the later steps stay finite and below step 1's
  loss (fresh Adam moments change the trajectory, so they are not compared step by step).

Runs start through tests/slurm_shim (a MOCK of srun giving each task Slurm's environment) and
tests/gpu_fsdp_driver.py, as tests/test_gpu_multi.py does. Megatron-FSDP needs CUDA_DEVICE_MAX_CONNECTIONS unset or
> 1, so it is removed from the runs' environment.

    cd tests && python3 -m pytest test_gpu_fsdp.py -v -s     (as make test-gpu-multi runs test_gpu_multi.py)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpus import needs_two

HERE = Path(__file__).parent
SHIM = HERE / "slurm_shim"
pytestmark = pytest.mark.gpu

STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
# The agreement test's bf16 tolerances (tests/test_gpu_multi.py): only the order of reductions differs.
STEP1_TOL, STEP_TOL, MEAN_TOL = 5e-3, 0.03, 0.01
STEPS = 20


# A small Llama (as test_gpu_multi.py's dense model): random weights from the seed, mock data, 20 steps.
TINY = {"model": {"preset": "llama-tiny", "overrides": {"hidden_size": 256, "num_attention_heads": 8,
                                                        "num_query_groups": 4, "kv_channels": 32,
                                                        "ffn_hidden_size": 704, "vocab_size": 512}},
        "data": {"seq_length": 256, "seed": 7}, "precision": {"dtype": "bf16"},
        "schedule": {"train_iters": STEPS, "warmup_iters": 2, "micro_batch_size": 2, "global_batch_size": 8},
        "optimizer": {"lr": 1e-3, "min_lr": 1e-4},
        "checkpoint": {"save_interval": 1000, "keep_last": 2}, "logging": {"log_interval": 1}}
# The 3B shape of bench/ and docs/results.md, for memory and throughput.
MID = {"model": {"preset": "llama-3b"}, "data": {"seq_length": 2048, "seed": 7}, "precision": {"dtype": "bf16"},
       "schedule": {"train_iters": 8, "warmup_iters": 1, "micro_batch_size": 1, "global_batch_size": 8},
       "checkpoint": {"save_interval": 1000}, "logging": {"log_interval": 1}}


@pytest.fixture(scope="module")
def shim_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    for tool in ("sbatch", "srun", "scontrol"):
        (SHIM / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    return {**env, "PATH": f"{SHIM}:{os.environ['PATH']}", "UB_SKIPMC": "1",
            "SLURM_SHIM_STATE": str(tmp_path_factory.mktemp("slurm-state"))}


def start(env: dict, run_dir: Path, cfg: dict, ntasks: int, stop_at: int = 0, save: bool = True) -> tuple[subprocess.Popen, Path]:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"name": run_dir.name, **cfg}))
    log = run_dir / f"log{stop_at}-{cfg.get('parallel', {}).get('fsdp')}"
    cmd = [sys.executable, str(HERE / "gpu_fsdp_driver.py"), str(run_dir / "config.yaml"), str(run_dir), str(stop_at)]
    proc = subprocess.Popen([str(SHIM / "srun"), "-n", str(ntasks), "--output", f"{log}.%t", "--error", f"{log}.%t",
                             *cmd, *([] if save else ["--no-save"])], env=env)
    return proc, log


def tail(log: Path, ntasks: int = 2) -> str:
    return "\n".join(f"--- task {t}\n" + Path(f"{log}.{t}").read_text()[-3000:] for t in range(ntasks)
                     if Path(f"{log}.{t}").exists())


def fsdp(strategy: str | None) -> dict:
    return {"parallel": {"fsdp": strategy}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, shim_env: dict) -> dict:
    """name -> (exit code, log, run folder). The small runs share the GPUs at once; the 3B runs go one at a time."""
    tmp = tmp_path_factory.mktemp("fsdp")
    started = {"1gpu": start(shim_env, tmp / "1gpu", TINY, 1) + (tmp / "1gpu",),
               "dp2": start(shim_env, tmp / "dp2", TINY, 2) + (tmp / "dp2",)}
    for s in STRATEGIES:  # each saves at step 20: the fsdp_dtensor save of every strategy
        started[s] = start(shim_env, tmp / s, {**TINY, **fsdp(s)}, 2) + (tmp / s,)
    # Saved after step 10 (exit for requeue), then resumed in the same run folder at the same or the other layout.
    moves = {"fsdp-to-fsdp": ("optim_grads_params", "optim_grads_params"),
             "fsdp-to-dp2": ("optim_grads_params", None), "dp2-to-fsdp": (None, "optim_grads_params")}
    for name, (first, _) in moves.items():
        started[f"{name}-first"] = start(shim_env, tmp / name, {**TINY, **fsdp(first)}, 2, stop_at=10) + (tmp / name,)
    results = {name: (proc.wait(timeout=600), log, out) for name, (proc, log, out) in started.items()}
    resumed = {}
    for name, (_, then) in moves.items():
        if results[f"{name}-first"][0] == 3:
            resumed[f"{name}-resumed"] = start(shim_env, tmp / name, {**TINY, **fsdp(then)}, 2) + (tmp / name,)
    results.update({name: (proc.wait(timeout=600), log, out) for name, (proc, log, out) in resumed.items()})
    for s in (None,) + STRATEGIES:
        name = f"3b-{s or 'dist-opt'}"
        proc, log = start(shim_env, tmp / name, {**MID, **fsdp(s)}, 2, save=False)
        results[name] = (proc.wait(timeout=600), log, tmp / name)
    return results


def metric(run: tuple, key: str = "loss") -> list[float]:
    return [json.loads(x)[key] for x in (run[2] / "metrics.jsonl").read_text().splitlines()]


def compare(got: list[float], ref: list[float]) -> dict[str, float]:
    diffs = [abs(a - b) for a, b in zip(got, ref)]
    return {"step1": diffs[0], "max": max(diffs), "mean": sum(diffs) / len(diffs)}


@needs_two
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fsdp2_matches_single_gpu(runs: dict, strategy: str) -> None:
    for key in ("1gpu", strategy):
        assert runs[key][0] == 0, tail(runs[key][1], 1 if key == "1gpu" else 2)
    got, ref = metric(runs[strategy]), metric(runs["1gpu"])
    assert len(got) == len(ref) == STEPS
    d = compare(got, ref)
    g_got, g_ref = metric(runs[strategy], "grad_norm")[0], metric(runs["1gpu"], "grad_norm")[0]
    print(f"FSDP2 {strategy}: losses {got[0]:.4f} -> {got[-1]:.4f} (1 GPU {ref[0]:.4f} -> {ref[-1]:.4f}); |diff| "
          f"step 1 {d['step1']:.2e}, max {d['max']:.2e}, mean {d['mean']:.2e}; step-1 grad norm {g_got:.4f} "
          f"(1 GPU {g_ref:.4f})")
    assert ref[-1] < ref[0] - 0.3  # the reference learns, so agreement is not two flat lines
    assert abs(g_got - g_ref) <= 0.02 * g_ref, f"step-1 gradient norm {g_got:.4f}, 1 GPU {g_ref:.4f}"
    assert d["step1"] <= STEP1_TOL and d["max"] <= STEP_TOL and d["mean"] <= MEAN_TOL, d


def peak(run: tuple) -> dict[str, float]:
    """The larger rank's peak allocated and reserved memory, GiB."""
    ranks = [json.loads(f.read_text()) for f in sorted(run[2].glob("memory.rank*.json"))]
    return {k: max(r[k] for r in ranks) / 1024**3 for k in ("allocated", "reserved")}


@needs_two
def test_3b_memory_and_throughput_per_strategy(runs: dict) -> None:
    """Peak memory per GPU next to the estimate, and tokens/s (steps 3-8, both GPUs together) of each strategy."""
    from mcorekit.launch.plan import GiB, estimate_memory
    from mcorekit.models.parallel import Layout
    from mcorekit.models.spec import PRESETS

    rows = {}
    for s in (None,) + STRATEGIES:
        run = runs[f"3b-{s or 'dist-opt'}"]
        assert run[0] == 0, tail(run[1])
        est = estimate_memory(PRESETS["llama-3b"], Layout(), 2, 2048, 1, fsdp=s)
        tokens = metric(run, "tokens_per_s")[2:]
        rows[s] = {"est": est.total / GiB, "est_no_overhead": (est.total - est.overhead) / GiB, **peak(run),
                   "tokens_per_s": sum(tokens) / len(tokens)}
    base = rows[None]["tokens_per_s"]
    print("\n3B, 2 GPUs, seq 2048, mbs 1, gbs 8 (GiB per GPU; the estimate with and without its 3 GiB overhead)")
    for s, r in rows.items():
        print(f"  {s or 'dist-opt':<20} estimate {r['est']:5.1f} ({r['est_no_overhead']:5.1f})  peak allocated "
              f"{r['allocated']:5.1f}  reserved {r['reserved']:5.1f}  tokens/s {r['tokens_per_s']:9.0f} "
              f"({r['tokens_per_s'] / base:.2f}x dist-opt)")
    # Sharding more keeps less: each strategy's peak below the one sharding less (optim = the distributed optimizer).
    assert rows["optim_grads_params"]["allocated"] < rows["optim_grads"]["allocated"] < rows["optim"]["allocated"]
    assert abs(rows["optim"]["allocated"] - rows[None]["allocated"]) <= 0.15 * rows[None]["allocated"]
    for s, r in rows.items():  # the estimate is a planning bound: within reach of what the GPU held
        assert 0.5 * r["est_no_overhead"] <= r["allocated"] <= 1.1 * r["est"], (s, r)


def resumed(runs: dict, name: str, reference: str) -> tuple[list[float], list[float], dict[str, float]]:
    assert runs[f"{name}-first"][0] == 3, tail(runs[f"{name}-first"][1])  # 3: saved at step 10, exit for requeue
    assert runs[f"{name}-resumed"][0] == 0, tail(runs[f"{name}-resumed"][1])
    assert runs[reference][0] == 0, tail(runs[reference][1])
    steps = [json.loads(x)["step"] for x in (runs[f"{name}-resumed"][2] / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    got, full = metric(runs[f"{name}-resumed"]), metric(runs[reference])
    d = compare(got[10:], full[10:])
    print(f"{name}, steps 11-20: {[round(x, 4) for x in got[10:]]}\n  uninterrupted {reference}: "
          f"{[round(x, 4) for x in full[10:]]}\n  |diff| step 11 {d['step1']:.2e}, max {d['max']:.2e}, "
          f"mean {d['mean']:.2e}")
    return got, full, d


@needs_two
def test_fsdp2_checkpoint_resumes_at_fsdp2_exactly(runs: dict) -> None:
    """Model, optimizer, scheduler and step come back: the resumed steps are the uninterrupted run's."""
    _, _, d = resumed(runs, "fsdp-to-fsdp", "optim_grads_params")
    assert d["max"] <= STEP1_TOL and d["mean"] <= STEP1_TOL, d


def weights_only_check(runs: dict, name: str, reference: str) -> None:
    """Across the FSDP boundary: weights, scheduler and step; fresh optimizer (a loud warning says so)."""
    got, full, d = resumed(runs, name, reference)
    assert d["step1"] <= STEP1_TOL, d  # step 11's loss comes from the loaded weights alone
    assert all(math.isfinite(x) and x < got[0] for x in got[10:]), got[10:]
    log = runs[f"{name}-resumed"][1]
    assert "OPTIMIZER STARTS FRESH" in Path(f"{log}.0").read_text(), tail(log)


@needs_two
def test_checkpoint_saved_at_fsdp2_resumes_at_dp2(runs: dict) -> None:
    weights_only_check(runs, "fsdp-to-dp2", "optim_grads_params")


@needs_two
def test_checkpoint_saved_at_dp2_resumes_at_fsdp2(runs: dict) -> None:
    weights_only_check(runs, "dp2-to-fsdp", "dp2")
