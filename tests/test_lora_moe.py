"""LoRA conversion (convert/lora.py) of MoE models, against adapters that `peft` itself writes, on CPU: Mixtral and
Qwen3-MoE (PEFT writes `target_parameters: []` for them); DeepSeek-V3 with a dense first layer, whose Megatron
checkpoints have one key per layer (`decoder.layers.<l>.<name>`) and whose dense MLP and shared expert exist only on
some layers: PEFT -> Megatron -> PEFT bit-exact, and the converted adapters are exactly what train/lora.py's model
loads and saves (its sharded state dict, through train/checkpoint.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mcorekit.convert import lora
from mcorekit.convert.torch_dist import TorchDistReader

sys.path.insert(0, str(Path(__file__).parent))
from hf_models import DEEPSEEK_V3  # noqa: E402
from test_lora import peft_adapter, tiny_hf  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def assert_same_adapter(want_dir: Path, got_dir: Path) -> None:
    want = load_file(str(want_dir / "adapter_model.safetensors"))
    got = load_file(str(got_dir / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def test_empty_peft_fields_are_defaults() -> None:
    """PEFT writes null, [] or {} for a field it does not use, depending on its version and the model."""
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_parameters": [], "modules_to_save": [],
              "layer_replication": [], "rank_pattern": None, "alpha_pattern": None}
    assert lora.peft_config_problems(config, 64) == []
    bad = lora.peft_config_problems({**config, "target_parameters": ["mlp.experts.gate_up_proj"]}, 64)
    assert bad == ["target_parameters=['mlp.experts.gate_up_proj'] has no Megatron LoRA counterpart (supported: None)"]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_adapter_from_peft_round_trips(name: str, tmp_path: Path) -> None:
    """peft 0.21 writes `target_parameters: []` for these models; the adapter imports and comes back bit-exact, and
    PEFT loads the exported one (its target_modules a regex that skips the routed experts)."""
    import peft

    hf = tiny_hf(name, tmp_path / "hf")
    theirs = peft_adapter(hf, tmp_path / "peft", ATTENTION)
    assert json.loads((theirs / "adapter_config.json").read_text())["target_parameters"] == []
    lora.peft_to_mcore(hf, theirs, tmp_path / "m")
    lora.mcore_to_peft(tmp_path / "m", tmp_path / "back")
    assert_same_adapter(theirs, tmp_path / "back")
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "back").state_dict()
    want = load_file(str(theirs / "adapter_model.safetensors"))
    assert all(torch.equal(loaded[k.replace(".weight", ".default.weight")], t) for k, t in want.items())


# ---------------------------------------------------------------- DeepSeek-V3: one key per layer


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three layers (one dense, two MoE with a shared expert), fp32."""
    out = tmp_path_factory.mktemp("deepseek")
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**{**DEEPSEEK_V3, "num_hidden_layers": 3})
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


# the keys Megatron-Core stores for a model whose layers differ, and what train/lora.py adapts on each layer
R, H = 4, 64
DEEPSEEK_KEYS = {
    **{f"decoder.layers.{i}.self_attention.linear_proj.adapter.lora_a": [R, 64] for i in range(3)},
    **{f"decoder.layers.{i}.self_attention.linear_proj.adapter.lora_b": [H, R] for i in range(3)},
    "decoder.layers.0.mlp.linear_fc1.adapter.lora_a": [2 * R, H],
    "decoder.layers.0.mlp.linear_fc1.adapter.lora_b": [256, R],
    "decoder.layers.0.mlp.linear_fc2.adapter.lora_a": [R, 128],
    "decoder.layers.0.mlp.linear_fc2.adapter.lora_b": [H, R],
    **{f"decoder.layers.{i}.mlp.shared_experts.linear_fc1.adapter.lora_a": [2 * R, H] for i in (1, 2)},
    **{f"decoder.layers.{i}.mlp.shared_experts.linear_fc1.adapter.lora_b": [64, R] for i in (1, 2)},
    **{f"decoder.layers.{i}.mlp.shared_experts.linear_fc2.adapter.lora_a": [R, 32] for i in (1, 2)},
    **{f"decoder.layers.{i}.mlp.shared_experts.linear_fc2.adapter.lora_b": [H, R] for i in (1, 2)},
}
PROJ_KEYS = {k: v for k, v in DEEPSEEK_KEYS.items() if ".linear_proj." in k}


