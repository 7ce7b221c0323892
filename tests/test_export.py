"""export/: rank files of every layout reassemble to the original weights and give the HF logits; the pytorch
target loads in transformers with identical logits; FP8 scales are consistent; bad input fails early."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from hf_models import make_model
from mcorekit.convert import pipeline as convert
from mcorekit.convert.verify import compare_logits
from mcorekit.export import fp8
from mcorekit.export.build import BuildOptions, build_command
from mcorekit.export.pipeline import export
from trtllm_reference import rebuild, save_as_hf

IDS = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(7))


def logits(hf_dir: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {n: make_model(n, tied=(n == "qwen2"), out=root / n) for n in ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe",
                                                                      "qwen2_moe")}


ENGINE_CASES = [("llama", dict(tp=1)), ("llama", dict(tp=2)), ("llama", dict(tp=4)), ("llama", dict(pp=2)),
                ("qwen3", dict(tp=1)), ("qwen3", dict(tp=2)), ("qwen3", dict(tp=4)), ("qwen3", dict(pp=2)),
                ("qwen2", dict(tp=4, pp=2)), ("qwen3_moe", dict(tp=1)), ("qwen3_moe", dict(tp=2)),
                ("qwen3_moe", dict(tp=4)), ("qwen3_moe", dict(tp=2, ep=2)), ("qwen3_moe", dict(pp=2)),
                ("qwen3_moe", dict(tp=4, ep=2)), ("mixtral", dict(tp=2, ep=2)), ("mixtral", dict(tp=4)),
                ("qwen2_moe", dict(tp=1)), ("qwen2_moe", dict(tp=2, ep=2)), ("qwen2_moe", dict(tp=4, pp=2))]


@pytest.mark.parametrize("name,layout", ENGINE_CASES, ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in l.items())}" for n, l in ENGINE_CASES])
def test_engine_rank_files_rebuild_the_model(models, tmp_path: Path, name: str, layout: dict) -> None:
    hf = models[name]
    export(hf, tmp_path / "trt", "engine", dtype="bf16", quiet=True, **layout)
    cfg = json.loads((tmp_path / "trt/config.json").read_text())
    world = layout.get("tp", 1) * layout.get("pp", 1)
    assert cfg["mapping"]["world_size"] == world and len(list((tmp_path / "trt").glob("rank*.safetensors"))) == world
    hf_cfg = json.loads((hf / "config.json").read_text())
    rebuilt = rebuild(tmp_path / "trt", hf_cfg)
    from mcorekit.convert.hf_io import HFReader

    src = HFReader(hf)
    for n in src.names():  # every original weight comes back exactly (bf16 -> bf16 is a pure rearrangement)
        assert torch.equal(rebuilt[n], src.get(n).float()), n
    report = compare_logits(logits(hf), logits(save_as_hf(rebuilt, hf_cfg, tmp_path / "back")))
    assert report.top1_agreement == 1.0 and report.cosine >= 0.9999, report.line()
    if layout.get("tp", 1) == 4 and hf_cfg["num_key_value_heads"] == 2:  # KV duplication: rank 1 repeats rank 0's head
        from safetensors.torch import load_file

        r0, r1 = load_file(tmp_path / "trt/rank0.safetensors"), load_file(tmp_path / "trt/rank1.safetensors")
        q = hf_cfg["num_attention_heads"] // 4 * (hf_cfg.get("head_dim") or 16)
        k = "transformer.layers.0.attention.qkv.weight"
        assert torch.equal(r0[k][q:], r1[k][q:])


def test_engine_config_declares_the_layout(models, tmp_path: Path) -> None:
    export(models["qwen3_moe"], tmp_path / "trt", "engine", tp=4, ep=2, quiet=True)
    cfg = json.loads((tmp_path / "trt/config.json").read_text())
    assert cfg["architecture"] == "QWenForCausalLM" and cfg["qwen_type"] == "qwen3_moe"
    assert cfg["mapping"] == {"world_size": 4, "tp_size": 4, "pp_size": 1, "cp_size": 1, "moe_tp_size": 2, "moe_ep_size": 2}
    assert cfg["moe"]["num_experts"] == 4 and cfg["moe"]["top_k"] == 2 and cfg["moe"]["normalization_mode"] == 1
    from safetensors.torch import load_file

    r = load_file(tmp_path / "trt/rank3.safetensors")
    assert r["transformer.layers.0.mlp.router.weight"].dtype == torch.float32
    assert tuple(r["transformer.layers.0.mlp.fc.weight"].shape) == (2, 2 * 32 // 2, 64)  # 2 local experts, moe_tp 2


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_pytorch_target_loads_in_transformers_with_identical_logits(models, tmp_path: Path, name: str) -> None:
    export(models[name], tmp_path / "out", "pytorch", tp=2, quiet=True)
    assert torch.equal(logits(models[name]), logits(tmp_path / "out"))
    import yaml

    opts = yaml.safe_load((tmp_path / "out/llm_api_options.yaml").read_text())
    assert opts["tensor_parallel_size"] == 2 and (tmp_path / "out/tokenizer_config.json").is_file()


def test_export_from_a_megatron_checkpoint(models, tmp_path: Path) -> None:
    convert.hf_to_mcore(models["qwen3"], tmp_path / "mcore", quiet=True)
    export(tmp_path / "mcore", tmp_path / "out", "pytorch", quiet=True)
    assert torch.equal(logits(models["qwen3"]), logits(tmp_path / "out"))


def calib_file(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(3)
    lines = [json.dumps({"input_ids": torch.randint(0, 250, (32,), generator=g).tolist()}) for _ in range(8)]
    (tmp_path / "calib.jsonl").write_text("\n".join(lines))
    return tmp_path / "calib.jsonl"


def assert_within_e4m3(original: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    deq = fp8.dequantize(q, scale)
    w = original.float()
    # e4m3: 3 mantissa bits -> rounding error <= 2^-4 relative for normals, <= scale * 2^-10 in the subnormal range
    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) * 1.0001
    assert ((w - deq).abs() <= bound).all()


def test_fp8_pytorch_target(models, tmp_path: Path) -> None:

    hf = models["llama"]
    export(hf, tmp_path / "out", "pytorch", use_fp8=True, calib=str(calib_file(tmp_path)), quiet=True)
    quant = json.loads((tmp_path / "out/hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "FP8" and "lm_head" in quant["exclude_modules"]
    assert json.loads((tmp_path / "out/config.json").read_text())["quantization_config"]["quant_algo"] == "FP8"
    from mcorekit.convert.hf_io import HFReader

    src, out = HFReader(hf), HFReader(tmp_path / "out")
    quantized = [n for n in out.names() if n.endswith(".weight_scale")]
    assert len(quantized) == 4 * 7  # q k v o gate up down per layer
    for n in quantized:
        module = n[: -len(".weight_scale")]
        q, scale = out.get(f"{module}.weight"), out.get(n)
        assert q.dtype == torch.float8_e4m3fn and out.get(f"{module}.input_scale").item() > 0
        assert_within_e4m3(src.get(f"{module}.weight"), q, scale)
    l0 = "model.layers.0.self_attn"  # fused for TensorRT-LLM: q/k/v share their scales
    assert out.get(f"{l0}.q_proj.weight_scale") == out.get(f"{l0}.v_proj.weight_scale")
    assert out.get(f"{l0}.q_proj.input_scale") == out.get(f"{l0}.k_proj.input_scale")
    assert out.get("lm_head.weight").dtype == torch.bfloat16


def test_fp8_engine_target_scales(models, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    export(models["llama"], tmp_path / "trt", "engine", tp=2, use_fp8=True, calib=str(calib_file(tmp_path)), quiet=True)
    assert json.loads((tmp_path / "trt/config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    r0, r1 = load_file(tmp_path / "trt/rank0.safetensors"), load_file(tmp_path / "trt/rank1.safetensors")
    k = "transformer.layers.1.mlp.fc"
    assert r0[f"{k}.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(r0[f"{k}.weights_scaling_factor"], r1[f"{k}.weights_scaling_factor"])  # one global scale
    assert r0[f"{k}.activation_scaling_factor"].item() > 0
    rebuilt = rebuild(tmp_path / "trt", json.loads((models["llama"] / "config.json").read_text()))
    from mcorekit.convert.hf_io import HFReader

    src = HFReader(models["llama"])
    w = src.get("model.layers.1.mlp.gate_proj.weight")
    assert_within_e4m3(w, fp8.quantize(w, r0[f"{k}.weights_scaling_factor"]), r0[f"{k}.weights_scaling_factor"])
    assert (rebuilt["model.layers.1.mlp.gate_proj.weight"] - w.float()).abs().max() <= w.float().abs().max() * 2**-4


# ---------------------------------------------------------------- engine build and bad input


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mcorekit", "export", *args], capture_output=True, text=True)


def test_engine_build_without_tensorrt_llm_says_what_to_install(models, tmp_path: Path) -> None:
    export(models["llama"], tmp_path / "trt", "engine", tp=2, quiet=True)
    proc = run_cli("engine", str(tmp_path / "trt"), str(tmp_path / "engine"))
    assert proc.returncode == 2
    assert "tensorrt-llm<=1.2" in proc.stderr and "--target pytorch" in proc.stderr
    cmd = build_command(tmp_path / "trt", tmp_path / "engine", BuildOptions(max_batch_size=4))
    assert cmd == ["trtllm-build", "--checkpoint_dir", str(tmp_path / "trt"), "--output_dir", str(tmp_path / "engine"),
                   "--gemm_plugin", "auto", "--max_batch_size", "4", "--max_input_len", "2048", "--max_seq_len", "4096",
                   "--max_num_tokens", "8192", "--workers", "2"]


@pytest.mark.parametrize("args,needle", [
    (["--target", "engine", "--tp", "3"], "TP=3 does not divide num_attention_heads=4"),
    (["--target", "pytorch", "--fp8"], "pass --calib FILE"),
])
def test_bad_requests_fail_before_writing(models, tmp_path: Path, args: list[str], needle: str) -> None:
    proc = run_cli("trtllm", str(models["llama"]), str(tmp_path / "out"), *args, "--quiet")
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_fp8_moe_and_existing_output(models, tmp_path: Path) -> None:
    proc = run_cli("trtllm", str(models["mixtral"]), str(tmp_path / "out"), "--target", "pytorch", "--fp8", "--calib", "x", "--quiet")
    assert proc.returncode == 2 and "MoE" in proc.stderr
    (tmp_path / "exists").mkdir()
    proc = run_cli("trtllm", str(models["llama"]), str(tmp_path / "exists"), "--target", "pytorch", "--quiet")
    assert proc.returncode == 2 and "pass --force" in proc.stderr
