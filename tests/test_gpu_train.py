"""On the GPU machine: the training loop learns, FP8 and MoE run, save -> signal -> resume reproduces the
uninterrupted losses, and an HF-converted checkpoint starts at the HF model's loss."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent

BASE = {
    "name": "gpu-test",
    "model": {"preset": "llama-tiny", "overrides": {"hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
                                                    "kv_channels": 32, "ffn_hidden_size": 704, "vocab_size": 512}},
    "data": {"seq_length": 256, "seed": 7},
    "schedule": {"train_iters": 40, "warmup_iters": 4, "micro_batch_size": 4, "global_batch_size": 8},
    "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
    "checkpoint": {"save_interval": 1000, "keep_last": 2},
    "logging": {"log_interval": 1},
}


def run(tmp: Path, name: str, cfg: dict, *extra: str, stop_at: int = 0, expect: int = 0,
        env: dict | None = None) -> list[dict]:
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, str(HERE / "gpu_train_driver.py"), str(run_dir / "config.yaml"), str(run_dir),
                           str(stop_at), *extra], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-5000:]
    (run_dir / "stdout.txt").write_text(proc.stdout)
    (run_dir / "stderr.txt").write_text(proc.stderr)  # mcorekit.train's warnings (Python logging)
    print(proc.stdout[-1500:])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_bf16(tmp_path: Path) -> None:
    m = run(tmp_path, "bf16", BASE)
    assert len(m) == 40 and m[-1]["loss"] < m[0]["loss"] - 0.5
    assert all(x["tokens_per_s"] > 0 and 0 < x["mfu"] < 1 for x in m)


def test_validation_loss_is_logged_and_leaves_training_alone(tmp_path: Path) -> None:
    """schedule.eval_interval on mock data: val_loss at steps 5, 10 and the last, falling as the model learns;
    the training losses equal those of the same run without validation."""
    sched = {**BASE["schedule"], "train_iters": 12}
    m = run(tmp_path, "eval", {**BASE, "schedule": {**sched, "eval_interval": 5, "eval_iters": 2}})
    plain = run(tmp_path, "plain", {**BASE, "schedule": sched})
    val = [x for x in m if "val_loss" in x]
    print("validation:", [(x["step"], round(x["val_loss"], 4)) for x in val])
    assert [x["step"] for x in val] == [5, 10, 12]
    assert [x["loss"] for x in m if "loss" in x] == [x["loss"] for x in plain]
    assert val[-1]["val_loss"] < val[0]["val_loss"] and all(math.isfinite(x["val_ppl"]) for x in val)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_trains(tmp_path: Path, recipe: str) -> None:
    m = run(tmp_path, recipe, {**BASE, "precision": {"dtype": "bf16", "fp8": recipe}})
    assert m[-1]["loss"] < m[0]["loss"] - 0.5


MOE = {**BASE, "model": {"preset": "mixtral-tiny", "overrides": {"hidden_size": 256, "num_attention_heads": 8,
       "num_query_groups": 4, "kv_channels": 32, "num_experts": 8, "moe_ffn_hidden_size": 256, "vocab_size": 512}},
       "moe": {"grouped_gemm": True, "dispatcher": "alltoall"}}


def test_moe_grouped_gemm_trains_and_logs_expert_load(tmp_path: Path) -> None:
    m = run(tmp_path, "moe", MOE)
    assert m[-1]["loss"] < m[0]["loss"] - 0.5
    # every token goes to top-2 of 8 experts in each of the 4 layers: 8 sequences x 256 tokens x 2 per step
    for x in m:
        assert sorted(x["expert_tokens"]) == ["1", "2", "3", "4"]
        assert all(len(c) == 8 and sum(c) == 8 * 256 * 2 for c in x["expert_tokens"].values())
        assert x["expert_imbalance_max"] >= 1.0
    print("expert load, last step:", m[-1]["expert_imbalance"])


@pytest.mark.parametrize("shape", ["dense", "moe", "dense-fp8-delayed", "moe-fp8-delayed", "moe-fp8-tensorwise"])
def test_step_graph_gives_the_eager_losses(tmp_path: Path, shape: str) -> None:
    """schedule.cuda_graph=auto runs these one-GPU steps as one CUDA graph each (the start line says so) after two
    eager steps; every step's loss and gradient norm equal the eager run's (cuda_graph=false) to 1e-5 relative.
    FP8 too: TE's scaling state (delayed: amax history) is updated by captured kernels, and the MoE experts' FP8
    grouped GEMMs (models/fp8_grouped_mm.py) read their groups from the GPU."""
    cfg = {**(BASE if shape.startswith("dense") else MOE)}
    cfg["schedule"] = {**cfg["schedule"], "train_iters": 10}
    if "fp8" in shape:
        cfg["precision"] = {"dtype": "bf16", "fp8": shape.rsplit("-", 1)[1]}
    graph = run(tmp_path, "graph", cfg)
    eager = run(tmp_path, "eager", {**cfg, "schedule": {**cfg["schedule"], "cuda_graph": False}})
    assert "each step one CUDA graph" in (tmp_path / "graph" / "stdout.txt").read_text()
    assert "each step one CUDA graph" not in (tmp_path / "eager" / "stdout.txt").read_text()
    for key in ("loss", "grad_norm"):
        diffs = [abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(graph, eager)]
        print(f"{shape} |graph - eager| / eager, {key}:", " ".join(f"{d:.1e}" for d in diffs))
        assert len(diffs) == 10 and max(diffs) <= 1e-5
    print(f"{shape} tokens/s, last step: graph {graph[-1]['tokens_per_s']:.0f}, eager {eager[-1]['tokens_per_s']:.0f}")


def test_fused_weight_gradients_equal_the_plain_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gradient_accumulation_fusion, on by default for dense models (TE's layers accumulate each micro-batch's
    weight gradient into DDP's fp32 main_grad), gives every parameter the step-1 gradient of the plain path (a bf16
    .grad per micro-batch that DDP adds) to bf16 rounding: nothing counted twice (4x the squared norm) or dropped;
    the output layer keeps the plain path without APEX (models/megatron.build_gpt). Steps 3-10 run as one CUDA graph
    each: their gradient norms (before clipping, which would hide a doubled gradient from the losses) and losses stay
    close. On one H200 (docs/gpu-runs.md): passed at `ab5ff08` (its first run) and at `c94fcf1`, 2026-12-04."""
    cfg = {**BASE, "schedule": {**BASE["schedule"], "train_iters": 10}}
    fused = run(tmp_path, "fused", cfg)
    monkeypatch.setenv("GPU_TEST_GAF", "off")
    plain = run(tmp_path, "plain", cfg)
    assert "gradient_accumulation_fusion=[True]" in (tmp_path / "fused" / "stdout.txt").read_text()
    assert "gradient_accumulation_fusion=[False]" in (tmp_path / "plain" / "stdout.txt").read_text()
    grads = [json.loads((tmp_path / name / "grads.rank0.json").read_text()) for name in ("fused", "plain")]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    rel = {k: abs(grads[0][k][0] - grads[1][k][0]) / max(grads[1][k][0], 1e-30) for k in grads[0]}
    worst = max(rel, key=rel.__getitem__)
    print(f"step-1 squared gradient norms, fused vs plain: worst {worst} {rel[worst]:.1e}")
    assert rel[worst] < 2e-2
    assert "each step one CUDA graph" in (tmp_path / "fused" / "stdout.txt").read_text()
    for key in ("loss", "grad_norm"):
        diffs = [abs(a[key] - b[key]) / b[key] for a, b in zip(fused, plain)]
        print(f"|{key} fused - plain| / plain per step:", " ".join(f"{d:.1e}" for d in diffs))
        # the dense tests' norms with and without the fusion agreed to 0.6% over 12 steps (docs/gpu-runs.md, 2026-12-04)
        assert len(diffs) == 10 and max(diffs) < 2e-2
    assert abs(fused[0]["loss"] - plain[0]["loss"]) < 1e-6 * plain[0]["loss"]  # step 1: the same forward


