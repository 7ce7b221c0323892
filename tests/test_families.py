"""The MoE families of issue 19 (DeepSeek-V3, GPT-OSS) on CPU: HF -> Megatron -> HF bitwise in torch_dist and in
the legacy format at TP2 PP2 EP2 (and TP2 EP2 ETP2), the torch_dist keys and shapes equal to those of the
Megatron-Core model built from the same config, and that model's logits (loaded from the converted checkpoint)
equal to transformers' in fp32. Tiny random models from the transformers classes (tests/hf_models.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_models import CONFIGS, add_mtp_layer, make_family_model
from mcorekit.convert import pipeline
from mcorekit.convert.torch_dist import TorchDistReader
from mcorekit.convert.verify import compare_hf
from mcorekit.errors import ConversionError

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {n: make_family_model(n, root / n) for n in ("deepseek_v3", "deepseek_v3_2dense", "deepseek_v2", "gpt_oss")}


def assert_bitwise(a: Path, b: Path) -> None:
    reports = compare_hf(a, b)
    assert reports and all(r.status == "equal" for r in reports), [r for r in reports if r.status != "equal"][:3]


def megatron_keys_and_logits(hf: Path, ckpt: Path, port: int) -> tuple[dict[str, list[int]], tuple[float, float, float]]:
    """Megatron-Core's model of `hf` (tests/family_megatron.py, one process): its tensor keys with global shapes,
    and (max |diff|, cosine, top-1 agreement) of its logits, loaded from `ckpt`, against transformers'."""
    # TORCHDYNAMO_DISABLE: Megatron-Core's jit_fuser (torch.compile) on GPT-OSS's quick_gelu would spend a minute
    # building inductor's CPU kernels for a 24-token forward; eager computes the same function
    env = {**os.environ, "PYTHONPATH": str(HERE), "LOGITS_PORT": str(port), "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "family_megatron.py"), "logits", str(hf), str(ckpt)],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith(("KEYS ", "LOGITS "))}
    assert set(lines) == {"KEYS", "LOGITS"}, proc.stderr[-3000:]
    max_diff, cosine, top1 = map(float, lines["LOGITS"].split())
    return json.loads(lines["KEYS"]), (max_diff, cosine, top1)


def assert_megatron_agrees(hf: Path, tmp_path: Path, port: int) -> None:
    """The converted checkpoint holds exactly the tensors (keys, global shapes) of Megatron-Core's model of the
    same config, and that model, loaded from it, gives transformers' logits in fp32. torch_dist keys have no
    layout (the global shapes are the same at every TP/PP/EP); the legacy tests cover the splits."""
    pipeline.hf_to_mcore(hf, tmp_path / "m", dtype="fp32", quiet=True)
    ckpt = {k: list(v.size) for k, v in TorchDistReader(tmp_path / "m/release").tensor_keys().items()}
    keys, (max_diff, cosine, top1) = megatron_keys_and_logits(hf, tmp_path / "m/release", port)
    assert keys == ckpt
    print(f"{hf.name}: max |diff| {max_diff:.2e}, cosine {cosine:.7f}, top-1 {top1:.3f}")
    assert max_diff < 1e-5 and cosine > 0.99999 and top1 == 1.0, (max_diff, cosine, top1)


# ---------------------------------------------------------------- DeepSeek-V3


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_2dense", "deepseek_v2"])
def test_deepseek_v3_round_trips_bitwise(family_models, tmp_path: Path, name: str) -> None:
    """torch_dist (one key per layer: dense and MoE layers differ) and the legacy format at TP2 PP2 EP2 and
    TP2 EP2 ETP2; the fp32 router and its e_score_correction_bias stay fp32 in a bf16 model."""
    hf = family_models[name]
    pipeline.hf_to_mcore(hf, tmp_path / "td", quiet=True)
    keys = TorchDistReader(tmp_path / "td/release").tensor_keys()
    k = 2 if name == "deepseek_v3_2dense" else 1  # first_k_dense_replace
    assert f"decoder.layers.{k - 1}.mlp.linear_fc1.weight" in keys and f"decoder.layers.{k}.mlp.linear_fc1.weight" not in keys
    if name != "deepseek_v2":  # V2's router has no bias
        assert keys[f"decoder.layers.{k}.mlp.router.expert_bias"].properties.dtype == torch.float32
    assert tuple(keys[f"decoder.layers.{k}.mlp.experts.experts.linear_fc1.weight"].size) == (8, 64, 64)
    pipeline.mcore_to_hf(tmp_path / "td", tmp_path / "td_back", quiet=True)
    assert_bitwise(hf, tmp_path / "td_back")
    for layout in (dict(tp=2, pp=2, ep=2), dict(tp=2, ep=2, etp=2)):
        out = tmp_path / "_".join(f"{a}{b}" for a, b in layout.items())
        pipeline.hf_to_mcore(hf, out / "m", fmt="torch", quiet=True, **layout)
        pipeline.mcore_to_hf(out / "m", out / "back", quiet=True)
        assert_bitwise(hf, out / "back")


def test_deepseek_v3_legacy_ranks_hold_megatron_splits(family_models, tmp_path: Path) -> None:
    from mcorekit.convert.hf_io import HFReader

    hf = family_models["deepseek_v3"]
    pipeline.hf_to_mcore(hf, tmp_path / "m", fmt="torch", tp=2, pp=2, ep=2, quiet=True)
    src = HFReader(hf)
    r1 = torch.load(tmp_path / "m/release/mp_rank_01_000_001/model_optim_rng.pt", weights_only=True)["model"]
    # PP stage 0 holds layers 0 (dense) and 1 (MoE); TP rank 1 the second half of the heads; down projections whole
    assert torch.equal(r1["decoder.layers.0.self_attention.linear_kv_down_proj.weight"],
                       src.get("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"))
    assert torch.equal(r1["decoder.layers.1.self_attention.linear_q_up_proj.weight"],
                       src.get("model.layers.1.self_attn.q_b_proj.weight").chunk(2)[1])
    assert "decoder.layers.0.mlp.linear_fc1.weight" in r1 and "decoder.layers.0.mlp.router.weight" not in r1
    # EP rank 1 holds experts 4-7 as local 0-3, whole (expert TP 1); the shared expert is split by TP
    assert torch.equal(r1["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"],
                       src.get("model.layers.1.mlp.experts.4.down_proj.weight"))
    assert torch.equal(r1["decoder.layers.1.mlp.shared_experts.linear_fc2.weight"],
                       src.get("model.layers.1.mlp.shared_experts.down_proj.weight").chunk(2, dim=1)[1])
    assert torch.equal(r1["decoder.layers.1.mlp.router.expert_bias"], src.get("model.layers.1.mlp.gate.e_score_correction_bias"))


def test_deepseek_v3_megatron_keys_and_logits_equal(family_models, tmp_path: Path) -> None:
    """MLA (q LoRA, YaRN, interleaved rope), a dense first layer, shared experts, sigmoid routing with group
    top-k, the expert bias and the routed scaling factor: Megatron-Core's model has the converter's keys and gives
    transformers' logits."""
    assert_megatron_agrees(family_models["deepseek_v3"], tmp_path, port=29651)


def test_deepseek_v3_mtp_megatron_keys_logits_and_loss(mtp_model, tmp_path: Path) -> None:
    """Megatron-Core's GPTModel with its MTP block (get_gpt_mtp_block_spec, mtp_num_layers=1) has exactly the
    converted checkpoint's keys and shapes, loads it, gives transformers' logits, and its MTP loss on a masked batch
    equals DeepSeek's formula computed with transformers' modules on the HF tensors (family_megatron.mtp_reference:
    norms, [enorm(embedding); hnorm(hidden)], eh_proj, the HF decoder layer, shared head) within 1e-5 in fp32."""
    pipeline.hf_to_mcore(mtp_model, tmp_path / "m", dtype="fp32", quiet=True)
    ckpt = {k: list(v.size) for k, v in TorchDistReader(tmp_path / "m/release").tensor_keys().items()}
    env = {**os.environ, "PYTHONPATH": str(HERE), "LOGITS_PORT": "29681", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "family_megatron.py"), "mtp", str(mtp_model), str(tmp_path / "m/release")],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith(("KEYS ", "LOGITS ", "MTP "))}
    assert set(lines) == {"KEYS", "LOGITS", "MTP"}, proc.stderr[-3000:]
    assert json.loads(lines["KEYS"]) == ckpt and any(k.startswith("mtp.layers.0.transformer_layer.") for k in ckpt)
    max_diff, cosine, top1 = map(float, lines["LOGITS"].split())
    assert max_diff < 1e-5 and cosine > 0.99999 and top1 == 1.0, (max_diff, cosine, top1)
    megatron, reference = map(float, lines["MTP"].split())
    print(f"MTP loss: Megatron-Core {megatron:.7f}, DeepSeek's formula {reference:.7f}")
    assert abs(megatron - reference) < 1e-5, (megatron, reference)