def stored(ckpt: Path) -> dict[str, torch.Tensor]:
    reader = TorchDistReader(ckpt)
    return {k: reader.read(k) for k in reader.tensor_keys()}


def shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {k: list(t.shape) for k, t in tensors.items()}


def with_mlp_adapters(adapter: Path) -> Path:
    """PEFT's adapter with LoRA on the dense MLP (layer 0) and the shared experts (layers 1, 2) added in PEFT's names.
    peft 0.21 on transformers 5 cannot write these itself: it turns any gate/up/down_proj target of a DeepSeek model
    into target_parameters of the routed experts' fused weights (which we refuse), and adapts neither of these."""
    from safetensors.torch import save_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    g = torch.Generator().manual_seed(5)
    mlp = [(0, "mlp", 128)] + [(i, "mlp.shared_experts", 32) for i in (1, 2)]
    for layer, module, ffn in mlp:
        for proj, (a, b) in {"gate_proj": ((R, H), (ffn, R)), "up_proj": ((R, H), (ffn, R)),
                             "down_proj": ((R, ffn), (H, R))}.items():
            name = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(a, generator=g)
            tensors[f"{name}.lora_B.weight"] = torch.randn(b, generator=g)
    save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = json.loads((adapter / "adapter_config.json").read_text())  # and the modules they adapt, as PEFT names them
    config["target_modules"] = r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.(shared_experts\.)?(gate|up|down)_proj)"
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    return adapter


