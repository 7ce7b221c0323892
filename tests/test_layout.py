"""Layout rules (Megatron-Core's), the memory estimate against hand-computed numbers, and `launch plan`."""

from __future__ import annotations

import pytest

from mcorekit.config.cluster import load_profile
from mcorekit.config.experiment import Experiment
from mcorekit.config.rules import layout_problems
from mcorekit.errors import LayoutError
from mcorekit.launch.plan import GiB, check, estimate_memory, plan
from mcorekit.models.parallel import Layout
from mcorekit.models.spec import PRESETS, ModelSpec

DENSE = ModelSpec("llama", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                  kv_channels=128, ffn_hidden_size=14336, vocab_size=128256)
MOE = PRESETS["moe-8x-1.4b"]


def exp(**sections) -> Experiment:
    base = {"name": "t", "model": {"preset": "llama-0.9b"}, "data": {"seq_length": 2048},
            "schedule": {"micro_batch_size": 1, "global_batch_size": 64}}
    for key, value in sections.items():
        base.setdefault(key, {}).update(value) if isinstance(value, dict) else base.update({key: value})
    return Experiment.model_validate(base)


H100 = load_profile("example-h100")


@pytest.mark.parametrize("lay,world,needle", [
    (Layout(tp=3), 24, "TP=3 does not divide num_attention_heads=32"),
    (Layout(tp=16), 16, "TP=16 does not divide num_query_groups=8"),
    (Layout(tp=2, pp=3), 12, "PP=3 does not divide num_layers=32"),
    (Layout(tp=2, pp=4), 4, "TP*PP*CP = 2*4*1 = 8 does not divide the world size 4"),
    (Layout(pp=4, vpp=3), 8, "PP*VPP=12 does not divide num_layers=32"),
    (Layout(vpp=2), 8, "needs PP >= 2"),
    (Layout(tp=1, sequence_parallel=True), 8, "sequence_parallel needs TP > 1"),
    (Layout(ep=2), 8, "EP=2 given for a dense model"),
    (Layout(tp=3), 24, "TP=3 does not divide ffn_hidden_size=14336"),
])
def test_dense_rules(lay: Layout, world: int, needle: str) -> None:
    problems = layout_problems(DENSE, lay, world)
    assert any(needle in p for p in problems), problems


def test_moe_rules() -> None:
    assert any("EP=3 does not divide num_experts=8" in p for p in layout_problems(MOE, Layout(ep=3), 6))
    assert any("PP*EP*ETP = 2*4*2 does not divide the world size 8" in p
               for p in layout_problems(MOE, Layout(pp=2, ep=4, etp=2), 8))
    assert layout_problems(MOE, Layout(tp=2, ep=4), 8) == []  # EP spans the DP x TP ranks, as in Megatron
    assert layout_problems(MOE, Layout(pp=2, ep=4), 8) == []


def test_valid_layouts_pass() -> None:
    assert layout_problems(DENSE, Layout(tp=8, pp=4, vpp=2, cp=2, sequence_parallel=True), 128) == []


def test_experiment_level_rules() -> None:
    with pytest.raises(LayoutError, match=r"global_batch_size=60 is not divisible by micro_batch_size\*DP = 1\*8"):
        check(exp(schedule={"global_batch_size": 60}), H100)
    with pytest.raises(LayoutError, match=r"seq_length=2050 must be divisible by 2\*CP = 4"):
        check(exp(parallel={"cp": 2}, data={"seq_length": 2050}), H100)
    with pytest.raises(LayoutError, match="data.dynamic_batching is not built yet"):
        check(exp(data={"packing": True, "dynamic_batching": True}), H100)
    with pytest.raises(LayoutError, match="needs Transformer Engine"):
        check(exp(precision={"fp8": "tensorwise"}), H100.model_copy(update={"transformer_engine": False}))
    with pytest.raises(LayoutError, match="tp_comm_overlap needs TP > 1"):
        check(exp(optimizer={"tp_comm_overlap": True}), H100)
    with pytest.raises(LayoutError, match="pre-timeout signal"):
        check(exp(resources={"time": "00:03:00"}), H100)
    # Several problems are reported together, one per line.
    with pytest.raises(LayoutError) as e:
        check(exp(parallel={"tp": 3, "pp": 5}), H100)
    assert str(e.value).startswith("invalid layout (5 problems):")  # world size, heads, KV groups, layers, FFN
    assert len(str(e.value).splitlines()) == 6
    model, warnings = check(exp(), H100)
    assert model.num_layers == 16 and warnings == []