def test_deepseek_v2_megatron_keys_and_logits_equal(family_models, tmp_path: Path) -> None:
    """DeepSeek-V2: softmax routing with group-limited greedy top-k, unnormalised, scaled; V2's rope (complex
    products of interleaved pairs) gives the same q.k as Megatron-Core's MLA rope."""
    assert_megatron_agrees(family_models["deepseek_v2"], tmp_path, port=29661)


def test_deepseek_v3_refusals(family_models, tmp_path: Path) -> None:
    import shutil

    hf = shutil.copytree(family_models["deepseek_v3"], tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    for change, needle in ((dict(rope_interleave=False), "rope_interleave=false is not supported"),
                           (dict(norm_topk_prob=False), "norm_topk_prob=false is not supported"),
                           (dict(topk_group=1), "num_experts_per_tok=4 / topk_group=1 != 2"),
                           (dict(quantization_config={"quant_method": "fp8"}), "quantized weights (fp8) are not converted"),
                           (dict(q_lora_rank=None), "q_lora_rank=null (a plain q_proj, as in DeepSeek-V2-Lite) is not supported"),
                           (dict(model_type="deepseek_v2", topk_method="group_limited_greedy"),
                            "num_experts_per_tok=4 / topk_group=2: DeepSeek-V2 ranks a group by its best expert"),
                           # were written into mcorekit.json (NaN, which is not JSON) or read as 1.0
                           (dict(routed_scaling_factor=float("nan")), "moe_router_topk_scaling_factor=nan must be a "
                                                                      "positive number"),
                           (dict(routed_scaling_factor=[]), "moe_router_topk_scaling_factor=[] must be a positive"),
                           (dict(routed_scaling_factor=10**400), "moe_router_topk_scaling_factor=inf must be a "
                                                                 "positive number")):  # was a traceback
        (hf / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConversionError, match=re.escape(needle)):
            pipeline.hf_to_mcore(hf, tmp_path / "out", quiet=True)


@pytest.fixture(scope="module")
def mtp_model(family_models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3-tiny with the MTP layer DeepSeek's checkpoints carry (model.layers.4.*: transformers does not save
    it, so the test writes it: tests/hf_models.add_mtp_layer)."""
    import shutil

    hf = shutil.copytree(family_models["deepseek_v3"], tmp_path_factory.mktemp("mtp") / "hf")
    add_mtp_layer(hf)
    return hf


def test_deepseek_v3_mtp_layer_converts_both_ways_bitwise(mtp_model, tmp_path: Path) -> None:
    """DeepSeek's MTP layer (`model.layers.<num_hidden_layers>.*`: enorm, hnorm, eh_proj, a decoder layer,
    shared_head.norm, and copies of the embedding and the head) becomes Megatron-Core's MTP block
    (`mtp.layers.0.{enorm,hnorm,eh_proj,final_layernorm}`, `mtp.layers.0.transformer_layer.*`) and comes back bit
    for bit: torch_dist, and the legacy format at TP2 PP2 EP2, where the last pipeline stage holds it under its
    module names (`mtp_model_layer`), split like a decoder layer, with its own copy of the embedding."""
    from mcorekit.convert.hf_io import HFReader

    hf, src = mtp_model, HFReader(mtp_model)
    pipeline.hf_to_mcore(hf, tmp_path / "td", quiet=True)
    keys = TorchDistReader(tmp_path / "td/release").tensor_keys()
    mtp = {k: tuple(v.size) for k, v in keys.items() if k.startswith("mtp.")}
    assert mtp["mtp.layers.0.eh_proj.weight"] == (64, 128) and "mtp.layers.0.enorm.weight" in mtp
    assert mtp["mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"] == (8, 64, 64)
    assert keys["mtp.layers.0.transformer_layer.mlp.router.expert_bias"].properties.dtype == torch.float32
    assert not (tmp_path / "td/mtp").exists() and json.loads((tmp_path / "td/mcorekit.json").read_text())["mtp_layers"] == 1
    pipeline.mcore_to_hf(tmp_path / "td", tmp_path / "td_back", quiet=True)
    assert_bitwise(hf, tmp_path / "td_back")

    pipeline.hf_to_mcore(hf, tmp_path / "lg", fmt="torch", tp=2, pp=2, ep=2, quiet=True)
    pipeline.mcore_to_hf(tmp_path / "lg", tmp_path / "lg_back", quiet=True)
    assert_bitwise(hf, tmp_path / "lg_back")
    first = torch.load(tmp_path / "lg/release/mp_rank_01_000_001/model_optim_rng.pt", weights_only=True)["model"]
    last = torch.load(tmp_path / "lg/release/mp_rank_01_001_001/model_optim_rng.pt", weights_only=True)["model"]
    assert not any(k.startswith("mtp.") for k in first)
    layer = "mtp.layers.0.mtp_model_layer"
    # TP rank 1: the second half of eh_proj's rows and of the heads; EP rank 1: experts 4-7 as local 0-3, whole
    assert torch.equal(last["mtp.layers.0.eh_proj.weight"], src.get("model.layers.4.eh_proj.weight").chunk(2)[1])
    assert torch.equal(last["mtp.layers.0.final_layernorm.weight"], src.get("model.layers.4.shared_head.norm.weight"))
    assert torch.equal(last[f"{layer}.self_attention.linear_q_up_proj.weight"],
                       src.get("model.layers.4.self_attn.q_b_proj.weight").chunk(2)[1])
    assert torch.equal(last[f"{layer}.mlp.experts.local_experts.0.linear_fc2.weight"],
                       src.get("model.layers.4.mlp.experts.4.down_proj.weight"))
    assert torch.equal(last[f"{layer}.mlp.router.expert_bias"], src.get("model.layers.4.mlp.gate.e_score_correction_bias"))
    assert f"{layer}.self_attention.linear_proj._extra_state" in last and "mtp.layers.0.eh_proj._extra_state" in last
    assert torch.equal(last["embedding.word_embeddings.weight"], first["embedding.word_embeddings.weight"])

    # more layers than the decoder and its MTP layers: the config disagrees with the weights
    bad = tmp_path / "hf_bad"
    bad.mkdir()
    for f in hf.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(ConversionError, match="num_hidden_layers=4, but the weights hold layers 0, 1, 2, 3, 4"):
        pipeline.hf_to_mcore(bad, tmp_path / "out", quiet=True)
    # a checkpoint with an MTP layer written back under a config that declares none
    with pytest.raises(ConversionError, match=r"holds 1 multi-token-prediction layer\(s\) .* declares "
                                              r"num_nextn_predict_layers=0; pass an --hf-config that declares 1"):
        pipeline.mcore_to_hf(tmp_path / "td", tmp_path / "out", hf_config=str(bad), quiet=True)


def test_deepseek_v3_mtp_embedding_and_head_must_be_the_main_ones(family_models, tmp_path: Path) -> None:
    """Megatron-Core's MTP block shares the main model's embedding and output layer: an MTP layer with its own is
    refused (never dropped silently), before anything is written."""
    import shutil

    from mcorekit.convert.hf_io import HFReader

    hf = shutil.copytree(family_models["deepseek_v3"], tmp_path / "hf")
    embed = HFReader(hf).get("model.embed_tokens.weight")
    add_mtp_layer(hf, embed=embed + 1)
    with pytest.raises(ConversionError, match=r"model.layers.4.embed_tokens.weight differs from model.embed_tokens.weight: "
                                              r"Megatron-Core's MTP layers share the main model's embedding"):
        pipeline.hf_to_mcore(hf, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()


def test_deepseek_v3_exports_for_the_pytorch_backend_and_the_engine_target_says_why_not(family_models, tmp_path: Path) -> None:
    from mcorekit.errors import ExportError
    from mcorekit.export.pipeline import export

    hf = family_models["deepseek_v3"]
    pipeline.hf_to_mcore(hf, tmp_path / "m", quiet=True)
    export(tmp_path / "m", tmp_path / "trt", "pytorch", tp=2, ep=2, quiet=True)  # from the Megatron checkpoint
    assert_bitwise(hf, tmp_path / "trt")
    assert json.loads((tmp_path / "trt/config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    with pytest.raises(ExportError, match=r"no TensorRT-LLM architecture for deepseek_v3 \(TensorRT-LLM serves "
                                          r"DeepSeek-V3 .* PyTorch backend only.*use --target pytorch"):
        export(hf, tmp_path / "engine", "engine", tp=2, quiet=True)
    assert not (tmp_path / "engine").exists()
    with pytest.raises(ExportError, match="FP8 export of MoE models is not supported"):
        export(hf, tmp_path / "fp8", "pytorch", use_fp8=True, quiet=True)


def test_deepseek_v3_export_keeps_the_mtp_router_in_fp32(mtp_model, tmp_path: Path) -> None:
    """Export casts to --dtype except DeepSeek's fp32 routers and their expert bias, the MTP layer's included."""
    from mcorekit.convert.hf_io import HFReader
    from mcorekit.export.pipeline import export

    export(mtp_model, tmp_path / "trt", "pytorch", dtype="bf16", quiet=True)
    out = HFReader(tmp_path / "trt")
    for layer in (1, 4):  # a decoder MoE layer and the MTP layer (model.layers.<num_hidden_layers>)
        for name in (f"model.layers.{layer}.mlp.gate.weight", f"model.layers.{layer}.mlp.gate.e_score_correction_bias"):
            assert out.get(name).dtype == torch.float32, name
    assert out.get("model.layers.4.eh_proj.weight").dtype == torch.bfloat16


# ---------------------------------------------------------------- GPT-OSS


def test_gpt_oss_round_trips_bitwise(family_models, tmp_path: Path) -> None:
    """The experts' HF tensors hold every expert (gate/up interleaved, x @ W): de-interleaved and transposed into
    Megatron's per-expert [gate; up] and back, exactly; torch_dist and legacy TP2 PP2 EP2."""
    hf = family_models["gpt_oss"]
    pipeline.hf_to_mcore(hf, tmp_path / "td", quiet=True)
    keys = TorchDistReader(tmp_path / "td/release").tensor_keys()
    assert tuple(keys["decoder.layers.self_attention.core_attention.softmax_offset"].size) == (4, 4)
    assert tuple(keys["decoder.layers.mlp.experts.experts.linear_fc1.bias"].size) == (4, 4, 64)
    pipeline.mcore_to_hf(tmp_path / "td", tmp_path / "td_back", quiet=True)
    assert_bitwise(hf, tmp_path / "td_back")
    pipeline.hf_to_mcore(hf, tmp_path / "lg", fmt="torch", tp=2, pp=2, ep=2, quiet=True)
    pipeline.mcore_to_hf(tmp_path / "lg", tmp_path / "lg_back", quiet=True)
    assert_bitwise(hf, tmp_path / "lg_back")