def test_moe_torch_expert_gemm_follows_te_grouped_gemm(tmp_path: Path) -> None:
    """moe.expert_gemm=torch computes the same experts as TE's GroupedLinear (same parameters, same data): the
    losses agree at step 1 to bf16 rounding and stay close while training."""
    cfg = {**MOE, "schedule": {**MOE["schedule"], "train_iters": 20}}
    te = run(tmp_path, "moe-te", {**cfg, "moe": {**MOE["moe"], "expert_gemm": "te"}})
    torch_mm = run(tmp_path, "moe-torch", {**cfg, "moe": {**MOE["moe"], "expert_gemm": "torch"}})
    # the start line names the class that computed the experts, read from the built model
    assert "MoE experts: TEGroupedMLP" in (tmp_path / "moe-te" / "stdout.txt").read_text()
    assert "MoE experts: GroupedMMExperts" in (tmp_path / "moe-torch" / "stdout.txt").read_text()
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(te, torch_mm)]
    print("|loss te - loss torch| per step:", " ".join(f"{d:.1e}" for d in diffs))
    assert len(diffs) == 20 and diffs[0] < 5e-3 and max(diffs) < 0.05


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_moe_fp8_torch_experts_follow_te_fp8_experts(tmp_path: Path, recipe: str) -> None:
    """Under precision.fp8 the experts run torch._scaled_grouped_mm with per-row scales (auto) or TE's FP8
    GroupedLinear with its recipe's per-tensor scales (te): other roundings of the same model, so the losses agree
    at step 1 to FP8's error, stay within 0.15 of each other and fall alike (on one H200, 2026-12-02: step-1
    differences 3e-4 and 5e-4, largest 0.11 and 0.08 over 20 steps)."""
    cfg = {**MOE, "schedule": {**MOE["schedule"], "train_iters": 20}, "precision": {"dtype": "bf16", "fp8": recipe}}
    te = run(tmp_path, "te", {**cfg, "moe": {**MOE["moe"], "expert_gemm": "te"}})
    ours = run(tmp_path, "torch", cfg)
    assert "MoE experts: GroupedMMExperts" in (tmp_path / "torch" / "stdout.txt").read_text()
    assert "each step one CUDA graph" in (tmp_path / "torch" / "stdout.txt").read_text()
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(te, ours)]
    print(f"fp8 {recipe} |loss te - loss torch| per step:", " ".join(f"{d:.1e}" for d in diffs))
    assert len(diffs) == 20 and diffs[0] < 0.02 and max(diffs) < 0.15
    assert ours[-1]["loss"] < ours[0]["loss"] - 0.1 and te[-1]["loss"] < te[0]["loss"] - 0.1
    assert abs((ours[0]["loss"] - ours[-1]["loss"]) - (te[0]["loss"] - te[-1]["loss"])) < 0.1


