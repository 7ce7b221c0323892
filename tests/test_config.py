"""Experiment and profile loading: did-you-mean for typos, typed overrides, unsafe values refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcorekit.config.cluster import load_profile
from mcorekit.config.experiment import Experiment, load_experiment
from mcorekit.config.loading import apply_overrides
from mcorekit.config.values import parse_time_minutes
from mcorekit.errors import ConfigError, ModelError
from mcorekit.models.spec import PRESETS, from_hf_config, resolve

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "llama-tiny.yaml"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_example_loads_with_defaults() -> None:
    exp = load_experiment(TINY)
    assert exp.name == "llama-tiny" and exp.parallel.tp == 1 and exp.optimizer.overlap_grad_reduce is True


def test_unknown_key_in_file_suggests_the_right_one(tmp_path: Path) -> None:
    p = write(tmp_path, "name: x\nparallel:\n  tensor_paralel: 2\nschedul: {}\n")
    with pytest.raises(ConfigError) as e:
        load_experiment(p)
    msg = str(e.value)
    assert "unknown key 'parallel.tensor_paralel'" in msg
    assert "unknown key 'schedul'; did you mean 'schedule'?" in msg


def test_override_typo_and_types() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer.learning_rate'"):
        load_experiment(TINY, ["optimizer.learning_rate=1e-3"])
    with pytest.raises(ConfigError, match=r"did you mean 'micro_batch_size'"):
        load_experiment(TINY, ["schedule.micro_batch=2"])
    with pytest.raises(ConfigError, match=r"parallel.tp \(from the override parallel.tp=...\): .*integer"):
        load_experiment(TINY, ["parallel.tp=two"])
    with pytest.raises(ConfigError, match=r"precision.fp8"):
        load_experiment(TINY, ["precision.fp8=e5m2"])
    exp = load_experiment(TINY, ["parallel.tp=2", "optimizer.lr=1e-3", "data.paths=[a, b]", "precision.fp8=delayed"])
    assert (exp.parallel.tp, exp.optimizer.lr, exp.data.paths, exp.precision.fp8) == (2, 1e-3, ["a", "b"], "delayed")
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_overrides({}, ["parallel.tp"], Experiment)


def test_name_becomes_a_job_name_so_it_is_restricted(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Slurm job name"):
        load_experiment(TINY, ["name=a;rm -rf ~"])


def test_profiles() -> None:
    local = load_profile("local")
    assert local.gpus_per_node == 0 and local.tasks_per_node == 2
    h100 = load_profile("example-h100")
    assert h100.gpus_per_node == 8 and h100.container.image
    with pytest.raises(ConfigError, match="no cluster profile named 'nope'; known: example-h100, local"):
        load_profile("nope")
    with pytest.raises(ConfigError, match="did you mean 'partition'"):
        load_profile("local", ["partion=x"])
    with pytest.raises(ConfigError, match="not a valid shell identifier"):
        load_profile("local", ["env={'A B': x}"])
    with pytest.raises(ConfigError, match="newline"):
        load_profile("local", ['setup=["echo a\\nb"]'])
    with pytest.raises(ConfigError, match="Slurm time"):
        load_profile("local", ["time_limit=soon"])


@pytest.mark.parametrize("value,minutes", [("30", 30), ("01:30:00", 90), ("1-00:00:00", 1440), ("00:00:30", 1), ("2-3", 3060)])
def test_time_parsing(value: str, minutes: int) -> None:
    assert parse_time_minutes(value) == minutes


def test_yaml_scalars_read_as_yaml_1_2_core(tmp_path: Path) -> None:
    """PyYAML's YAML 1.1 read `1:00:00` as 3600 (a refused time), `yes` as True, `1e-4` as text and dates as dates;
    the loader reads them as written."""
    from mcorekit.config.loading import parse_yaml

    doc = "a: 1:00:00\nb: yes\nc: off\nd: 1e-4\ne: 2026-12-04\nf: 017\ng: true\nh: .5\ni: 0x10\nj: .inf\n"
    assert parse_yaml(doc, "t") == {"a": "1:00:00", "b": "yes", "c": "off", "d": 1e-4, "e": "2026-12-04", "f": "017",
                                    "g": True, "h": 0.5, "i": 16, "j": float("inf")}
    exp = load_experiment(write(tmp_path, TINY.read_text().replace('time: "00:20:00"', "time: 1:00:00")), ["name=yes"])
    assert exp.resources.time == "1:00:00" and exp.name == "yes"
    assert load_experiment(TINY, ["resources.time=90"]).resources.time == "90"  # Slurm's minutes
    assert load_profile("local", ["time_limit=2:00:00"]).time_limit == "2:00:00"


@pytest.mark.parametrize("family, quantization", [("gpt_oss", {"quant_method": "mxfp4"}),
                                                  ("deepseek_v3", {"quant_method": "fp8", "fmt": "e4m3"})])
def test_training_takes_an_official_config_with_quantized_weights_and_fewer_layers(
        tmp_path: Path, family: str, quantization: dict) -> None:
    """The training path checks an HF config as conversion does, but how the weights are stored (the official
    GPT-OSS and DeepSeek-V3 configs name mxfp4 and fp8) does not matter for a model built from its shape; fewer
    layers (GPT-OSS's per-layer sliding-window list is then longer than the model) train as before."""
    import json

    from hf_models import FAMILY_CONFIGS

    from mcorekit.config.model import resolve_model
    from mcorekit.models.spec_checks import model_problems

    (tmp_path / "config.json").write_text(json.dumps({**FAMILY_CONFIGS[family]().to_dict(),
                                                      "quantization_config": quantization}))
    spec = resolve_model(None, str(tmp_path), {"num_layers": 2})
    assert spec.num_layers == 2 and model_problems(spec) == []


def test_model_from_hf_config_and_presets(tmp_path: Path) -> None:
    qwen3 = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "vocab_size": 100,
             "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "tie_word_embeddings": True}
    spec = from_hf_config(qwen3)
    assert (spec.kv_channels, spec.qk_layernorm, spec.rope_theta, spec.tie_word_embeddings) == (32, True, 1e6, True)
    with pytest.raises(ModelError, match="supported: deepseek_v2, deepseek_v3, gpt_oss, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe"):
        from_hf_config({**qwen3, "model_type": "gpt2"})
    with pytest.raises(ModelError, match="did you mean 'llama-tiny'"):
        resolve(preset="lama-tiny")
    assert resolve(preset="llama-tiny", overrides={"num_layers": 2}).num_layers == 2
    # The 0.89B benchmark shape of docs/ really is 0.89B.
    assert round(PRESETS["llama-0.9b"].num_parameters() / 1e9, 2) == 0.89
