"""export/ against what a runtime would take wrongly: FP8 weights whose per-rank shapes FP8 GEMMs cannot run, a plain
rope written as llama3 scaling, a stale quantization_config copied beside bf16 weights, and FP8 bytes that differ
between the targets (the engine rounded an fp32 source twice). CPU; tiny Llamas."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from hf_models import COMMON, CONFIGS, make_model
from mcorekit import cli
from mcorekit.convert.hf_io import HFReader
from mcorekit.errors import ExportError
from mcorekit.export import engine, fp8
from mcorekit.export.pipeline import export
from mcorekit.models.spec import ModelSpec


def run(*args: object) -> tuple[int, str]:
    """`mcorekit export ARGS --quiet` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["export", *map(str, args), "--quiet"])
    return rc, err.getvalue()


def llama(out: Path, dtype: torch.dtype = torch.bfloat16, **sizes: int) -> Path:
    """A 2-layer Llama of the hf_models sizes, `sizes` replaced, random norms."""
    torch.manual_seed(0)
    cfg = type(CONFIGS["llama"](False))(**{**COMMON, "num_hidden_layers": 2, **sizes})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def calib_file(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(3)
    lines = [json.dumps({"input_ids": torch.randint(0, 250, (16,), generator=g).tolist()}) for _ in range(4)]
    (tmp_path / "calib.jsonl").write_text("\n".join(lines))
    return tmp_path / "calib.jsonl"


# ---------------------------------------------------------------- FP8: weights multiples of 16 on each rank


@pytest.mark.parametrize("target", ["pytorch", "engine"])
@pytest.mark.parametrize(("sizes", "tp", "first"), [
    ({"hidden_size": 72, "intermediate_size": 120}, 1, "model.layers.0.self_attn.q_proj.weight is 72x72 per rank at "
                                                       "TP=1 (of 72x72)"),
    ({"intermediate_size": 96}, 4, "model.layers.0.mlp.gate_proj.weight is 24x64 per rank at TP=4 (of 96x64)"),
], ids=["hidden-72", "ffn-96-tp4"])
def test_fp8_refuses_weights_fp8_gemms_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str,
                                                  sizes: dict, tp: int, first: str) -> None:
    """Before: exit 0 (torch._scaled_mm and TensorRT-LLM's FP8 GEMMs need both dims divisible by 16). Refused
    before the calibration pass, naming the first such weight and its shape on one rank (ffn 96 is a multiple of 16,
    its quarter is not)."""
    hf = llama(tmp_path / "hf", **sizes)
    monkeypatch.setattr(fp8, "calibrate", lambda *a: pytest.fail("calibrated before refusing"))
    rc, err = run("trtllm", hf, tmp_path / "out", "--target", target, "--tp", tp, "--fp8", "--calib",
                  calib_file(tmp_path))
    assert rc == 2 and err == (f"mcorekit: error: FP8 needs every quantized weight to be a multiple of 16 in both dims "
                               f"on each rank (FP8 GEMMs require it), but {first}; export this model without --fp8 "
                               f"(bf16/fp16)\n"), err
    assert not (tmp_path / "out").exists()


def test_fp8_shape_of_duplicated_kv_heads() -> None:
    """With fewer KV heads than ranks each rank holds one K (and V) head: head_dim 8 fits at TP=1 (K 16 rows), not
    at TP=4."""
    spec = ModelSpec("llama", 2, 64, 8, 2, 8, 128, 250)
    assert fp8.shape_problem(spec, 1) is None
    problem = fp8.shape_problem(spec, 4)
    assert problem and "but model.layers.0.self_attn.k_proj.weight is 8x64 per rank at TP=4 (of 16x64);" in problem


# ---------------------------------------------------------------- engine: rotary_scaling


@pytest.mark.parametrize(("rope_scaling", "want"), [
    ({"rope_type": "default"}, None),
    ({"type": "default"}, None),
    (None, None),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192},
     {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}),
], ids=["rope_type-default", "type-default", "none", "llama3"])
def test_engine_writes_rotary_scaling_only_for_llama3(tmp_path: Path, rope_scaling: dict | None,
                                                      want: dict | None) -> None:
    """Before: {"type": "llama3"} for any rope_scaling given, HF's "default" (plain rope) included."""
    hf = llama(tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "rope_scaling": rope_scaling}))
    export(hf, tmp_path / "out", "engine", quiet=True)
    assert json.loads((tmp_path / "out/config.json").read_text())["rotary_scaling"] == want