def test_gpt_oss_expert_layout_and_refusals(family_models, tmp_path: Path) -> None:
    import shutil

    from mcorekit.convert.hf_io import HFReader

    hf = family_models["gpt_oss"]
    pipeline.hf_to_mcore(hf, tmp_path / "m", fmt="torch", tp=2, ep=2, quiet=True)
    r1 = torch.load(tmp_path / "m/release/mp_rank_01_001/model_optim_rng.pt", weights_only=True)["model"]
    gate_up = HFReader(hf).get("model.layers.2.mlp.experts.gate_up_proj")[3]  # [hidden, 2 * ffn], gate/up alternating
    fc1 = r1["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"]  # expert 3 = EP rank 1, local 1
    assert torch.equal(fc1, torch.cat([gate_up[:, 0::2].t(), gate_up[:, 1::2].t()]))
    assert torch.equal(r1["decoder.layers.2.self_attention.core_attention.softmax_offset"],
                       HFReader(hf).get("model.layers.2.self_attn.sinks").chunk(2)[1])  # TP rank 1: heads 2-3
    with pytest.raises(ConversionError, match="ETP=2: Megatron-Core supports biased experts"):
        pipeline.hf_to_mcore(hf, tmp_path / "etp", fmt="torch", tp=2, ep=2, etp=2, quiet=True)
    bad = shutil.copytree(hf, tmp_path / "hf")
    cfg = json.loads((bad / "config.json").read_text())
    for change, needle in ((dict(quantization_config={"quant_method": "mxfp4"}), "mxfp4 weights are not converted"),
                           (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5 is not supported"),
                           (dict(swiglu_limit=-1), "glu_clamp=-1.0 must be a positive number")):  # was converted
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConversionError, match=needle) as refused:
            pipeline.hf_to_mcore(bad, tmp_path / "out", quiet=True)
        assert "layer_types" not in str(refused.value)  # only what is wrong
    assert not (tmp_path / "out").exists()


