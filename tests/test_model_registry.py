"""models/: one place per concept. Each architecture family is one file (models/families/) that convert/ and
export/ read; a test-only family (tests/toy_llama.py, a Llama with its own model_type and every HF tensor renamed)
registered from here converts HF -> torch_dist -> HF bitwise, through the legacy format at a layout, and exports
to both targets, with no other change. One layout checker, one dtype table, one export-target registry; a
checkpoint with shared experts and no family to hold them fails with a line that says so."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import toy_llama
from hf_models import make_model
from mcorekit.convert import pipeline
from mcorekit.convert.hf_io import HFReader
from mcorekit.convert.torch_dist import TorchDistReader
from mcorekit.convert.verify import compare_hf
from mcorekit.errors import ConversionError, ExportError, ModelError
from mcorekit.export import fp8, targets
from mcorekit.export.pipeline import export
from mcorekit.models import dtypes, registry
from mcorekit.models.parallel import MEGATRON, TENSORRT_LLM, Layout, layout_problems
from mcorekit.models.spec import from_hf_config

REPO = Path(__file__).resolve().parent.parent


def renamed(llama: Path, out: Path) -> Path:
    """The Llama checkpoint with toy_llama's names and model_type (same tensors, bit for bit)."""
    config = json.loads((llama / "config.json").read_text())
    to_toy = {}
    for toy, name in toy_llama.LLAMA_NAMES.items():
        for layer in range(config["num_hidden_layers"]) if "{layer}" in name else [None]:
            to_toy[f"{name.format(layer=layer)}.weight"] = f"{toy.format(layer=layer)}.weight"
    reader = HFReader(llama)
    tensors = {to_toy[n]: reader.get(n) for n in reader.names()}
    reader.close()
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "model_type": "toy_llama", "architectures": ["ToyLlama"]}))
    (out / "tokenizer_config.json").write_text((llama / "tokenizer_config.json").read_text())
    return out


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    registry.register(toy_llama.FAMILY)
    root = tmp_path_factory.mktemp("toy")
    llama = make_model("llama", tied=False, out=root / "llama")
    yield llama, renamed(llama, root / "toy")
    registry.unregister("toy_llama")


def assert_bitwise(a: Path, b: Path) -> None:
    reports = compare_hf(a, b)
    assert reports and all(r.status == "equal" for r in reports), [r for r in reports if r.status != "equal"][:3]


def test_a_registered_family_round_trips_and_is_the_same_megatron_checkpoint(toy, tmp_path: Path) -> None:
    llama, hf = toy
    assert "toy_llama" in registry.supported_model_types()
    pipeline.hf_to_mcore(hf, tmp_path / "toy", quiet=True)
    pipeline.mcore_to_hf(tmp_path / "toy", tmp_path / "back", quiet=True)
    assert_bitwise(hf, tmp_path / "back")
    assert json.loads((tmp_path / "back/config.json").read_text())["model_type"] == "toy_llama"
    # the renamed checkpoint and the Llama it came from are one Megatron checkpoint
    pipeline.hf_to_mcore(llama, tmp_path / "llama", quiet=True)
    a, b = TorchDistReader(tmp_path / "toy/release"), TorchDistReader(tmp_path / "llama/release")
    assert a.tensor_keys().keys() == b.tensor_keys().keys() and a.bytes_keys() == b.bytes_keys()
    assert all(torch.equal(a.read(k), b.read(k)) for k in a.tensor_keys())


def test_a_registered_family_in_the_legacy_format(toy, tmp_path: Path) -> None:
    _, hf = toy
    pipeline.hf_to_mcore(hf, tmp_path / "m", fmt="torch", tp=2, pp=2, quiet=True)
    assert len(list((tmp_path / "m/release").iterdir())) == 4
    pipeline.mcore_to_hf(tmp_path / "m", tmp_path / "back", quiet=True)
    assert_bitwise(hf, tmp_path / "back")