def test_fp8_grouped_gemm_kernel_and_capture() -> None:
    """torch._scaled_grouped_mm on the quantized operands equals their dequantized product in fp32 (to bf16
    rounding), for groups of any size (none, odd), forward and input gradient; and a forward + backward of the FP8
    grouped linear is captured in a CUDA graph (nothing reads the group sizes on the host) and replays the eager
    results bit for bit."""
    import torch

    from mcorekit.models import fp8_grouped_mm as fp8
    from mcorekit.models.grouped_mm_experts import grouped_linear

    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 77, 30, 16], device="cuda")
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(5, 384, 256, device="cuda") / 16).bfloat16()
    grad = torch.randn(x.shape[0], 384, device="cuda", dtype=torch.bfloat16)
    q = fp8.quantize_weights(w)

    def dequantized(a, b, a_scale, b_scale):
        return torch._grouped_mm(a.float() * a_scale[:, None], b.float() * b_scale[:, None, :], offs=ends)

    xq, xs = fp8.quantize_rows(x)
    gq, gs = fp8.quantize_rows(grad)
    for got, want in ((fp8.fp8_grouped_mm(x, ends, q), dequantized(xq, q.rows.transpose(1, 2), xs, q.row_scale)),
                      (fp8.fp8_grouped_mm_dgrad(grad, ends, q), dequantized(gq, q.cols.transpose(1, 2), gs, q.col_scale))):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)

    xs_ = x.clone().requires_grad_()
    ws = [t.detach().clone().requires_grad_() for t in w]

    def step():
        for t in [xs_, *ws]:
            t.grad = None
        grouped_linear(xs_, ends, ws, fp8=fp8.quantize_weights(torch.stack(ws).detach())).backward(grad)
        return [xs_.grad.clone(), *(t.grad.clone() for t in ws)]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))


