"""Every experiment file in examples/ loads, and the launcher accepts it (a dry-run: validation and the rendered
sbatch script, nothing submitted, no GPU needed). The SFT and fine-tune examples carry placeholder paths; their
dry-run replaces the one path the launcher reads (model.hf_config, here a small HF config written by the test)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from mcorekit.cli import main
from mcorekit.config.experiment import load_experiment

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))
# the dev cluster (CPU-only) for the tiny demo model; the example 8-GPU profile for everything else
CLUSTER = {"llama-tiny.yaml": "local"}
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def dry_run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(["launch", *args, "--dry-run"])
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_the_examples_cover_moe_fp8_sft_and_finetuning() -> None:
    exps = {p.name: load_experiment(p) for p in EXAMPLES}
    assert any(e.model.preset in ("moe-8x-1.4b", "mixtral-tiny") and e.moe.grouped_gemm for e in exps.values())
    assert any(e.precision.fp8 == "tensorwise" for e in exps.values())
    assert any(e.data.kind == "sft" and e.data.tokenizer and e.data.paths for e in exps.values())
    assert any(e.model.hf_config and e.checkpoint.load and e.checkpoint.finetune for e in exps.values())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads_and_marks_its_placeholders(path: Path) -> None:
    exp = load_experiment(path)
    assert exp.name
    for line in path.read_text().splitlines():
        if "/path/to/" in line.split("#")[0]:
            assert "REPLACE" in line, f"{path.name}: a placeholder path without REPLACE: {line.strip()}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_the_launchers_checks(path: Path, tmp_path: Path) -> None:
    overrides = []
    exp = load_experiment(path)
    if exp.model.hf_config and exp.model.hf_config.startswith("/path/to/"):
        hf = tmp_path / "hf"
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps(LLAMA_1B))
        overrides.append(f"model.hf_config={hf}")
    code, out, err = dry_run("--config", str(path), "--cluster", CLUSTER.get(path.name, "example-h100"),
                             "--set", f"run_root={tmp_path / 'runs'}", *overrides)
    assert code == 0, err
    assert "# model:" in out and "srun" in out
    assert not (tmp_path / "runs").exists()  # a dry-run writes nothing


def test_placeholder_hf_config_is_refused_in_one_line() -> None:
    sft = next(p for p in EXAMPLES if p.name == "sft.yaml")
    code, _, err = dry_run("--config", str(sft), "--cluster", "example-h100")
    lines = [x for x in err.splitlines() if x.startswith("mcorekit: ")]
    assert code == 2 and len(lines) == 1 and "REPLACE-hf-model" in lines[0], err