def test_a_registered_family_exports_to_both_targets(toy, tmp_path: Path) -> None:
    llama, hf = toy
    export(hf, tmp_path / "pytorch", "pytorch", tp=2, quiet=True)
    assert_bitwise(hf, tmp_path / "pytorch")  # bf16 in, bf16 out
    assert json.loads((tmp_path / "pytorch/config.json").read_text())["model_type"] == "toy_llama"
    # engine rank files: the same files as the Llama's (names and splits come from the map)
    export(hf, tmp_path / "toy-engine", "engine", tp=2, pp=2, quiet=True)
    export(llama, tmp_path / "llama-engine", "engine", tp=2, pp=2, quiet=True)
    for rank in range(4):
        a, b = (load_file(tmp_path / d / f"rank{rank}.safetensors") for d in ("toy-engine", "llama-engine"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (json.loads((tmp_path / "toy-engine/config.json").read_text())
            == json.loads((tmp_path / "llama-engine/config.json").read_text()))
    # FP8 would quantize the toy's own linear names, q/k/v and gate/up sharing one scale per group
    spec = from_hf_config(json.loads((hf / "config.json").read_text()))
    reader = HFReader(hf)
    assert len(fp8.linear_modules(reader, spec)) == 4 * 7
    groups = registry.weight_map(spec).fused_hf_modules(spec)
    assert ("blocks.0.attn.wq", "blocks.0.attn.wk", "blocks.0.attn.wv") in groups
    assert ("blocks.3.ffn.w_gate", "blocks.3.ffn.w_up") in groups


def test_registry_lookups(toy) -> None:
    with pytest.raises(ModelError, match=r"supported: deepseek_v2, deepseek_v3, gpt_oss, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, toy_llama"):
        registry.for_config({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="already registered"):
        registry.register(toy_llama.FAMILY)
    # the engine target (TensorRT-LLM <= 1.2) has no DeepSeek-V3 or GPT-OSS architecture: those families say why
    assert sorted(f.name for f in registry.families().values() if not f.trtllm) == ["deepseek_v3", "gpt_oss"]
    assert all(f.no_engine for f in registry.families().values() if not f.trtllm)


def test_each_architecture_is_spelled_in_one_file() -> None:
    """An HF model type, and the HF expert names, appear in one source file: their family's."""
    sources = [p for p in REPO.rglob("*.py") if not ({"tests", ".venv"} & set(p.relative_to(REPO).parts))
               and not any(part.startswith(".") for part in p.relative_to(REPO).parts)]

    def files(pattern: str) -> list[str]:
        return sorted(str(p.relative_to(REPO)) for p in sources if re.search(pattern, p.read_text()))

    assert files("qwen3_moe") == ["models/families/qwen3_moe.py"]
    assert files("qwen2_moe") == ["models/families/qwen2_moe.py"]
    assert files("block_sparse_moe") == files(r"\bw[13]\b") == ["models/families/mixtral.py"]
    # convert/ and export/ name no HF tensor: they read the names from the map
    assert [f for f in files(r"q_proj|gate_proj|embed_tokens|model\.layers|self_attn") if f.startswith(("convert/", "export/"))] == []
    assert files(r"ROW_PARALLEL|COLUMN_PARALLEL|DTYPE_NAMES|def check_layout\(spec: ModelSpec, tp") == []


# ---------------------------------------------------------------- shared experts


def test_a_shared_expert_checkpoint_needs_a_family_with_shared_experts(tmp_path: Path) -> None:
    """Megatron's shared experts (moe_shared_expert_intermediate_size) convert to Qwen2-MoE; with the HF config
    of a family without them, the conversion back says why it cannot be done."""
    q2 = make_model("qwen2_moe", False, tmp_path / "qwen2_moe")
    q3 = make_model("qwen3_moe", False, tmp_path / "qwen3_moe")
    pipeline.hf_to_mcore(q2, tmp_path / "m", quiet=True)
    keys = TorchDistReader(tmp_path / "m/release").tensor_keys()
    assert tuple(keys["decoder.layers.mlp.shared_experts.linear_fc1.weight"].size) == (4, 2 * 48, 64)
    assert tuple(keys["decoder.layers.mlp.shared_experts.gate_weight"].size) == (4, 1, 64)
    with pytest.raises(ConversionError, match="shared-expert weights .* no shared expert"):
        pipeline.mcore_to_hf(tmp_path / "m", tmp_path / "out", hf_config=str(q3), quiet=True)
    assert not (tmp_path / "out").exists()


def test_qwen2_moe_engine_config_declares_the_shared_expert(tmp_path: Path) -> None:
    hf = make_model("qwen2_moe", False, tmp_path / "hf")
    export(hf, tmp_path / "trt", "engine", tp=2, quiet=True)
    cfg = json.loads((tmp_path / "trt/config.json").read_text())
    assert (cfg["architecture"], cfg["qwen_type"], cfg["attn_bias"]) == ("QWenForCausalLM", "qwen2_moe", True)
    assert cfg["moe"]["shared_expert_intermediate_size"] == cfg["moe_shared_expert_intermediate_size"] == 48
    assert cfg["moe"]["normalization_mode"] == 0  # norm_topk_prob false: softmax, top-k, no renormalisation
    r1 = load_file(tmp_path / "trt/rank1.safetensors")
    assert tuple(r1["transformer.layers.0.mlp.shared_expert.fc.weight"].shape) == (48, 64)  # [up_1; gate_1], 24 each
    assert tuple(r1["transformer.layers.0.mlp.shared_expert_gate.weight"].shape) == (1, 64)


# ---------------------------------------------------------------- one layout checker, one dtype table, one target list


def test_one_layout_checker_for_megatron_and_tensorrt_llm() -> None:
    dense = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 250}
    spec = from_hf_config({**dense, "model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 32,
                           "shared_expert_intermediate_size": 48})
    assert layout_problems(spec, Layout(tp=2, pp=2, ep=4)) == []
    assert layout_problems(spec, Layout(tp=4)) == ["TP=4 does not divide num_query_groups=2"]
    assert layout_problems(spec, Layout(tp=4), TENSORRT_LLM) == []  # KV heads duplicated
    assert layout_problems(spec, Layout(pp=3, vpp=2)) == ["PP*VPP=6 does not divide num_layers=4"]
    assert layout_problems(spec, Layout(vpp=2)) == ["VPP=2 needs PP >= 2"]
    assert layout_problems(spec, Layout(ep=3), MEGATRON) == ["EP=3 does not divide num_experts=4"]
    assert layout_problems(spec, Layout(tp=2, ep=4), TENSORRT_LLM) == [
        "EP=4 must divide TP=2 (TensorRT-LLM places experts inside the TP group: moe_tp * moe_ep = tp)"]
    assert layout_problems(spec, Layout(tp=0)) == ["parallel sizes must be integers >= 1: TP=0"]
    assert layout_problems(spec, Layout(tp=2), MEGATRON, padded_vocab=251) == [
        "TP=2 does not divide the padded vocab 251 (raise --vocab-divisible-by)"]
    assert layout_problems(from_hf_config(dense), Layout(tp=2, ep=2, etp=2)) == ["EP=2, ETP=2 given for a dense model"]
    assert layout_problems(from_hf_config(dense), Layout(ep=2), TENSORRT_LLM) == ["EP=2 given for a dense model"]
    assert layout_problems(from_hf_config({**dense, "intermediate_size": 130}), Layout(tp=4), TENSORRT_LLM) == [
        "TP=4 does not divide intermediate_size=130"]


def test_one_dtype_table_and_one_target_list() -> None:
    from mcorekit.cli import main
    from mcorekit.models.megatron import DTYPES

    assert set(DTYPES) == set(dtypes.NAMES) and all(str(DTYPES[k]) == f"torch.{v}" for k, v in dtypes.NAMES.items())
    assert dtypes.from_config("bfloat16") == "bf16" and dtypes.from_config("int8") is None
    with pytest.raises(ExportError, match="unknown target 'onnx'; use pytorch .* or engine"):
        targets.get("onnx")
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        main(["export", "trtllm", "--help"])
    assert "{pytorch,engine}" in help_text.getvalue() and "{bf16,fp16,fp32}" in help_text.getvalue()


def help_of(command: list[str]) -> str:
    from mcorekit.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*command, "--help"])
    return out.getvalue()


def undocumented(help_text: str) -> list[str]:
    """Arguments in an argparse help whose entry has no help text (none on its line, no indented line below)."""
    lines = help_text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"^  (\S+(?: \S+)?)(?:\s{2,}(\S.*))?$", line)
        if m and not m.group(2) and not (i + 1 < len(lines) and re.match(r"^ {10,}\S", lines[i + 1])):
            out.append(m.group(1))
    return out


def test_convert_help_shows_every_flag_defaults_and_one_percent_sign() -> None:
    verify = help_of(["convert", "verify"])
    assert "%%" not in verify and "100%" in verify
    hf_to_mcore = help_of(["convert", "hf-to-mcore"])
    assert "(default: torch_dist)" in hf_to_mcore and "--tp TP" in hf_to_mcore
    for text in (verify, hf_to_mcore, help_of(["convert", "mcore-to-hf"])):
        assert undocumented(text) == [], text
    assert "hf-to-mcore   HF safetensors -> Megatron-Core checkpoint" in help_of(["convert"])