def test_dense_mlp_runs_tes_swiglu_without_a_checkpoint_key(model_parallel: None) -> None:
    """The dense MLP from models/megatron.layer_spec runs TE's SwiGLU operation (models/megatron.te_swiglu_op) and
    its state dict holds the same keys as the MLP running Megatron-Core's bias-SwiGLU, so either loads the other's
    weights strictly; in fp32 their outputs and input gradients agree to rounding."""
    import torch
    import transformer_engine.pytorch as te
    from megatron.core.transformer.mlp import MLP

    from mcorekit.config.experiment import load_experiment
    from mcorekit.config.megatron import transformer_config
    from mcorekit.models.megatron import layer_spec
    from mcorekit.models.spec import resolve

    spec = resolve("llama-tiny", None, {})
    exp = load_experiment(str(HERE.parent / "examples/llama-tiny.yaml"), ["precision.dtype=fp32"])
    submodules = layer_spec(spec, use_te=True).submodules.mlp.keywords["submodules"]

    def mlp(te_act: bool) -> Any:
        config = transformer_config(exp, spec, use_te=True)
        assert config.use_te_activation_func and not config.bias_activation_fusion
        config.use_te_activation_func, config.bias_activation_fusion = te_act, not te_act
        config.gradient_accumulation_fusion = False  # no DDP wrapper here to give the weights a main_grad
        torch.manual_seed(0)
        return MLP(config, submodules).cuda()

    ours, plain = mlp(True), mlp(False)
    assert isinstance(ours.activation_func, te.ops.SwiGLU)
    assert list(ours.state_dict()) == list(plain.state_dict())
    assert not [k for k in ours.sharded_state_dict() if "activation_func" in k]
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(16, 2, spec.hidden_size, device="cuda", requires_grad=True)
    y = torch.randn(16, 2, spec.hidden_size, device="cuda")
    grads = []
    for model in (ours, plain):
        x.grad = None
        out = model(x)[0]
        (out * y).sum().backward()
        grads.append((out.detach(), x.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fp8_quantization_compiles_one_kernel_per_width() -> None:
    """quantize_rows and quantize_weights on a GPU are torch.compile's kernels of the torch ops they replace
    (quantize_rows_eager): the same scales to float rounding and the same e4m3 values but for rare neighbours; one
    compiled graph per activation width (weights' rows share it) and per weight shape (their columns), none for
    another number of token rows (expert parallelism, packing) or for a tensor that requires grad (activations)."""
    import torch
    from torch._dynamo.utils import counters

    from mcorekit.models import fp8_grouped_mm as fp8

    torch._dynamo.reset()  # graphs other tests of this process compiled count towards torch's limit of eight
    start = counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    w = torch.randn(3, 96, 272, device="cuda", dtype=torch.bfloat16)
    cases = [(fp8.quantize_rows(t), fp8.quantize_rows_eager(t)) for rows, width, grad in
             ((100, 272, False), (300, 272, True), (7, 336, False), (512, 336, False), (3, 272, False), (9, 400, True))
             for t in [(torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) * 3).requires_grad_(grad)]]
    before = counters["stats"]["unique_graphs"]
    q = fp8.quantize_weights(w)
    assert counters["stats"]["unique_graphs"] - before == 1  # the columns; the rows (width 272) were compiled
    cases += [((q.rows, q.row_scale), fp8.quantize_rows_eager(w)),
              ((q.cols, q.col_scale), fp8.quantize_rows_eager(w.transpose(1, 2)))]
    for (values, scale), (values_ref, scale_ref) in cases:
        assert values.dtype == torch.float8_e4m3fn and values.is_contiguous() and values.shape == values_ref.shape
        torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)  # a few float ulps
        differ = (values.view(torch.uint8) != values_ref.view(torch.uint8)).float().mean().item()
        assert differ < 1e-3, differ
    assert counters["stats"]["unique_graphs"] - start == 4  # widths 272, 336 and 400, the weight's columns


