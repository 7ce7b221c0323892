"""Megatron-FSDP (parallel.fsdp) on CPU: the rules it adds, its DDP config (Megatron-Core's own object, constructed),
the memory estimate of each strategy against hand-computed bytes for the 0.89B and 3B shapes, and `launch plan`
(FSDP proposals, the stated memory assumption, the cut list, recompute, presets by a near-miss name)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import pytest

from mcorekit.config.experiment import load_experiment
from mcorekit.config.rules import Nodes, problems
from mcorekit.errors import ConfigError
from mcorekit.launch.plan import GiB, estimate_memory, plan
from mcorekit.models.parallel import Layout
from mcorekit.models.spec import PRESETS
from single_rank import single_rank_env

NODE = Nodes(transformer_engine=True, gpus=False)  # the layout and option rules, not Megatron's own GPU-side checks
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


def exp(*overrides: str) -> Any:
    return load_experiment("examples/llama-tiny.yaml", list(overrides))


# ---------------------------------------------------------------- rules


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fsdp_combines_with_tp_sp_cp_and_dp(strategy: str) -> None:
    assert problems(exp(f"parallel.fsdp={strategy}"), 2, NODE) == []
    assert problems(exp(f"parallel.fsdp={strategy}", "parallel.tp=2", "parallel.sequence_parallel=true"), 4, NODE) == []
    assert problems(exp(f"parallel.fsdp={strategy}", "parallel.cp=2"), 4, NODE) == []


def test_fsdp_combines_with_expert_parallelism() -> None:
    moe = load_experiment("examples/llama-tiny.yaml", ["model.preset=mixtral-tiny", "parallel.ep=2",
                                                       "parallel.fsdp=optim_grads_params"])
    assert problems(moe, 4, NODE) == []


@pytest.mark.parametrize("overrides,needle", [
    (["parallel.pp=2"], "with pipeline parallelism (pp=2, vpp=None): Megatron-FSDP lays its device mesh over DP x EP x TP"),
    (["parallel.pp=2", "parallel.vpp=2"], "with pipeline parallelism (pp=2, vpp=2)"),
    (["parallel.fsdp=optim_grads", "optimizer.distributed=false", "optimizer.overlap_param_gather=false"],
     "runs the distributed optimizer in its FSDP mode: set optimizer.distributed=true"),
    (["optimizer.overlap_grad_reduce=false"], "always overlapped: set optimizer.overlap_grad_reduce=true"),
    (["optimizer.overlap_param_gather=false"], "optim_grads_params all-gathers each layer's weights ahead of its use"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "optimizer.tp_comm_overlap=true"],
     "with optimizer.tp_comm_overlap: TE's TP overlap needs one CUDA hardware queue"),
    (["precision.fp8=delayed", "precision.fp8_params=true"], "with precision.fp8_params"),
    (["checkpoint.load=/ckpt/run/iter_0000100"], "with checkpoint.load: only its weights load into Megatron-FSDP "
                                                 "(another run's optimizer state does not); set checkpoint.finetune=true"),
    (["checkpoint.async_save=true"], "with checkpoint.async_save"),
])
def test_fsdp_refusals_name_the_rule(overrides: list[str], needle: str) -> None:
    """Each refused combination (with optim_grads_params unless the case names another strategy), one rule each."""
    got = problems(exp("parallel.fsdp=optim_grads_params", *overrides), 4, NODE)
    assert any(needle in p for p in got), got
    assert sum("parallel.fsdp" in p for p in got) == 1, got  # one rule each


def test_overlap_rules_follow_the_strategy() -> None:
    # `optim` keeps whole gradients and weights: its reductions may run after the backward pass.
    assert problems(exp("parallel.fsdp=optim", "optimizer.overlap_grad_reduce=false",
                        "optimizer.overlap_param_gather=false"), 2, NODE) == []
    got = problems(exp("parallel.fsdp=optim_grads", "optimizer.overlap_param_gather=false"), 2, NODE)
    assert got == []
    got = problems(exp("parallel.fsdp=optim_grads", "optimizer.overlap_grad_reduce=false"), 2, NODE)
    assert len(got) == 1 and "overlap_grad_reduce=true (or use parallel.fsdp=optim)" in got[0]


def test_launcher_refuses_before_queueing() -> None:
    from mcorekit.config.cluster import load_profile
    from mcorekit.errors import LayoutError
    from mcorekit.launch.plan import check

    with pytest.raises(LayoutError, match="parallel.fsdp=optim_grads with pipeline parallelism"):
        check(exp("parallel.fsdp=optim_grads", "parallel.pp=2", "schedule.global_batch_size=8"),
              load_profile("example-h100"))


# ---------------------------------------------------------------- experiment -> Megatron-FSDP's DDP config


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ddp_config_selects_megatron_fsdp(strategy: str) -> None:
    import torch

    from mcorekit.config.megatron import ddp_config

    # Both overlaps off in the experiment (the rules refuse that for the sharded strategies; the mapping still
    # turns on what Megatron-FSDP requires).
    c = ddp_config(exp(f"parallel.fsdp={strategy}", "optimizer.overlap_grad_reduce=false",
                       "optimizer.overlap_param_gather=false"))
    assert c.use_megatron_fsdp and c.data_parallel_sharding_strategy == strategy
    assert c.use_distributed_optimizer and not c.average_in_collective
    assert c.megatron_fsdp_main_params_dtype == torch.float32 and c.megatron_fsdp_main_grads_dtype == torch.float32
    assert c.overlap_grad_reduce == (strategy != "optim")
    assert c.overlap_param_gather == (strategy == "optim_grads_params")
    assert c.bucket_size == 40_000_000 and c.check_for_nan_in_grad


def test_without_fsdp_the_ddp_config_is_plain_ddp() -> None:
    from mcorekit.config.megatron import ddp_config

    c = ddp_config(exp())
    assert not c.use_megatron_fsdp and c.data_parallel_sharding_strategy == "no_shard"
    assert c.average_in_collective and c.grad_reduce_in_fp32 and c.overlap_grad_reduce and c.overlap_param_gather


def test_wrap_chunk_refuses_a_single_hardware_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcorekit.errors import ConfigError
    from mcorekit.train.fsdp import require_parallel_streams

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ConfigError, match="needs CUDA_DEVICE_MAX_CONNECTIONS unset or > 1"):
        require_parallel_streams()
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    require_parallel_streams()


# ---------------------------------------------------------------- memory, by hand

# 0.89B (examples/llama-0.9b.yaml): 16 layers, hidden 2048, 16 heads of 128, 8 KV groups, SwiGLU 5632, vocab 32768
ATTN_09 = 2048 * (16 + 2 * 8) * 128 + 16 * 128 * 2048  # QKV + output projection = 12,582,912
LAYER_09 = ATTN_09 + 3 * 2048 * 5632 + 2 * 2048  # + gate/up/down + two norms = 47,190,016
OUTSIDE_09 = 2 * 32768 * 2048 + 2048  # embedding + output layer (untied) + final norm = 134,219,776
N_09 = 16 * LAYER_09 + OUTSIDE_09  # 889,260,032
# 3B (bench/docs): 24 layers, hidden 3072, 24 heads of 128, 8 KV groups, SwiGLU 8192, vocab 32768 (llama preset)
ATTN_3B = 3072 * (24 + 2 * 8) * 128 + 24 * 128 * 3072  # 25,165,824
LAYER_3B = ATTN_3B + 3 * 3072 * 8192 + 2 * 3072  # 100,669,440
OUTSIDE_3B = 2 * 32768 * 3072 + 3072  # 201,329,664
N_3B = 24 * LAYER_3B + OUTSIDE_3B  # 2,617,396,224


def test_hand_counts_are_the_presets() -> None:
    assert PRESETS["llama-0.9b"].num_parameters() == N_09 == 889_260_032
    assert PRESETS["llama-3b"].num_parameters() == N_3B == 2_617_396_224


@pytest.mark.parametrize("name,n,layer,outside,L,h,dp", [
    ("llama-0.9b", N_09, LAYER_09, OUTSIDE_09, 16, 2048, 8),
    ("llama-3b", N_3B, LAYER_3B, OUTSIDE_3B, 24, 3072, 2),
])
def test_each_strategy_by_hand(name: str, n: int, layer: int, outside: int, L: int, h: int, dp: int) -> None:
    """TP1 PP1, DP = the world, seq 2048, mbs 1: bytes per GPU of each part, written out."""
    m = PRESETS[name]
    est = {s: estimate_memory(m, Layout(), world=dp, seq=2048, mbs=1, fsdp=s) for s in (None,) + STRATEGIES}
    activations = 34 * 2048 * h * L  # 34*s*b*h per layer (unchanged by any sharding over DP)
    bucket = 40_000_000  # optimizer.bucket_size
    # The distributed optimizer and `optim`: bf16 weights 2n, fp32 grads 4n, optimizer (fp32 main + Adam m, v) 12n/DP.
    for s in (None, "optim"):
        e = est[s]
        assert (e.weights, e.grads, e.buffers) == (2 * n, 4 * n, 0)
        assert e.optimizer == pytest.approx(12 * n / dp) and e.activations == pytest.approx(activations)
        assert e.overhead == 3 * GiB
    # optim_grads: grads 4n/DP, plus two 40M-parameter buckets of fp32 gradients before their reduce-scatter.
    e = est["optim_grads"]
    assert e.weights == 2 * n and e.grads == pytest.approx(4 * n / dp) and e.optimizer == pytest.approx(12 * n / dp)
    assert e.buffers == 2 * bucket * 4
    # optim_grads_params: the layers' weights 2*(L*layer)/DP, embedding/output/final norm whole (2*outside); buffers:
    # two layers of fp32 grads (8*layer) and two layers all-gathered in bf16 (4*layer).
    e = est["optim_grads_params"]
    assert e.weights == pytest.approx(2 * outside + 2 * L * layer / dp)
    assert e.grads == pytest.approx(4 * n / dp) and e.optimizer == pytest.approx(12 * n / dp)
    assert e.buffers == pytest.approx(2 * layer * 4 + 2 * layer * 2)
    assert e.total == pytest.approx(2 * outside + 2 * L * layer / dp + 16 * n / dp + 12 * layer + activations + 3 * GiB)
    assert est["optim_grads_params"].total < est["optim_grads"].total < est["optim"].total


def test_3b_on_two_gpus_in_gib() -> None:
    """The mid shape the two-GPU test measures (seq 2048, mbs 1, DP2), in GiB as `launch plan` prints them."""
    m = PRESETS["llama-3b"]
    act = 34 * 2048 * 3072 * 24 / GiB  # 4.78
    ddp = estimate_memory(m, Layout(), 2, 2048, 1)
    assert ddp.total / GiB == pytest.approx(2 * N_3B / GiB + 4 * N_3B / GiB + 6 * N_3B / GiB + act + 3)  # 37.0
    assert ddp.total / GiB == pytest.approx(37.03, abs=0.01)
    zero3 = estimate_memory(m, Layout(), 2, 2048, 1, fsdp="optim_grads_params")
    assert zero3.total / GiB == pytest.approx(
        (2 * OUTSIDE_3B + 24 * LAYER_3B + 8 * N_3B + 12 * LAYER_3B) / GiB + act + 3)
    assert zero3.total / GiB == pytest.approx(31.03, abs=0.01)


def test_moe_expert_parameters_shard_over_expert_data_parallel() -> None:
    m = PRESETS["moe-8x-1.4b"]
    expert = 16 * 8 * 3 * 2048 * 1408  # layers x experts x (gate, up, down) x h x moe_ffn
    dense = m.num_parameters() - expert
    # 8 GPUs, EP4: DP 8, expert-DP 2; expert parameters are split 4 ways before any sharding.
    e = estimate_memory(m, Layout(ep=4), world=8, seq=2048, mbs=1, fsdp="optim_grads")
    assert e.grads == pytest.approx(4 * (dense / 8 + expert / 4 / 2))
    assert e.optimizer == pytest.approx(12 * (dense / 8 + expert / 4 / 2))


# ---------------------------------------------------------------- launch plan


def test_plan_proposes_fsdp_where_it_saves_model_parallel_ranks() -> None:
    """3B on two 40 GiB GPUs, seq 4096: the distributed optimizer needs TP2 (TP1: 41.8 GiB > 36 = 90%); fully
    sharded, TP1 fits (35.8 GiB), so it comes first; optim_grads (37.0 GiB) does not fit."""
    proposals = plan(PRESETS["llama-3b"], gpus=2, gpus_per_node=8, seq=4096, mbs=1, gpu_memory_gb=40)
    first = proposals[0]
    assert (str(first.layout), first.fsdp) == ("TP1xPP1", "optim_grads_params")
    assert first.memory.total / GiB == pytest.approx(35.8, abs=0.05)
    assert estimate_memory(PRESETS["llama-3b"], Layout(), 2, 4096, 1, fsdp="optim_grads").total > 36 * GiB
    assert [(str(p.layout), p.fsdp) for p in proposals[1:]] == [("TP2xPP1", None), ("TP1xPP2", None)]
    # Where the distributed optimizer fits, no FSDP variant is proposed at the same model parallelism.
    roomy = plan(PRESETS["llama-3b"], gpus=2, gpus_per_node=8, seq=4096, mbs=1, gpu_memory_gb=80)
    assert all(p.fsdp is None for p in roomy)


def test_plan_recompute_full_fits_more() -> None:
    # 0.89B on one 24 GiB GPU, seq 8192: 26.4 GiB with every activation kept; full recompute keeps the layer
    # inputs (0.5 GiB), so the fp32 logits (1 GiB) are the largest activation: 18.9 GiB <= 21.6 (90%).
    tight = dict(gpus=1, gpus_per_node=1, seq=8192, mbs=1, gpu_memory_gb=24)
    assert plan(PRESETS["llama-0.9b"], **tight) == []
    assert [str(p.layout) for p in plan(PRESETS["llama-0.9b"], **tight, recompute="full")] == ["TP1xPP1"]


def run_plan(*argv: str) -> tuple[int, str, str]:
    from mcorekit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(["launch", "plan", *argv])
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_plan_states_its_memory_assumption_and_the_cut() -> None:
    code, out, _ = run_plan("--model", "llama-3b", "--gpus", "8")
    lines = out.splitlines()
    assert code == 0
    assert lines[0] == "llama, 2.62B parameters, 8 GPUs (8 per node), seq 4096, mbs 1, recompute none"
    assert lines[1] == ("memory per GPU: 80 GiB (default; set --gpu-memory-gb or --cluster); a layout fits when its "
                        "estimate is at most 90% of it")
    assert len(lines) == 2 + 5 + 1 and lines[-1] == "  ... 5 more of 10 that fit (--top 0 lists all)"
    code, out, _ = run_plan("--model", "llama-3b", "--gpus", "8", "--top", "0")
    assert len(out.splitlines()) == 2 + 10 and "more of" not in out
    code, out, _ = run_plan("--model", "llama-3b", "--gpus", "2", "--cluster", "example-h100", "--gpu-memory-gb", "40")
    assert "memory per GPU: 40 GiB (--gpu-memory-gb)" in out
    assert out.splitlines()[2].split()[:3] == ["TP1xPP1", "DP2", "fsdp=optim_grads_params"]
    code, out, _ = run_plan("--model", "llama-3b", "--gpus", "2", "--cluster", "example-h100")
    assert "memory per GPU: 80 GiB (profile 'example-h100')" in out and "dist-opt" in out


def test_plan_when_nothing_fits_suggests_what_it_can_assume() -> None:
    code, out, _ = run_plan("--model", "llama-0.9b", "--gpus", "1", "--gpu-memory-gb", "10")
    assert code == 1 and out.splitlines()[-1] == "no valid layout fits; add GPUs, lower --seq/--mbs, or assume --recompute full"
    code, out, _ = run_plan("--model", "llama-0.9b", "--gpus", "1", "--gpu-memory-gb", "10", "--recompute", "full")
    assert code == 1 and out.splitlines()[-1] == "no valid layout fits; add GPUs, lower --seq/--mbs"


def test_plan_suggests_presets_for_a_near_miss_name() -> None:
    code, out, err = run_plan("--model", "llama-3", "--gpus", "8")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "mcorekit: error: --model llama-3 is neither a preset nor an HF model directory or config.json; did you "
        "mean 'llama-3b' or 'llama-tiny'? (presets: llama-tiny, llama-0.9b, llama-3b, mixtral-tiny, moe-8x-1.4b)"]


# ---------------------------------------------------------------- checkpoints (train/checkpoint.py)


def test_checkpoint_load_under_fsdp_takes_weights(tmp_path: Any) -> None:
    """Weights of any checkpoint load (finetune, or a converted release, which has nothing else); continuing another
    run's optimizer state does not, and the refusal says to set finetune."""
    assert problems(exp("parallel.fsdp=optim_grads_params", "checkpoint.load=/ckpt/run",
                        "checkpoint.finetune=true"), 2, NODE) == []
    assert problems(exp("parallel.fsdp=optim", "checkpoint.load=/ckpt/hf/release"), 2, NODE) == []
    (tmp_path / "conv").mkdir()
    (tmp_path / "conv" / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert problems(exp("parallel.fsdp=optim", f"checkpoint.load={tmp_path / 'conv'}"), 2, NODE) == []
    got = problems(exp("parallel.fsdp=optim", "checkpoint.load=/ckpt/run"), 2, NODE)
    assert len(got) == 1 and "set checkpoint.finetune=true (weights only, fresh optimizer, step 0)" in got[0]
    (tmp_path / "conv" / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe\n")  # was a traceback
    got = problems(exp("parallel.fsdp=optim", f"checkpoint.load={tmp_path / 'conv'}"), 2, NODE)
    assert len(got) == 1 and "set checkpoint.finetune=true" in got[0]


def test_launcher_gives_fsdp_jobs_several_cuda_queues() -> None:
    from mcorekit.config.cluster import load_profile
    from mcorekit.launch.api import prepare
    from mcorekit.launch.submit import render

    profile = load_profile("example-h100", ["python=/opt/venv/bin/python"])
    fsdp_job = prepare(exp("parallel.fsdp=optim_grads_params", "schedule.global_batch_size=64"), profile,
                       run_dir=Path("/runs/x"))
    text = render(profile, fsdp_job.spec)
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=8" in text and "CUDA_DEVICE_MAX_CONNECTIONS=1" not in text
    plain = prepare(exp("schedule.global_batch_size=64"), profile, run_dir=Path("/runs/y"))
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in render(profile, plain.spec)


def _iteration(root: Path, step: int, marker: str | None) -> Path:
    from mcorekit.train import checkpoint

    path = checkpoint.iter_dir(root, step)
    path.mkdir(parents=True)
    if marker:
        (path / marker).write_text("{}")
    (root / checkpoint.TRACKER).write_text(str(step))
    return path


def test_latest_finds_fsdp_checkpoints(tmp_path: Any) -> None:
    """A run that saved under FSDP resumes from that folder (not from step 0): the marker counts as complete."""
    from mcorekit.train import checkpoint

    fsdp = _iteration(tmp_path / "a", 20, checkpoint.FSDP_JSON)
    assert checkpoint.latest(tmp_path / "a") == fsdp and checkpoint.format_of(fsdp) == checkpoint.FSDP_DTENSOR
    dist_ckpt = _iteration(tmp_path / "b", 20, "metadata.json")
    assert checkpoint.latest(tmp_path / "b") == dist_ckpt and checkpoint.format_of(dist_ckpt) == checkpoint.TORCH_DIST
    half = _iteration(tmp_path / "c", 20, None)  # DCP files without the marker: the save did not finish
    (half / ".metadata").write_text("")
    assert checkpoint.latest(tmp_path / "c") is None and checkpoint.format_of(half) is None


GOOD_MARKER = {"format": "fsdp_dtensor", "iteration": 20, "scheduler": {}, "optimizer": {},
               "layout": {"tp": 1, "etp": 1, "ep": 1, "pp": 1}, "num_moe_experts": None}


@pytest.mark.parametrize("text,needle", [
    ('{"format": "fsdp_dt', "not valid JSON (JSONDecodeError)"),
    ('{"iteration": ' + "1" * 5000 + "}", "not valid JSON (ValueError)"),  # an integer too long: was a traceback
    ("[1]", "does not describe an fsdp_dtensor checkpoint"),
    ('{"format": "fsdp_dtensor"}', "scheduler, optimizer, iteration, layout missing or of the wrong type"),
    (json.dumps({**GOOD_MARKER, "iteration": "20"}), ": iteration missing or of the wrong type"),
    (json.dumps({**GOOD_MARKER, "layout": {"tp": "1", "etp": 1, "ep": 1, "pp": 1}}), ": layout missing"),
    (json.dumps({**GOOD_MARKER, "iteration": 30}), "records iteration 30, its folder is iter_0000020"),
])
def test_a_damaged_fsdp_marker_is_one_line(tmp_path: Any, text: str, needle: str) -> None:
    """The marker's step, layout and optimizer state are read at a resume: a damaged one was a KeyError or a
    JSONDecodeError traceback, or an iteration other than its folder's taken as the step."""
    from mcorekit.train import checkpoint

    path = _iteration(tmp_path / "a", 20, checkpoint.FSDP_JSON)
    (path / checkpoint.FSDP_JSON).write_text(json.dumps(GOOD_MARKER))
    assert checkpoint.fsdp_info(path)["iteration"] == 20
    (path / checkpoint.FSDP_JSON).write_text(text)
    with pytest.raises(ConfigError, match="resume from another iteration") as e:
        checkpoint.fsdp_info(path)
    assert needle in str(e.value) and str(e.value).startswith(str(path / checkpoint.FSDP_JSON)), e.value


def test_which_weights_an_fsdp_run_loads_before_wrapping(tmp_path: Any) -> None:
    from mcorekit.train import checkpoint

    conv = tmp_path / "conv"
    (conv / "release").mkdir(parents=True)
    (conv / "release" / "metadata.json").write_text("{}")
    (conv / checkpoint.TRACKER).write_text("release")
    e = exp("parallel.fsdp=optim", f"checkpoint.load={conv}")
    assert checkpoint.weights_before_wrap(e, tmp_path / "own") == conv / "release"  # no checkpoint of its own yet
    assert checkpoint.weights_before_wrap(exp("parallel.fsdp=optim"), tmp_path / "own") is None  # random init
    own = _iteration(tmp_path / "own", 10, "metadata.json")  # saved without FSDP: weights now, scheduler+step later
    assert checkpoint.weights_before_wrap(e, tmp_path / "own") == own
    _iteration(tmp_path / "own", 12, checkpoint.FSDP_JSON)  # saved under FSDP: loads whole after wrapping
    assert checkpoint.weights_before_wrap(e, tmp_path / "own") is None


def test_optimizer_state_splits_into_tensors_and_json() -> None:
    """What DCP writes (tensors) and what the marker records (plain values, JSON) put back together unchanged,
    tuples and a chained optimizer's integer keys included; anything else is refused rather than lost."""
    import json

    import torch

    from mcorekit.train import checkpoint

    sd = {0: {"state": {"module.w": {"exp_avg": torch.ones(2), "step": 3}},
              "param_to_group_meta": {"module.w": {"betas": (0.9, 0.95), "lr": 1e-4, "wd_mult": None}}},
          1: {"state": {}, "param_to_group_meta": {}}}
    tensors, rest = checkpoint.split_tensors(sd)
    assert list(tensors[0]["state"]["module.w"]) == ["exp_avg"] and tensors[0]["param_to_group_meta"] == {"module.w": {}}
    back = checkpoint.from_json(json.loads(json.dumps(checkpoint.to_json(rest))))
    merged = checkpoint.merge(tensors, back)
    assert merged[0]["param_to_group_meta"]["module.w"]["betas"] == (0.9, 0.95)
    assert merged[0]["state"]["module.w"]["step"] == 3 and merged[0]["state"]["module.w"]["exp_avg"] is sd[0]["state"][
        "module.w"]["exp_avg"]
    assert set(merged) == {0, 1} and merged[1] == {"state": {}, "param_to_group_meta": {}}
    with pytest.raises(TypeError, match="cannot record a dtype"):
        checkpoint.to_json({"x": torch.float32})


def test_tp_slices_of_a_whole_tensor() -> None:
    import torch

    from mcorekit.train.checkpoint import local_slice

    full = torch.arange(24.0).reshape(4, 6)
    col = type("P", (), {"tensor_model_parallel": True, "partition_dim": 0})()
    row = type("P", (), {"tensor_model_parallel": True, "partition_dim": 1})()
    assert torch.equal(local_slice(full, col, 1, 2), full[2:])
    assert torch.equal(local_slice(full, row, 0, 2), full[:, :3])
    assert local_slice(full, type("P", (), {})(), 1, 2) is full  # replicated (norms)
    assert local_slice(full, col, 0, 1) is full


def test_expert_keys_are_global_in_fsdp_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """EP rank 1 of 2 with 8 experts holds local experts 0-3, saved (and read) as experts 4-7; the rest unchanged."""
    from megatron.core import parallel_state as ps

    from mcorekit.train.checkpoint import fsdp_model_keys

    monkeypatch.setattr(ps, "get_expert_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "get_expert_model_parallel_rank", lambda: 1)
    keys = ["decoder.layers.0.mlp.experts.linear_fc1.weight0", "decoder.layers.0.mlp.experts.linear_fc2.weight3",
            "decoder.layers.0.mlp.router.weight", "decoder.layers.0.self_attention.linear_qkv._extra_state"]
    assert fsdp_model_keys(keys, 8) == {
        "decoder.layers.0.mlp.experts.linear_fc1.weight0": "decoder.layers.0.mlp.experts.linear_fc1.weight4",
        "decoder.layers.0.mlp.experts.linear_fc2.weight3": "decoder.layers.0.mlp.experts.linear_fc2.weight7",
        "decoder.layers.0.mlp.router.weight": "decoder.layers.0.mlp.router.weight"}


def test_fsdp_checkpoint_weights_load_without_fsdp(tmp_path: Any) -> None:
    """tests/fsdp_cpu_driver.py: a checkpoint in the fsdp_dtensor layout is found by latest() and its weights load
    bit-exactly into a differently initialised model without FSDP (load_weights: weights only; load: also scheduler
    and step, with the optimizer refreshed from the weights)."""
    import json
    import os
    import subprocess
    import sys

    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, str(here / "fsdp_cpu_driver.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path, env={**os.environ, "FSDP_PORT": single_rank_env()["MASTER_PORT"]})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("FSDP "))[5:])
    assert got["format"] == "fsdp_dtensor" and got["latest"] == "iter_0000010" and got["keys"] == 15
    assert got["differs_before"] and got["equal_weights"] and got["resumed_equal"]
    assert got["step"] == 10 and got["reloaded"] == 1
    assert got["scheduler"] == {"max_lr": 0.001, "lr_warmup_steps": 16, "num_steps": 80, "lr_decay_style": "cosine"}
    assert "OPTIMIZER STARTS FRESH" in proc.stderr