def test_memory_estimate_by_hand() -> None:
    # 0.89B dense, TP1 PP1 DP8, seq 2048, mbs 1, distributed optimizer.
    m = PRESETS["llama-0.9b"]
    est = estimate_memory(m, Layout(), world=8, seq=2048, mbs=1)
    n = m.num_parameters()
    assert est.weights == 2 * n and est.grads == 4 * n
    assert est.optimizer == pytest.approx(12 * n / 8)
    assert est.activations == pytest.approx(34 * 2048 * 2048 * 16)  # 34*s*b*h per layer, 16 layers
    full = estimate_memory(m, Layout(), world=8, seq=2048, mbs=1, recompute="full")
    assert full.activations == pytest.approx(max(2 * 2048 * 2048 * 16, 2048 * 32768 * 4))  # logits dominate
    tp = estimate_memory(m, Layout(tp=2, sequence_parallel=True), world=8, seq=2048, mbs=1)
    assert tp.weights == pytest.approx(est.weights / 2) and tp.activations == pytest.approx(est.activations / 2)


def test_memory_warning_names_the_fix() -> None:
    _, warnings = check(exp(schedule={"micro_batch_size": 32, "global_batch_size": 256}), H100)
    assert len(warnings) == 1 and "recompute.granularity" in warnings[0]


def test_plan_proposes_valid_fitting_layouts() -> None:
    layouts = plan(DENSE, gpus=16, gpus_per_node=8, seq=8192, mbs=1, gpu_memory_gb=80)
    assert layouts, "an 8B model on 16 GPUs must have a layout"
    for lay, _, mem in layouts:
        assert layout_problems(DENSE, lay, 16) == [] and mem.total <= 80 * GiB * 0.9
    sizes = [lay.tp * lay.pp for lay, _, _ in layouts]
    assert sizes == sorted(sizes)  # least model parallelism first
    assert plan(DENSE, gpus=1, gpus_per_node=1, seq=8192, mbs=1, gpu_memory_gb=24) == []


def test_shared_expert_size_must_match_the_models_own() -> None:
    """A model whose HF family has a shared expert (Qwen2-MoE) keeps its size, so the checkpoint converts back."""
    from mcorekit.config.experiment import Experiment
    from mcorekit.config.rules import moe_problems
    from mcorekit.models.parallel import Layout
    from mcorekit.models.spec import resolve

    model = resolve("mixtral-tiny", None, {"moe_shared_expert_ffn_hidden_size": 128})
    exp = Experiment.model_validate({"name": "x", "model": {"preset": "mixtral-tiny"}, "moe": {"shared_expert_ffn": 64}})
    assert any("shared expert of 128" in p for p in moe_problems(exp, Layout(), True, model))
    same = Experiment.model_validate({"name": "x", "model": {"preset": "mixtral-tiny"}, "moe": {"shared_expert_ffn": 128}})
    assert not any("shared expert" in p for p in moe_problems(same, Layout(), True, model))
    # an HF family with no shared expert (Mixtral): refused when the model comes from an HF config, which says the
    # user means to convert back; a preset (a benchmark or from-scratch shape) may still add one
    mixtral = resolve("mixtral-tiny", None, {})
    hf = Experiment.model_validate({"name": "x", "model": {"hf_config": "/some/mixtral"}, "moe": {"shared_expert_ffn": 64}})
    assert any("mixtral HF format has no shared expert" in p for p in moe_problems(hf, Layout(), True, mixtral))
    preset = Experiment.model_validate({"name": "x", "model": {"preset": "mixtral-tiny"}, "moe": {"shared_expert_ffn": 64}})
    assert not any("shared expert" in p for p in moe_problems(preset, Layout(), True, mixtral))


