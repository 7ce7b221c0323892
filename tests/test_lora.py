"""LoRA (train/lora.py, convert/lora.py) against real PEFT and transformers on tiny models, on CPU: adapter names,
shapes and bits against what `peft` writes; PEFT -> Megatron -> PEFT bit-exact; the Megatron model with adapters
(one gloo process, local spec, fp32) against HF + PEFT loading our exported adapter; --merge against
merge_and_unload(); frozen base; TP split shapes; the rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mcorekit.convert import lora, pipeline
from mcorekit.errors import ConversionError

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from hf_models import COMMON, CONFIGS  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_hf(name: str, out: Path) -> Path:
    """Two layers of the hf_models config, fp32, random norms (and random q/k/v biases for qwen2)."""
    cfg = type(CONFIGS[name](False))(**{**COMMON, "num_hidden_layers": 2})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def peft_adapter(hf: Path, out: Path, targets: list[str], r: int = 4, alpha: float = 8.0) -> Path:
    """PEFT's own adapter for the model (random A and B, so every element is checked)."""
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_peft_round_trip_is_bitwise(name: str, llama: Path, tmp_path: Path) -> None:
    hf = llama if name == "llama" else tiny_hf(name, tmp_path / "hf")
    theirs = peft_adapter(hf, tmp_path / "peft", ALL)
    lora.peft_to_mcore(hf, theirs, tmp_path / "m")
    stored = json.loads((tmp_path / "m/release/lora.json").read_text())
    assert (stored["rank"], stored["alpha"], sorted(stored["target_modules"])) == (4, 8.0, ["fc1", "fc2", "proj", "qkv"])
    # Megatron's layout: A blocks stacked [3r, H] for q/k/v, B in the fused qkv order [(heads + 2 groups) * d, r]
    from mcorekit.convert.torch_dist import TorchDistReader

    keys = {k: tuple(v.size) for k, v in TorchDistReader(tmp_path / "m/release").tensor_keys().items()}
    assert keys["decoder.layers.self_attention.linear_qkv.adapter.lora_a"] == (2, 12, 64)
    assert keys["decoder.layers.self_attention.linear_qkv.adapter.lora_b"] == (2, (4 + 2 * 2) * 16, 4)
    assert keys["decoder.layers.mlp.linear_fc1.adapter.lora_b"] == (2, 256, 4)
    lora.mcore_to_peft(tmp_path / "m", tmp_path / "back")
    want, got = load_file(str(theirs / "adapter_model.safetensors")), load_file(str(tmp_path / "back/adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and len(want) == 2 * 2 * 7
    assert all(got[k].shape == want[k].shape and torch.equal(got[k], want[k]) for k in want)
    config = json.loads((tmp_path / "back/adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, sorted(ALL))


def test_partial_targets_import_as_zero_blocks(llama: Path, tmp_path: Path) -> None:
    """PEFT's usual q_proj + v_proj: k gets zero A and B (no output, no gradient), q and v come back bit-exact."""
    theirs = peft_adapter(llama, tmp_path / "peft", ["q_proj", "v_proj"])
    lora.peft_to_mcore(llama, theirs, tmp_path / "m")
    lora.mcore_to_peft(tmp_path / "m", tmp_path / "back")
    want, got = load_file(str(theirs / "adapter_model.safetensors")), load_file(str(tmp_path / "back/adapter_model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    extra = sorted(set(got) - set(want))
    assert len(extra) == 4 and all(".k_proj." in k and not got[k].any() for k in extra)


def test_tp_split_shapes() -> None:
    """A replicated and B split like the weight for column layers; A split on its input, B replicated for row ones."""
    from mcorekit.models.spec import ModelSpec
    from mcorekit.train.lora import adapter_shape

    spec = ModelSpec("llama", 2, 64, 4, 2, 16, 128, 250)
    local = {t: adapter_shape(spec, t).local(8, 2) for t in ("qkv", "proj", "fc1", "fc2")}
    assert local == {"qkv": ((24, 64), (64, 8)), "proj": ((8, 32), (64, 8)), "fc1": ((16, 64), (128, 8)),
                     "fc2": ((8, 64), (64, 8))}


def test_megatron_model_with_adapters_gives_peft_logits(llama: Path, tmp_path: Path) -> None:
    """The Megatron model (train/lora.py on the local spec) with non-zero adapters, saved as a LoRA run saves them,
    exported with --lora: HF + PEFT loading it gives the same logits (fp32), without warnings about keys; adapters
    off give the base model's logits; --merge equals PEFT's merge_and_unload(); a step moves only the adapters."""
    import peft

    pipeline.hf_to_mcore(llama, tmp_path / "base", quiet=True)
    env = {**os.environ, "PYTHONPATH": str(HERE), "LORA_PORT": "29588"}
    proc = subprocess.run([sys.executable, str(HERE / "lora_cpu_driver.py"), str(tmp_path / "base"), str(llama),
                           str(tmp_path / "run"), "4", "8", "qkv,proj,fc1,fc2"],
                          capture_output=True, text=True, env=env, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("LORA ")), None)
    assert line, proc.stderr[-3000:]
    got = json.loads(line[5:])
    per_layer = 4 * (3 * 64 + 128) + 4 * (64 + 64) + 4 * (2 * 64 + 256) + 4 * (128 + 64)  # qkv, proj, fc1, fc2
    assert got["adapted"] == 8 and got["trainable"] == 2 * per_layer and got["frozen"] > 10 * got["trainable"]
    assert got["frozen_ok"] and got["base_unchanged_after_step"]
    ckpt = tmp_path / "run/ckpt"
    from mcorekit.convert.torch_dist import TorchDistReader
    from mcorekit.train.lora import is_adapter_key

    stored = TorchDistReader(ckpt / "iter_0000001").tensor_keys()
    assert len(stored) == 8 and all(is_adapter_key(k) for k in stored)  # the adapters only, not the base
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    assert 4 * got["trainable"] < size < 4 * got["trainable"] + 48_000  # fp32 adapters + DCP's metadata

    lora.mcore_to_peft(ckpt, tmp_path / "adapter", hf_config=str(llama))
    logits = load_file(str(tmp_path / "run/logits.safetensors"))
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    with torch.no_grad():
        off = base(logits["ids"]).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert not [w for w in caught if "adapter" in str(w.message).lower() or "key" in str(w.message).lower()]
    with torch.no_grad():
        on = model(logits["ids"]).logits
    cosine = torch.nn.functional.cosine_similarity(on.flatten().double(), logits["on"].flatten().double(), dim=0)
    assert (on - logits["on"]).abs().max() < 1e-4 and cosine >= 0.9999
    assert (off - logits["off"]).abs().max() < 1e-4
    assert (logits["on"] - logits["off"]).abs().max() > 0.05  # the adapters matter

    lora.mcore_to_hf_merged(ckpt, tmp_path / "merged", base=str(tmp_path / "base"), hf_config=str(llama), quiet=True)
    merged = model.merge_and_unload().state_dict()
    from mcorekit.convert.hf_io import HFReader

    reader = HFReader(tmp_path / "merged")
    assert sorted(reader.names()) == sorted(merged)
    assert max((reader.get(n) - merged[n]).abs().max().item() for n in reader.names()) < 1e-6
    # the base the run recorded, gone since (its own run's keep_last prunes it once no LoRA run reads it)
    (tmp_path / "base").rename(tmp_path / "base-kept")
    with pytest.raises(ConversionError, match=r"the base these adapters were trained on, .*/base .* is gone; pass "
                                              r"--base with a copy"):
        lora.mcore_to_hf_merged(ckpt, tmp_path / "merged-again", hf_config=str(llama), quiet=True)
    assert not (tmp_path / "merged-again").exists()


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing written


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`mcorekit convert ARGS --quiet` in this process (a subprocess per call spent most of this file's time
    importing torch): its exit code and what it printed."""
    import contextlib
    import io

    from mcorekit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["convert", *args, "--quiet"])
        except SystemExit as e:
            code = int(e.code or 0)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_refuses_what_has_no_megatron_counterpart(llama: Path, tmp_path: Path) -> None:
    theirs = peft_adapter(llama, tmp_path / "peft", ["q_proj", "k_proj", "v_proj"])
    config = json.loads((theirs / "adapter_config.json").read_text())
    (theirs / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    proc = run_cli("hf-to-mcore", str(llama), str(tmp_path / "m"), "--lora", str(theirs))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "use_dora=True" in proc.stderr, proc.stderr
    assert not (tmp_path / "m").exists()
    (theirs / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(theirs / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    save_file(tensors, str(theirs / "adapter_model.safetensors"))
    proc = run_cli("hf-to-mcore", str(llama), str(tmp_path / "m"), "--lora", str(theirs))
    assert proc.returncode == 2 and "lm_head" in proc.stderr and not (tmp_path / "m").exists(), proc.stderr
    proc = run_cli("mcore-to-hf", str(theirs), str(tmp_path / "x"), "--lora")
    assert proc.returncode == 2 and proc.stderr.startswith("mcorekit: error:"), proc.stderr


def test_rules() -> None:
    from mcorekit.config.experiment import load_experiment
    from mcorekit.config.rules import Nodes, problems

    node = Nodes(transformer_engine=True, gpus=False)
    ok = ["peft.lora.rank=8", "checkpoint.load=/ckpt/base"]
    assert problems(load_experiment("examples/llama-tiny.yaml", ok), 1, node) == []
    assert problems(load_experiment("examples/llama-tiny.yaml", ["peft.lora.rank=8"]), 1, node)[0].startswith(
        "peft.lora adapts a trained model: set checkpoint.load")
    bad = problems(load_experiment("examples/llama-tiny.yaml", [*ok, "peft.lora.experts=true"]), 1, node)
    assert bad == ["peft.lora.experts: LoRA on the routed MoE experts is not built; set it false (attention, dense and "
                   "shared-expert MLP layers are adapted)"]


# ---------------------------------------------------------------- the adapter's forward (train/lora.py), on its own


def _adapter(target: str, alpha: float, rank: int = 4, dtype: torch.dtype = torch.float64) -> object:
    from mcorekit.models.spec import ModelSpec
    from mcorekit.train.lora import LoraAdapter, adapter_shape

    spec = ModelSpec("llama", 2, 64, 4, 2, 16, 96, 250)
    a = LoraAdapter(adapter_shape(spec, target), rank, alpha, 0.0, 1, 0, False, 2, 16, seed=1, dtype=dtype, device="cpu")
    with torch.no_grad():
        a.lora_b.copy_(torch.randn(a.lora_b.shape, generator=torch.Generator().manual_seed(2), dtype=dtype))
    return a


# scaling 2, exact: folded into qkv's/fc1's block mask; 10/3, not exact in fp32: addmm's alpha for every target
@pytest.mark.parametrize(("alpha", "rank", "dtype", "tol"), [(8.0, 4, torch.float64, 1e-12), (10.0, 3, torch.float32, 1e-5)])
@pytest.mark.parametrize("target", ["qkv", "proj", "fc1", "fc2"])
def test_one_gemm_adapter_equals_block_by_block(target: str, alpha: float, rank: int, dtype: torch.dtype,
                                                tol: float) -> None:
    """B as one masked GEMM added onto the base output = PEFT's blocks (q, k, v / gate, up) applied one by one, in
    value and in the gradients of x, A, B and the base output."""
    import torch.nn.functional as F

    a = _adapter(target, alpha, rank, dtype)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 2, a.shape.in_features, generator=g, dtype=dtype, requires_grad=True)
    base = torch.randn(5, 2, a.lora_b.shape[0], generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(base.shape, generator=g, dtype=dtype)
    results = []
    for fast in (True, False):
        out = a(x, base) if fast else base + a._up(F.linear(x, a.lora_a)) * a.scaling
        grads = torch.autograd.grad((out * w).sum(), [x, base, a.lora_a, a.lora_b])
        results.append([out.detach(), *grads])
    assert a._mask_scaled == (a.shape.parts > 1 and dtype == torch.float64)
    assert all(((f - s).abs().max() <= tol * s.abs().max()).item() for f, s in zip(*results))  # rounding only
    assert torch.allclose(a(x), results[1][0] - base.detach(), rtol=tol, atol=tol)  # the delta alone


@pytest.mark.parametrize("te_return_bias", [False, True])
def test_adapter_input_from_te_norm_output(te_return_bias: bool) -> None:
    """A LayerNormLinear that returns its normalised input (as TE's does with return_layernorm_output, through
    Megatron's wrapper) gives the adapter that input: same result as recomputing the norm (_fused_norm)."""
    from types import SimpleNamespace

    from mcorekit.train import lora

    class FakeTELayerNormLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(layernorm_zero_centered_gamma=False, normalization="RMSNorm",
                                          layernorm_epsilon=1e-5)
            self.layer_norm_weight = torch.nn.Parameter(torch.rand(64, dtype=torch.float64) + 0.5)
            self.weight = torch.nn.Parameter(torch.randn(128, 64, dtype=torch.float64))
            self.return_layernorm_output, self.te_return_bias = False, te_return_bias

        def forward(self, x: torch.Tensor) -> object:
            normed = lora._fused_norm(self, x)
            out = normed @ self.weight.t()
            if self.te_return_bias:
                return (out, None, normed) if self.return_layernorm_output else (out, None)
            return ((out, normed) if self.return_layernorm_output else out), None

    torch.manual_seed(0)
    layer = FakeTELayerNormLinear()
    layer.__class__ = lora._lora_class(FakeTELayerNormLinear)
    layer.add_module(lora.ADAPTER, _adapter("qkv", 8.0))
    x = torch.randn(3, 2, 64, dtype=torch.float64)
    recomputed, bias = layer(x)
    assert lora._te_norm_linear(layer)
    layer.return_layernorm_output = True
    returned, bias2 = layer(x)
    assert bias is None and bias2 is None and torch.allclose(returned, recomputed, rtol=1e-12, atol=1e-12)
    layer.adapter.enabled = False
    assert torch.equal(layer(x)[0], lora._fused_norm(layer, x) @ layer.weight.t())  # adapters off: the base layer


# ---------------------------------------------------------------- the adapter's config against its tensors


def _llama_modules(llama: Path) -> list[str]:
    spec = pipeline.spec_for(json.loads((llama / "config.json").read_text()))
    return sorted(lora.model_modules(spec, pipeline.weight_map(spec)))


@pytest.mark.parametrize("fields", [
    {"target_modules": ["q_proj", "v_proj"]},
    {"target_modules": ["q_proj", "nonexistent"]},
    {"target_modules": ["model.layers.1.self_attn.q_proj", "o_proj"]},
    {"target_modules": r".*\.mlp\..*"},
    {"target_modules": r"model\.layers\.0\.self_attn\.(q|k)_proj"},
    {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [1]},
    {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": 0},
    {"target_modules": ["q_proj", "model.layers.0.mlp.down_proj"], "layers_to_transform": [1]},
    {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": "layers"},
    {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": ["foo", "layers"]},
    {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": "foo"},
    {"target_modules": ["q_proj", "k_proj"], "exclude_modules": ["model.layers.0.self_attn.k_proj"]},
    {"target_modules": ["q_proj", "k_proj"], "exclude_modules": r".*\.0\.self_attn\.q_proj"},
    {"target_modules": ["lm_head", "embed_tokens", "input_layernorm"]},
], ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_the_modules_an_adapter_covers_are_those_peft_adapts(llama: Path, fields: dict) -> None:
    """PEFT's own check_target_module_exists, module by module: target_modules as a list (whole names or suffixes)
    or a regex (full match), layers_to_transform with or without layers_pattern, exclude_modules."""
    import peft
    from peft.tuners.tuners_utils import check_target_module_exists

    config = peft.LoraConfig(r=4, lora_alpha=8, **fields)
    modules = _llama_modules(llama)
    assert "lm_head" in modules and "model.layers.1.input_layernorm" in modules
    assert lora.target_problems(fields) == []
    want = [m for m in modules if bool(check_target_module_exists(config, m))]
    assert [m for m in modules if lora.peft_covers(fields, m)] == want


@pytest.mark.parametrize("fields", [
    {"layers_to_transform": [1]},
    {"target_modules": r"model\.layers\.\d+\.self_attn\.(q|v)_proj"},
    {"exclude_modules": ["model.layers.0.self_attn.k_proj"]},
], ids=["layers_to_transform", "regex", "exclude_modules"])
def test_adapters_peft_writes_with_a_selection_convert_bitwise(llama: Path, tmp_path: Path, fields: dict) -> None:
    """What PEFT adapts under each selection comes back bit-exact; what it does not (a layer it skips, a k it leaves
    out) comes back as zeros only."""
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, **{"target_modules": ["q_proj", "k_proj", "v_proj"], **fields})
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    model.save_pretrained(tmp_path / "peft")
    lora.peft_to_mcore(llama, tmp_path / "peft", tmp_path / "m")
    lora.mcore_to_peft(tmp_path / "m", tmp_path / "back")
    want = load_file(str(tmp_path / "peft/adapter_model.safetensors"))
    got = load_file(str(tmp_path / "back/adapter_model.safetensors"))
    assert want and all(torch.equal(got[k], want[k]) for k in want)
    extra = set(got) - set(want)
    assert extra and all(not got[k].any() for k in extra)


def _edited(adapter: Path, out: Path, drop: str = "", **fields: object) -> Path:
    """A copy of a PEFT adapter without the tensors whose names hold `drop`, its config's fields replaced."""
    import shutil

    shutil.copytree(adapter, out)
    tensors = {k: v for k, v in load_file(str(out / "adapter_model.safetensors")).items() if not drop or drop not in k}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return out


COVERS = "adapter_config.json's target_modules=['q_proj', 'v_proj']"


@pytest.mark.parametrize(("drop", "fields", "where", "line"), [
    ("layers.1.self_attn.q_proj.", {}, "adapter_model.safetensors",
     f"no lora_A/lora_B for model.layers.1.self_attn.q_proj, which {COVERS} covers; the adapter is incomplete, or not "
     f"of this model"),
    ("layers.1.self_attn.q_proj.lora_B", {}, "adapter_model.safetensors",
     "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight has no lora_B partner"),
    ("", {"layers_to_transform": [0]}, "adapter_model.safetensors",
     "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight adapts model.layers.1.self_attn.q_proj, which "
     "adapter_config.json's target_modules=['q_proj', 'v_proj'], layers_to_transform=[0] does not cover (PEFT would "
     "not load it)"),
    ("", {"target_modules": r".*\.v_proj"}, "adapter_model.safetensors",
     "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight adapts model.layers.0.self_attn.q_proj, which "
     "adapter_config.json's target_modules='.*\\\\.v_proj' does not cover"),
    ("", {"target_modules": ["lm_head"]}, "adapter_config.json",
     "target_modules=['lm_head'] covers lm_head, which Megatron LoRA does not adapt"),
    ("", {"target_modules": ["q_proj", "v_proj", "input_layernorm"]}, "adapter_config.json",
     "target_modules=['q_proj', 'v_proj', 'input_layernorm'] covers model.layers.0.input_layernorm (and 1 more), "
     "which Megatron LoRA does not adapt"),
    ("", {"target_modules": ["nonexistent"]}, "adapter_config.json",
     "target_modules=['nonexistent'] covers none of the llama model's attention or MLP projections"),
    ("", {"layers_to_transform": [5], "layers_pattern": "foo"}, "adapter_config.json",
     "target_modules=['q_proj', 'v_proj'], layers_to_transform=[5], layers_pattern='foo' covers none of the llama "
     "model's attention or MLP projections"),
    ("", {"target_modules": r".*\.(q|v)_proj", "layers_to_transform": [0]}, "adapter_config.json",
     "target_modules is a regex, which PEFT takes with neither layers_to_transform nor layers_pattern"),
    ("", {"target_modules": "q_proj("}, "adapter_config.json",
     "target_modules='q_proj(' is not a valid regular expression"),
    ("", {"layers_to_transform": ["0"]}, "adapter_config.json",
     "layers_to_transform=['0'] is neither a layer index nor a list of them"),
], ids=["covered-module-missing", "covered-half-missing", "layer-not-covered", "module-not-covered", "lm_head", "norm",
        "nothing-covered", "no-layer-covered", "regex-and-layers", "bad-regex", "bad-layers"])
def test_adapter_tensors_must_be_what_its_config_covers(llama: Path, tmp_path: Path, drop: str, fields: dict,
                                                        where: str, line: str) -> None:
    """Before: targets came from the tensors alone; a covered module without tensors became zeros, tensors the config
    does not cover were converted, and a config covering nothing or the head passed."""
    targets = {"target_modules": ["q_proj", "v_proj"]}  # in this order (PEFT writes them from a set)
    theirs = _edited(peft_adapter(llama, tmp_path / "peft", ["q_proj", "v_proj"]), tmp_path / "edited", drop,
                     **{**targets, **fields})
    proc = run_cli("hf-to-mcore", str(llama), str(tmp_path / "m"), "--lora", str(theirs))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"mcorekit: error: {theirs / where}: {line}"), proc.stderr
    assert not (tmp_path / "m").exists()


def test_a_null_target_modules_is_peft_default_for_the_family(llama: Path, tmp_path: Path) -> None:
    """PEFT loads a config without target_modules with its default for the model type (q_proj and v_proj for
    Llama): such an adapter imports as the same adapter with the list written out."""
    theirs = peft_adapter(llama, tmp_path / "peft", ["q_proj", "v_proj"])
    listed = _edited(theirs, tmp_path / "listed", "", target_modules=["q_proj", "v_proj"])
    null = _edited(theirs, tmp_path / "null", "", target_modules=None)
    for name, adapter in (("a", listed), ("b", null)):
        proc = run_cli("hf-to-mcore", str(llama), str(tmp_path / name), "--lora", str(adapter))
        assert proc.returncode == 0, proc.stderr
    from mcorekit.convert.torch_dist import TorchDistReader

    a, b = TorchDistReader(tmp_path / "a/release"), TorchDistReader(tmp_path / "b/release")
    assert a.tensor_keys().keys() == b.tensor_keys().keys()
    assert all(torch.equal(a.read(k), b.read(k)) for k in a.tensor_keys())


def test_adapter_of_a_model_with_fewer_layers_is_refused(llama: Path, tmp_path: Path) -> None:
    """A 2-layer model's adapter onto a 4-layer base of the same shapes: its layers 2 and 3 were zeros."""
    deeper = tmp_path / "hf4"
    transformers.AutoModelForCausalLM.from_config(type(CONFIGS["llama"](False))(**COMMON)).save_pretrained(deeper)
    theirs = peft_adapter(llama, tmp_path / "peft", ALL)
    proc = run_cli("hf-to-mcore", str(deeper), str(tmp_path / "m"), "--lora", str(theirs))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "no lora_A/lora_B for model.layers.2.self_attn.q_proj" in proc.stderr, proc.stderr
    assert f"not of this model ({deeper / 'config.json'}: 4 layers)" in proc.stderr, proc.stderr
    assert not (tmp_path / "m").exists()