def test_moe_shared_expert_and_aux_loss_free_balancing(tmp_path: Path) -> None:
    cfg = {**MOE, "moe": {**MOE["moe"], "shared_expert_ffn": 256, "expert_bias": True, "router_fusion": True}}
    m = run(tmp_path, "moe-shared", cfg)
    assert m[-1]["loss"] < m[0]["loss"] - 0.5


@pytest.mark.parametrize("async_save", [False, True])
def test_signal_save_resume_reproduces_losses(tmp_path: Path, async_save: bool) -> None:
    cfg = {**BASE, "schedule": {**BASE["schedule"], "train_iters": 20},
           "checkpoint": {**BASE["checkpoint"], "async_save": async_save, "save_interval": 4}}
    full = run(tmp_path, "full", cfg)
    first = run(tmp_path, "interrupted", cfg, stop_at=10, expect=3)  # USR2 after step 10: save at 10, exit
    assert [x["step"] for x in first] == list(range(1, 11))
    ckpts = tmp_path / "interrupted" / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "10"
    if async_save:  # step 8's checkpoint was written in the background (a writer thread): resuming from it too
        import shutil

        from mcorekit.train.checkpoint import iter_dir

        # staged on the GPU, as step 4's: a process stages there once its step graph is captured (after 3 steps)
        assert staged(tmp_path / "interrupted") == [(4, "gpu"), (8, "gpu")]

        shutil.copytree(iter_dir(ckpts, 8), iter_dir(tmp_path / "from8" / "checkpoints", 8))
        (tmp_path / "from8" / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("8")
        from8 = run(tmp_path, "from8", cfg)
        assert [x["step"] for x in from8] == list(range(9, 21))
        for a, b in zip(from8, full[8:]):
            assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"]), (a, b)
    resumed = run(tmp_path, "interrupted", cfg)  # same run folder: finds its checkpoint by itself
    if async_save:  # resumed at 10: the save at 12, the process's second step, in pinned host memory
        assert staged(tmp_path / "interrupted") == [(12, "host"), (16, "gpu")]
    after = [x for x in resumed if x["step"] > 10]
    assert [x["step"] for x in after] == list(range(11, 21))
    print("resume losses:", [round(x["loss"], 5) for x in after], "uninterrupted:", [round(x["loss"], 5) for x in full[10:]])
    for a, b in zip(after, full[10:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"]), (a, b)


def test_fp8_signal_save_resume_reproduces_losses(tmp_path: Path) -> None:
    """An FP8 (delayed scaling) run stopped after step 10 resumes from its own checkpoint, TE's extra states (scales
    and amax histories, which TE 2.18 on unpickles only when allowed: checkpoint_reader.checked_extra_states) with
    it, and follows the run that was not interrupted."""
    cfg = {**BASE, "precision": {"dtype": "bf16", "fp8": "delayed"}, "schedule": {**BASE["schedule"], "train_iters": 20},
           "checkpoint": {**BASE["checkpoint"], "save_interval": 4}}
    full = run(tmp_path, "full", cfg)
    first = run(tmp_path, "interrupted", cfg, stop_at=10, expect=3)
    assert [x["step"] for x in first] == list(range(1, 11))
    resumed = run(tmp_path, "interrupted", cfg)
    after = [x for x in resumed if x["step"] > 10]
    assert [x["step"] for x in after] == list(range(11, 21))
    print("fp8 resume losses:", [round(x["loss"], 5) for x in after],
          "uninterrupted:", [round(x["loss"], 5) for x in full[10:]])
    for a, b in zip(after, full[10:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"]), (a, b)


def staged(run_dir: Path) -> list[tuple[int, str]]:
    """(step, where it was staged) of each background save the run's last process scheduled."""
    lines = (run_dir / "stdout.txt").read_text().splitlines()
    events = [json.loads(x.split(" ", 2)[2]) for x in lines if x.startswith("mcorekit.train: checkpoint ")]
    return [(e["step"], e["staged_on"]) for e in events if e["event"] == "scheduled"]


def convert_random(tmp: Path, hf_cfg: Any) -> Any:
    """A random fp32 model of HF_CFG saved to TMP/hf and converted by convert/ to TMP/mcore; returns it."""
    import torch
    import transformers

    from mcorekit.convert import pipeline

    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    hf_model.save_pretrained(tmp / "hf")
    pipeline.hf_to_mcore(tmp / "hf", tmp / "mcore", quiet=True)
    return hf_model


def converted_llama(tmp: Path, **extra: float) -> Any:
    """BASE's Llama shape (4 layers, hidden 256, 8 heads / 4 KV groups, vocab 512), random, converted."""
    import transformers

    return convert_random(tmp, transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=512, **extra))


def test_hf_converted_checkpoint_starts_at_hf_loss(tmp_path: Path) -> None:
    hf_model = converted_llama(tmp_path)
    cfg = {**BASE, "model": {"hf_config": str(tmp_path / "hf")}, "precision": {"dtype": "fp32"},
           "schedule": {**BASE["schedule"], "train_iters": 1, "warmup_iters": 0}, "checkpoint": {"load": str(tmp_path / "mcore"), "finetune": True}}
    m = run(tmp_path, "ft", cfg)
    hf_loss = hf_step_losses(hf_model.cuda(), 1)[0]  # the step's two micro-batches
    print(f"megatron first-step loss {m[0]['loss']:.6f}, HF loss on the same batch {hf_loss:.6f}")
    assert abs(m[0]["loss"] - hf_loss) < 1e-3 * hf_loss


def hf_step_losses(hf_model, steps: int, micro: int = 2) -> list[float]:
    """transformers' loss on the micro-batches each training step of BASE sees (fp32)."""
    import torch

    from mcorekit.train.data import batches
    from mcorekit.train.data.mock import MockDataset

    it = batches(MockDataset(7, 512, 256), 4, 0, 0, 1)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            mbs = [next(it) for _ in range(micro)]
            out.append(sum(hf_model(b["tokens"]).logits.float().log_softmax(-1).gather(-1, b["labels"].unsqueeze(-1))
                           .neg().mean().item() for b in mbs) / micro)
    return out


def test_finetune_trains_from_the_loaded_weights(tmp_path: Path) -> None:
    """bf16 keeps fp32 main weights in the optimizer, built before the checkpoint is loaded: they must be
    refreshed from the loaded weights, or the first update writes the random init back into the model. With an
    almost-zero learning rate every step's loss must stay the converted model's (peaked logits, so a random
    init's ~ln(512) would be far off)."""
    hf_model = converted_llama(tmp_path, initializer_range=0.2)
    cfg = {**BASE, "model": {"hf_config": str(tmp_path / "hf")}, "optimizer": {"lr": 1e-9, "min_lr": 1e-10},
           "schedule": {**BASE["schedule"], "train_iters": 4, "warmup_iters": 0},
           "checkpoint": {"load": str(tmp_path / "mcore"), "finetune": True}}
    m = run(tmp_path, "ft-bf16", cfg)
    hf = hf_step_losses(hf_model.cuda(), 4)
    print("bf16 fine-tune losses", [round(x["loss"], 4) for x in m], "transformers", [round(x, 4) for x in hf])
    assert hf[0] > 7.0  # the converted model is far from uniform
    for got, want in zip((x["loss"] for x in m), hf):
        assert abs(got - want) < 0.02 * want



def test_fp8_checkpoint_starts_another_run(tmp_path: Path) -> None:
    """An FP8 run's checkpoint as another run's checkpoint.load: its TE extra states (FP8 scales and amax histories,
    pickled by TE) pass the record check at the start, the whole state continues (finetune: false) at the saved
    step with the loss where the first run left it, and the weights alone start a fine-tune at step 0."""
    from mcorekit.train.checkpoint import iter_dir
    from mcorekit.train.checkpoint_reader import checked_metadata, checked_records

    fp8 = {"precision": {"dtype": "bf16", "fp8": "delayed"}}
    first = run(tmp_path, "first", {**BASE, **fp8, "schedule": {**BASE["schedule"], "train_iters": 12}})
    saved = iter_dir(tmp_path / "first" / "checkpoints", 12)
    metadata = checked_metadata(saved)
    states = [k for k, v in metadata.state_dict_metadata.items() if "_extra_state" in k and "Bytes" in type(v).__name__]
    assert states, "an FP8 run saves TE's extra states as bytes records"
    checked_records(saved, metadata)  # what the start of the next runs does, here in this process
    load = {"load": str(tmp_path / "first" / "checkpoints")}
    cont = run(tmp_path, "continued", {**BASE, **fp8, "schedule": {**BASE["schedule"], "train_iters": 16},
                                       "checkpoint": {**BASE["checkpoint"], **load, "finetune": False}})
    assert [x["step"] for x in cont] == [13, 14, 15, 16]
    said = "".join((tmp_path / "continued" / f).read_text() for f in ("stdout.txt", "stderr.txt"))
    assert f"continuing from {saved} at step 12" in said  # a warning: logging's, on stderr
    tuned = run(tmp_path, "tuned", {**BASE, **fp8, "schedule": {**BASE["schedule"], "train_iters": 4, "warmup_iters": 1},
                                    "checkpoint": {**BASE["checkpoint"], **load, "finetune": True}})
    print("fp8 first run's last losses", [round(x["loss"], 4) for x in first[-3:]], "continued",
          [round(x["loss"], 4) for x in cont], "fine-tune", [round(x["loss"], 4) for x in tuned])
    assert [x["step"] for x in tuned] == [1, 2, 3, 4]
    for later in (cont[0]["loss"], tuned[0]["loss"]):  # a random init would start near ln(512) = 6.24
        assert abs(later - first[-1]["loss"]) < 0.15 * first[-1]["loss"], (later, first[-1]["loss"])

def test_fp16_with_dynamic_loss_scaling(tmp_path: Path) -> None:
    m = run(tmp_path, "fp16", {**BASE, "precision": {"dtype": "fp16"}})
    assert m[-1]["loss"] < m[0]["loss"] - 0.5
    scales = [x["loss_scale"] for x in m]
    assert all(s > 0 and math.log2(s) == int(math.log2(s)) for s in scales)  # powers of two, from 2^16 down
    print("fp16 loss scales:", sorted(set(scales)), "skipped steps:", m[-1]["skipped_steps"])


def test_local_backend_with_sdpa_trains(tmp_path: Path) -> None:
    m = run(tmp_path, "local", {**BASE, "model": {**BASE["model"], "backend": "local"}})
    assert m[-1]["loss"] < m[0]["loss"] - 0.5


def test_full_recompute_same_losses_less_memory(tmp_path: Path) -> None:
    cfg = {**BASE, "schedule": {**BASE["schedule"], "train_iters": 8}}
    plain = run(tmp_path, "plain", cfg)
    full = run(tmp_path, "full", {**cfg, "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}})
    sel = run(tmp_path, "selective", {**cfg, "recompute": {"granularity": "selective", "modules": ["core_attn", "mlp"]}})
    print("peak memory GB: plain", plain[-1]["mem_gb"], "selective", sel[-1]["mem_gb"], "full", full[-1]["mem_gb"])
    for other in (full, sel):
        for a, b in zip(plain, other):
            assert abs(a["loss"] - b["loss"]) < 2e-3 * a["loss"], (a, b)
    assert full[-1]["mem_gb"] < plain[-1]["mem_gb"] and sel[-1]["mem_gb"] < plain[-1]["mem_gb"]


def test_tensorboard_has_the_logged_metrics(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = {**BASE, "schedule": {**BASE["schedule"], "train_iters": 6}, "logging": {"log_interval": 2, "tensorboard": True}}
    m = run(tmp_path, "tb", cfg)
    acc = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in losses] == [2, 4, 6]
    assert [round(v, 4) for _, v in losses] == [round(x["loss"], 4) for x in m]
    assert {"grad_norm", "lr", "tokens_per_s", "mfu", "mem_gb"} <= set(acc.Tags()["scalars"])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_models import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_indexed_blend_trains(tmp_path: Path, tokenizer: Path) -> None:
    from test_train_data import write_corpus

    from mcorekit.train.data.preprocess import preprocess

    prefixes = []
    for name, seed in (("a", 1), ("b", 2)):
        write_corpus(tmp_path / f"{name}.jsonl", 2000, seed=seed)
        preprocess([str(tmp_path / f"{name}.jsonl")], str(tokenizer), str(tmp_path / name), quiet=True)
        prefixes.append(str(tmp_path / name))
    cfg = {**BASE, "data": {"kind": "indexed", "paths": prefixes, "weights": [0.7, 0.3], "seq_length": 256, "seed": 3}}
    m = run(tmp_path, "indexed", cfg)
    assert m[-1]["loss"] < m[0]["loss"] - 0.5  # from ln(512) toward the corpus' word entropy


def sft_config(tmp_path: Path, tokenizer: Path, packing: bool) -> dict:
    from test_train_data import sft_file

    path = sft_file(tmp_path / "sft.jsonl", 400, seed=5)
    return {**BASE, "data": {"kind": "sft", "paths": [str(path)], "tokenizer": str(tokenizer), "seq_length": 256,
                             "packing": packing, "seed": 3},
            "schedule": {**BASE["schedule"], "micro_batch_size": 1 if packing else 4, "global_batch_size": 8}}


@pytest.mark.parametrize("packing", [False, True])
def test_sft_trains(tmp_path: Path, tokenizer: Path, packing: bool) -> None:
    m = run(tmp_path, "sft", sft_config(tmp_path, tokenizer, packing))
    assert m[-1]["loss"] < m[0]["loss"] - 0.5


def test_packed_attention_stays_within_examples(tmp_path: Path, tokenizer: Path) -> None:
    cfg = sft_config(tmp_path, tokenizer, packing=True)
    (tmp_path / "pack.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, str(HERE / "gpu_packing_driver.py"), str(tmp_path / "pack.yaml"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads([x for x in proc.stdout.splitlines() if x.startswith("PACKING ")][-1][8:])
    print("per-token loss differences vs each example alone:", result)
    assert result["segments"] >= 2
    assert result["leaky"] > 0.1  # the control: attention across examples changes the losses visibly
    assert result["packed"] < 0.05 and result["packed"] < result["leaky"] / 10