def test_memory_estimate_knows_dpo_and_lora() -> None:
    """DPO doubles the sequences per sample and (live reference, no LoRA) holds a bf16 copy of the weights; LoRA
    keeps gradients and Adam state only for its adapters. By hand for the 0.89B preset at rank 16, one GPU."""
    m = PRESETS["llama-0.9b"]
    base = estimate_memory(m, Layout(), world=1, seq=2048, mbs=1)
    dpo = estimate_memory(m, Layout(), world=1, seq=2048, mbs=1, rows_per_sample=2, reference_copy=True)
    assert dpo.activations == 2 * base.activations
    assert dpo.weights == base.weights + 2 * m.num_parameters() and dpo.grads == base.grads
    lora = estimate_memory(m, Layout(), world=1, seq=2048, mbs=1, lora_rank=16)
    # per layer: qkv A 3 x 2048 in, B out 2048 + 2 x 1024; proj 2048 + 2048; fc1 A 2 x 2048, B 2 x 5632; fc2 5632 + 2048
    adapters = 16 * 16 * ((3 * 2048 + 2048 + 2 * 1024) + (2048 + 2048) + (2 * 2048 + 2 * 5632) + (5632 + 2048))
    assert adapters == 9_568_256
    assert lora.grads == adapters * 4 and lora.optimizer == adapters * 12
    assert lora.weights == base.weights + adapters * 2 and lora.activations == base.activations


def test_launch_check_applies_the_task_to_the_estimate() -> None:
    from mcorekit.launch.plan import task_memory

    exp = Experiment.model_validate({"name": "x", "data": {"kind": "dpo", "paths": ["p.jsonl"], "tokenizer": "t"},
                                     "peft": {"lora": {"rank": 8}}})
    assert task_memory(exp) == {"rows_per_sample": 2, "reference_copy": False, "lora_rank": 8}
    exp = Experiment.model_validate({"name": "x", "data": {"kind": "dpo", "paths": ["p.jsonl"], "tokenizer": "t"}})
    assert task_memory(exp) == {"rows_per_sample": 2, "reference_copy": True, "lora_rank": None}
    assert task_memory(Experiment(name="x")) == {"rows_per_sample": 1, "reference_copy": False, "lora_rank": None}


@pytest.mark.parametrize("bias", ["given", "the model's own"])
def test_padding_to_capacity_with_an_expert_bias_is_refused(bias: str) -> None:
    """Megatron-Core's bias update counts the padded routing map: every expert its capacity, so the bias would never
    move (aux-loss-free balancing silently off)."""
    from mcorekit.config.rules import moe_problems
    from mcorekit.models.spec import resolve

    model = resolve("mixtral-tiny", None, {"moe_router_expert_bias": bias != "given"})
    moe = {"capacity_factor": 1.0, "pad_to_capacity": True, "expert_bias": bias == "given"}
    e = Experiment.model_validate({"name": "x", "model": {"preset": "mixtral-tiny"}, "moe": moe})
    want = "moe.expert_bias" if bias == "given" else "the mixtral model's own expert bias"
    assert [p for p in moe_problems(e, Layout(), True, model) if "bias never moves" in p] == [
        f"moe.pad_to_capacity with {want}: Megatron-Core counts each expert's tokens for the bias update after the "
        f"padding, so every expert counts its capacity and the bias never moves (no load balancing); leave "
        f"moe.pad_to_capacity off (moe.capacity_factor drops tokens without it)"]
    unpadded = Experiment.model_validate({"name": "x", "model": {"preset": "mixtral-tiny"},
                                          "moe": {**moe, "pad_to_capacity": False}})
    assert not any("bias never moves" in p for p in moe_problems(unpadded, Layout(), True, model))