def test_engine_refuses_rope_scaling_it_does_not_write() -> None:
    spec = ModelSpec("llama", 2, 64, 4, 2, 16, 128, 250, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ExportError, match=r"^the engine target writes llama3 rope scaling only, not 'yarn' \(llama\); "
                                          r"use --target pytorch$"):
        engine.check(spec, None)


# ---------------------------------------------------------------- pytorch: a stale quantization_config


def test_stale_quantization_config_is_left_out_of_a_bf16_export(tmp_path: Path) -> None:
    """Before: copied into the export's config.json, so a loader would take these bf16 weights for FP8 ones."""
    hf = make_model("llama", tied=False, out=tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    stale = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (hf / "config.json").write_text(json.dumps({**config, "quantization_config": stale}))
    for dtype in ("bf16", "fp16"):
        out = tmp_path / f"out-{dtype}"
        rc, err = run("trtllm", hf, out, "--target", "pytorch", "--dtype", dtype)
        assert rc == 0 and "quantization_config" not in json.loads((out / "config.json").read_text()), err
        name = "bfloat16" if dtype == "bf16" else "float16"
        assert err == (f"mcorekit: warning: the source config.json has a quantization_config (quant_method 'fp8') but "
                       f"these weights are {name}: it is left out of the exported config.json\n"), err
    rc, err = run("trtllm", hf, tmp_path / "fp8", "--target", "pytorch", "--fp8", "--calib", calib_file(tmp_path))
    assert rc == 0 and "warning" not in err, err  # FP8 writes its own
    assert json.loads((tmp_path / "fp8/config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    rc, err = run("trtllm", hf, tmp_path / "engine", "--target", "engine")  # hf/: the tokenizer and config, served
    assert rc == 0 and json.loads((tmp_path / "engine/hf/config.json").read_text()) == config, err


# ---------------------------------------------------------------- FP8 bytes: the same in both targets


SCALES = (("weights_scaling_factor", "weight_scale"), ("activation_scaling_factor", "input_scale"))  # engine, pytorch


def test_fp8_bytes_and_scales_are_the_same_in_both_targets_for_an_fp32_source(tmp_path: Path) -> None:
    """Before: the engine target cast the fp32 weights to --dtype (bf16) and quantized that, rounding twice; the
    pytorch target quantized the source. Both now quantize the source: the same FP8 bytes and scales, and the
    weights the engine fuses (qkv) are the pytorch target's, concatenated."""
    hf = llama(tmp_path / "hf", dtype=torch.float32)
    calib = calib_file(tmp_path)
    export(hf, tmp_path / "pt", "pytorch", use_fp8=True, calib=str(calib), quiet=True)
    export(hf, tmp_path / "eng", "engine", use_fp8=True, calib=str(calib), quiet=True)
    pt, rank = HFReader(tmp_path / "pt"), load_file(tmp_path / "eng/rank0.safetensors")
    compared = 0
    for layer in range(2):
        hf_layer, tl = f"model.layers.{layer}", f"transformer.layers.{layer}"
        fused = {"attention.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                 "attention.dense": ["self_attn.o_proj"], "mlp.fc": ["mlp.gate_proj"], "mlp.gate": ["mlp.up_proj"],
                 "mlp.proj": ["mlp.down_proj"]}
        for name, modules in fused.items():
            want = torch.cat([pt.get(f"{hf_layer}.{m}.weight") for m in modules])
            got = rank[f"{tl}.{name}.weight"]
            assert got.dtype == want.dtype == torch.float8_e4m3fn
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
            first = f"{hf_layer}.{modules[0]}"  # q/k/v share their scales, as the engine's fused qkv needs
            for ours, theirs in SCALES:
                assert torch.equal(rank[f"{tl}.{name}.{ours}"], pt.get(f"{first}.{theirs}").reshape(1))
            compared += 1
    assert compared == 10