def test_gpt_oss_megatron_keys_and_logits_equal(family_models, tmp_path: Path) -> None:
    """Attention sinks, sliding windows of 8 on every other layer (24-token prompts), YaRN without truncation,
    biases everywhere and the clamped SwiGLU (limit 0.1: the tiny model's activations are clamped). Without the
    window or with the default limit 7, transformers' own logits move by 0.18 and 0.13."""
    assert_megatron_agrees(family_models["gpt_oss"], tmp_path, port=29671)


def test_gpt_oss_engine_target_says_why_not(family_models, tmp_path: Path) -> None:
    from mcorekit.errors import ExportError
    from mcorekit.export.pipeline import export

    with pytest.raises(ExportError, match=r"no TensorRT-LLM architecture for gpt_oss \(TensorRT-LLM serves GPT-OSS"):
        export(family_models["gpt_oss"], tmp_path / "engine", "engine", tp=2, quiet=True)


def test_mtp_training_rules_and_checkpoint_check(mtp_model, family_models, tmp_path: Path) -> None:
    """model.overrides.mtp_layers: refused, one line each, for a family without MTP layers, for the DPO/GRPO tasks
    and for a bad value; a checkpoint's MTP weights checked against the run before Megatron-Core loads it (needed
    when the run builds the block, left unused with a note when it does not)."""
    from mcorekit.config.experiment import load_experiment
    from mcorekit.config.rules import Nodes, model_of, problems
    from mcorekit.errors import ConfigError, ModelError
    from mcorekit.train.build import mtp_weights_check

    def rules(hf: Path, *overrides: str) -> list[str]:
        exp = load_experiment(HERE.parent / "examples/llama-tiny.yaml",
                              ["model.preset=null", f"model.hf_config={hf}", *overrides])
        return [p for p in problems(exp, 1, Nodes(transformer_engine=False, gpus=False)) if "mtp" in p]

    assert rules(mtp_model, "model.overrides={mtp_layers: 1}") == []
    assert rules(family_models["gpt_oss"], "model.overrides={mtp_layers: 1}") == [
        "model.overrides.mtp_layers=1: multi-token prediction is built for DeepSeek-V3 models only (model.hf_config of "
        "model_type deepseek_v3), not for a gpt_oss model; set it to 0"]
    assert rules(family_models["deepseek_v2"], "model.overrides={mtp_layers: 1}")[0].startswith(
        "model.overrides.mtp_layers=1: multi-token prediction is built for DeepSeek-V3 models only")
    with pytest.raises(ModelError, match=r"model mtp_layers=-1 must be a whole number from 0"):
        model_of(load_experiment(HERE.parent / "examples/llama-tiny.yaml",
                                 ["model.preset=null", f"model.hf_config={mtp_model}", "model.overrides={mtp_layers: -1}"]))

    from dataclasses import replace

    from mcorekit.models.spec import from_hf_config, load_hf_config

    spec = from_hf_config(load_hf_config(str(mtp_model)))
    pipeline.hf_to_mcore(mtp_model, tmp_path / "with", quiet=True)
    pipeline.hf_to_mcore(family_models["deepseek_v3"], tmp_path / "without", quiet=True)
    assert "holds 1 multi-token-prediction layer(s) (mtp.layers.*) that this run does not build" in \
        mtp_weights_check(tmp_path / "with/release", spec)
    assert mtp_weights_check(tmp_path / "with/release", replace(spec, mtp_layers=1)) is None
    with pytest.raises(ConfigError, match=r"holds 0 multi-token-prediction layer\(s\) .* convert the DeepSeek-V3 "
                                          r"checkpoint with its MTP layer\(s\)"):
        mtp_weights_check(tmp_path / "without/release", replace(spec, mtp_layers=1))


def test_a_null_max_position_embeddings_reads_as_absent() -> None:
    """HF configs may hold max_position_embeddings: null; conversion read it as None and (since its spec checks)
    refused the config, where an absent one reads as 4096."""
    config = {**CONFIGS["llama"](False).to_dict(), "max_position_embeddings": None}
    assert pipeline.spec_for(config).max_position_embeddings == 4096
    plain = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 256}
    assert pipeline.spec_for(plain).rope_theta == 10000.0
    with pytest.raises(ConversionError, match=re.escape("unusable config (OverflowError: int too large to convert")):
        pipeline.spec_for({**plain, "rope_theta": 10**400})  # was a traceback