def test_deepseek_peft_adapter_imports_with_per_layer_keys(deepseek: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The adapter PEFT writes for o_proj: one key per layer (as Megatron-Core stores this model), exported back
    bit-exact (no MLP adapter: no warning about PEFT's MoE conversion)."""
    theirs = peft_adapter(deepseek, tmp_path / "peft", ["o_proj"], r=R)
    lora.peft_to_mcore(deepseek, theirs, tmp_path / "m")
    assert shapes(stored(tmp_path / "m/release")) == PROJ_KEYS
    capsys.readouterr()
    lora.mcore_to_peft(tmp_path / "m", tmp_path / "back")
    assert_same_adapter(theirs, tmp_path / "back")
    assert "routed experts" not in capsys.readouterr().err


def test_deepseek_mlp_adapters_only_on_their_layers(deepseek: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The dense MLP's adapters on layer 0 only, the shared experts' on layers 1 and 2 only; exported back bit-exact,
    without tensors for modules a layer lacks, with a warning: peft 0.21 under transformers 5 would load their
    gate/up/down_proj targets as LoRA on the routed experts instead."""
    theirs = with_mlp_adapters(peft_adapter(deepseek, tmp_path / "peft", ["o_proj"], r=R))
    lora.peft_to_mcore(deepseek, theirs, tmp_path / "m")
    assert shapes(stored(tmp_path / "m/release")) == DEEPSEEK_KEYS
    assert json.loads((tmp_path / "m/release/lora.json").read_text())["target_modules"] == ["proj", "fc1", "fc2"]
    capsys.readouterr()
    lora.mcore_to_peft(tmp_path / "m", tmp_path / "back")
    assert_same_adapter(theirs, tmp_path / "back")
    warned = capsys.readouterr().err
    assert "as LoRA on its routed experts (its MoE weight conversion) and drops these adapters" in warned


def test_deepseek_adapters_as_training_saves_and_loads_them(deepseek: Path, tmp_path: Path, model_parallel: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """train/lora.py on Megatron-Core's DeepSeek-V3 model (CPU, local spec), with random A and B: its sharded state
    dict has the converter's keys; saved as a LoRA run saves them, exported to PEFT and imported back, every tensor is
    bit-exact, and checkpoint.load_adapters loads the import into the model."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from mcorekit.config.experiment import LoraConfig
    from mcorekit.models.megatron import build_gpt, padded_vocab_size, transformer_config
    from mcorekit.models.spec import from_hf_config, load_hf_config
    from mcorekit.train import checkpoint
    from mcorekit.train.lora import adapters, apply_lora

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # the router's expert-bias buffer
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # Megatron's checkpoint writer
    spec = from_hf_config(load_hf_config(deepseek))
    cfg = transformer_config(spec, cpu_init=True, moe_token_dispatcher_type="allgather")
    model = build_gpt(spec, cfg, padded_vocab_size(spec.vocab_size, 128), use_te=False)
    targets = ["proj", "fc1", "fc2"]
    apply_lora(model, LoraConfig(rank=R, alpha=8.0, target_modules=targets), spec)
    model.mcorekit_lora = {"rank": R, "alpha": 8.0, "dropout": 0.0, "target_modules": targets, "experts": False,
                           "base": None, "model": spec.to_dict()}
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for a in adapters(model):
            a.lora_b.copy_(torch.randn(a.lora_b.shape, generator=g))
    sd = checkpoint._model_state([model], checkpoint.ADAPTERS)
    apply_factories(sd)
    assert {v.key: list(v.global_shape) for v in nested_values(sd) if isinstance(v, ShardedTensor)} == DEEPSEEK_KEYS

    saved = tmp_path / "run/iter_0000001"
    saved.mkdir(parents=True)
    dist_checkpointing.save(checkpoint._model_state([model], checkpoint.ADAPTERS), str(saved))
    (saved / checkpoint.LORA_JSON).write_text(json.dumps(model.mcorekit_lora))
    (saved.parent / checkpoint.TRACKER).write_text("1")
    lora.mcore_to_peft(saved.parent, tmp_path / "peft", hf_config=str(deepseek))
    lora.peft_to_mcore(deepseek, tmp_path / "peft", tmp_path / "m")
    want, got = stored(saved), stored(tmp_path / "m/release")
    assert shapes(got) == DEEPSEEK_KEYS and all(torch.equal(got[k], want[k]) for k in want)

    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for a in adapters(model):
            a.lora_a.zero_(), a.lora_b.zero_()
    checkpoint.load_adapters(tmp_path / "m/release", [model])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_deepseek_merge_reads_per_layer_adapters(deepseek: Path, tmp_path: Path) -> None:
    """--merge of the per-layer adapters into the per-layer base: W + alpha / r * B @ A on exactly the adapted HF
    weights (fp32, so exact), every other weight as it was. (The way to serve DeepSeek MLP adapters: peft 0.21 on
    transformers 5 loads only the o_proj ones, see with_mlp_adapters.)"""
    from mcorekit.convert import pipeline
    from mcorekit.convert.hf_io import HFReader

    theirs = with_mlp_adapters(peft_adapter(deepseek, tmp_path / "peft", ["o_proj"], r=R, alpha=8.0))
    lora.peft_to_mcore(deepseek, theirs, tmp_path / "m")
    pipeline.hf_to_mcore(deepseek, tmp_path / "base", quiet=True)
    lora.mcore_to_hf_merged(tmp_path / "m", tmp_path / "merged", base=str(tmp_path / "base"), quiet=True)
    merged, base = HFReader(tmp_path / "merged"), HFReader(deepseek)
    t = load_file(str(theirs / "adapter_model.safetensors"))
    assert sorted(merged.names()) == sorted(base.names())
    adapted = 0
    for name in base.names():
        module = f"base_model.model.{name.removesuffix('.weight')}"
        a, b = t.get(f"{module}.lora_A.weight"), t.get(f"{module}.lora_B.weight")
        want = base.get(name) if a is None else base.get(name) + 8.0 / R * (b @ a)
        adapted += a is not None
        assert torch.equal(merged.get(name), want), name
    assert adapted == 12  # o_proj on 3 layers, gate/up/down on the dense layer and the 2 shared experts


def test_multi_token_prediction_layers_get_no_adapters(deepseek: Path, model_parallel: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT and HF inference have no MTP layer: an adapter there could not be exported (nor imported back)."""
    import dataclasses

    from mcorekit.config.experiment import LoraConfig
    from mcorekit.models.megatron import build_gpt, padded_vocab_size, transformer_config
    from mcorekit.models.spec import from_hf_config, load_hf_config
    from mcorekit.train.lora import apply_lora

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # the router's expert-bias buffer
    counts = []
    for mtp in (0, 1):
        spec = dataclasses.replace(from_hf_config(load_hf_config(deepseek)), mtp_layers=mtp)
        cfg = transformer_config(spec, cpu_init=True, moe_token_dispatcher_type="allgather")
        model = build_gpt(spec, cfg, padded_vocab_size(spec.vocab_size, 128), use_te=False)
        assert (getattr(model, "mtp", None) is not None) == bool(mtp)
        counts.append(apply_lora(model, LoraConfig(rank=R, alpha=8.0, target_modules=["qkv", "proj", "fc1", "fc2"]),
                                 spec))
        assert not [n for n, p in model.named_parameters() if p.requires_grad and n.startswith("mtp.")]
    assert counts[0] == counts[1] > 0

