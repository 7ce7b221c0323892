"""Checks the converter lacked before `fb5ca9c`: inputs reached through a symlink inside a checkpoint,
checkpoints that disagree with the HF config in what their tensor shapes do not show (per-layer key counts and
dtypes, a tied config over a head of its own, the attention head layout), layouts that do not split a DeepSeek
dense MLP, and counts that exhausted memory. Each bad input is one `mcorekit: error:` line and exit 2 with the
inputs unchanged. CPU only; tiny models built here with real transformers."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import transformers

from hf_models import DEEPSEEK_V3, make_family_model, make_model
from mcorekit.convert import hf_io, torch_dist
from mcorekit.convert.torch_dist import TorchDistReader
from mcorekit.models import registry
from mcorekit.models.parallel import Layout, layout_problems
from mcorekit.models.spec import from_hf_config
from test_faults_convert import assert_one_error, convert, copy, edit_json, expect_error, tree_digest, verify_cli


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Read-only originals: llama as torch_dist ("ckpt") and legacy ("legacy"), DeepSeek-V3 as torch_dist, which
    stores its layers one key per layer ("ds_ckpt")."""
    root = tmp_path_factory.mktemp("checks")
    paths = {"llama": make_model("llama", False, root / "llama"), "ds": make_family_model("deepseek_v3", root / "ds")}
    for name, src, args in (("ckpt", "llama", []), ("legacy", "llama", ["--format", "torch"]), ("ds_ckpt", "ds", [])):
        rc, err = convert("hf-to-mcore", str(paths[src]), str(root / name), *args)
        assert rc == 0, err
        paths[name] = root / name
    return paths


def config_dir(src: Path, where: Path, **change: Any) -> Path:
    """A folder holding src's config.json with `change` applied (an --hf-config)."""
    where.mkdir()
    config = json.loads((src / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**config, **change}))
    return where


# ---------------------------------------------------------------- 1. --force never deletes a linked input


@pytest.mark.parametrize("ckpt_name, linked", [("legacy", "mp_rank_00"), ("ckpt", ".metadata"),
                                               ("ckpt", "metadata.json")])
def test_force_never_replaces_an_input_linked_into_the_checkpoint(made, tmp_path: Path, ckpt_name: str,
                                                                   linked: str) -> None:
    """A rank folder or metadata file linked into an earlier output: `mcore-to-hf CKPT EARLIER --force` read it, but
    did not count it as an input, and replaced EARLIER (exit 0), leaving CKPT's link dangling."""
    earlier = copy(made[ckpt_name], tmp_path / "earlier")  # an earlier mcorekit output: --force may replace it
    ckpt = copy(made[ckpt_name], tmp_path / "ckpt")
    inside = ckpt / "release" / linked
    if inside.is_dir():
        for f in inside.iterdir():
            f.unlink()
        inside.rmdir()
    else:
        inside.unlink()
    inside.symlink_to(earlier / "release" / linked)
    before = [tree_digest(earlier), tree_digest(ckpt)]
    rc, err = convert("mcore-to-hf", str(ckpt), str(earlier), "--force")
    assert_one_error(rc, err, f"resolves to {(earlier / 'release' / linked).resolve()}")
    assert f"outside {ckpt / 'release'}; only files inside the model folder are read" in err
    assert [tree_digest(earlier), tree_digest(ckpt)] == before


def test_a_link_that_stays_inside_the_checkpoint_is_read(made, tmp_path: Path) -> None:
    ckpt = copy(made["ckpt"], tmp_path / "ckpt")
    (ckpt / "release/.metadata").rename(ckpt / "release/metadata.pickle")
    (ckpt / "release/.metadata").symlink_to("metadata.pickle")
    rc, err = convert("mcore-to-hf", str(ckpt), str(tmp_path / "back"))
    assert rc == 0, err
    assert verify_cli(made["llama"], tmp_path / "back")[0] == 0


# ---------------------------------------------------------------- 2, 8. one key per layer: every layer checked


@pytest.mark.parametrize("change, needle", [
    (dict(num_hidden_layers=3), "num_hidden_layers 3 in the config, 4 in the checkpoint; decoder.layers.input_layernorm"
                                ".weight is stored for layers 0, 1, 2, 3, the config implies layers 0, 1, 2"),
    (dict(first_k_dense_replace=2), "decoder.layers.mlp.linear_fc1.weight is stored for layers 0, the config implies "
                                    "layers 0, 1"),
], ids=["fewer-layers", "more-dense-layers"])
def test_per_layer_checkpoint_that_disagrees_with_the_config(made, tmp_path: Path, change: dict, needle: str) -> None:
    """DeepSeek's checkpoint (one key per layer) read with a config of 3 layers wrote a 3-layer model, exit 0: the
    stacked view took its layer count from the config."""
    cfg = config_dir(made["ds"], tmp_path / "cfg", **change)
    expect_error(["mcore-to-hf", str(made["ds_ckpt"]), str(tmp_path / "out"), "--hf-config", str(cfg)],
                 tmp_path / "out", [made["ds_ckpt"], cfg], needle)


def rewrite_torch_dist(ckpt: Path, change: dict[str, Callable[[torch.Tensor], torch.Tensor]]) -> None:
    """Write ckpt/release again with some tensors changed (really stored so, not only claimed in .metadata); bytes
    entries are left out (mcore-to-hf reads none)."""
    release = ckpt / "release"
    reader = TorchDistReader(release)
    tensors = {key: reader.read(key) for key in reader.tensor_keys()}
    tensors.update({key: f(tensors[key]) for key, f in change.items()})
    for f in release.iterdir():
        f.unlink()
    release.rmdir()
    planned = [torch_dist.PlannedTensor(key, tuple(t.shape), t.dtype, [torch_dist.ChunkSource(
        (0,) * t.dim(), tuple(t.shape), lambda t=t: t)]) for key, t in tensors.items()]
    torch_dist.write(release, planned, {})


def test_every_layer_of_a_per_layer_key_is_checked(made, tmp_path: Path) -> None:
    """Only the last layer's dtype was checked: an int32 layer 0 came out as bf16, exit 0."""
    ckpt = copy(made["ds_ckpt"], tmp_path / "ckpt")
    key = "decoder.layers.0.self_attention.linear_proj.weight"
    rewrite_torch_dist(ckpt, {key: lambda t: t.to(torch.int32)})
    err = expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt],
                       "the layers of one tensor are stored alike, so the checkpoint is damaged")
    assert f"{key} is torch.int32 (64, 64)" in err and "is torch.bfloat16 (64, 64)" in err, err


def test_a_rewritten_per_layer_checkpoint_still_converts(made, tmp_path: Path) -> None:
    """The rewrite above changes nothing else: unchanged, it converts back bit for bit."""
    ckpt = copy(made["ds_ckpt"], tmp_path / "ckpt")
    rewrite_torch_dist(ckpt, {})
    rc, err = convert("mcore-to-hf", str(ckpt), str(tmp_path / "back"))
    assert rc == 0, err
    assert verify_cli(made["ds"], tmp_path / "back")[0] == 0


# ---------------------------------------------------------------- 3. a tied config over a legacy head of its own


def test_legacy_head_of_its_own_under_a_tied_config(made, tmp_path: Path) -> None:
    """The legacy reader dropped the stored output layer unchecked (exit 0, the trained head lost); torch_dist
    refuses the same."""
    cfg = config_dir(made["llama"], tmp_path / "cfg", tie_word_embeddings=True)
    needle = "unexpected ['output_layer.weight'] (wrong --hf-config, or tied embeddings differ?)"
    for name in ("legacy", "ckpt"):
        expect_error(["mcore-to-hf", str(made[name]), str(tmp_path / "out"), "--hf-config", str(cfg)],
                     tmp_path / "out", [made[name], cfg], needle)


def test_legacy_tied_copy_on_the_last_stage(tmp_path: Path) -> None:
    """With PP > 1 Megatron keeps a copy of a tied embedding as the last stage's output layer: bit-identical it is
    dropped (nothing lost), changed in one element it is a head of its own and refused."""
    hf = make_model("llama", True, tmp_path / "tied")
    rc, err = convert("hf-to-mcore", str(hf), str(tmp_path / "ckpt"), "--format", "torch", "--pp", "2", "--tp", "2")
    assert rc == 0, err
    rc, err = convert("mcore-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert rc == 0, err
    assert verify_cli(hf, tmp_path / "back")[0] == 0
    last = tmp_path / "ckpt/release/mp_rank_01_001/model_optim_rng.pt"
    state = torch.load(last, weights_only=True)
    state["model"]["output_layer.weight"][0, 0] += 1
    torch.save(state, last)
    expect_error(["mcore-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")], tmp_path / "out",
                 [tmp_path / "ckpt"], "unexpected ['output_layer.weight']")


# ---------------------------------------------------------------- 4. the head layout the shapes do not show


@pytest.mark.parametrize("ckpt_name", ["ckpt", "legacy"])
def test_head_layout_recorded_at_import(made, tmp_path: Path, ckpt_name: str) -> None:
    """8 heads of 8 with 4 KV heads give q/k/v the shapes of 4 heads of 16 with 2: regrouped wrongly, exit 0."""
    cfg = config_dir(made["llama"], tmp_path / "cfg", num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    expect_error(["mcore-to-hf", str(made[ckpt_name]), str(tmp_path / "out"), "--hf-config", str(cfg)],
                 tmp_path / "out", [made[ckpt_name], cfg],
                 "disagree: num_attention_heads 8 in the config, 4 in the checkpoint (mcorekit.json); "
                 "num_key_value_heads 4 in the config, 2 in the checkpoint (mcorekit.json); head_dim 8 in the config, "
                 "16 in the checkpoint (mcorekit.json); pass the --hf-config it was converted from")


# ---------------------------------------------------------------- 5. DeepSeek's dense layers split over TP


@pytest.fixture(scope="module")
def ds126(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3-tiny whose dense layer's MLP (intermediate_size) is 126: TP 4 does not split it."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**DEEPSEEK_V3, "intermediate_size": 126})
    out = tmp_path_factory.mktemp("ds126") / "hf"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    return out


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_deepseek_dense_mlp_must_split_over_tp(ds126, tmp_path: Path, fmt: str) -> None:
    """Only a dense model's FFN was checked against TP: uneven rank parts, exit 0, and mcore-to-hf then failed."""
    expect_error(["hf-to-mcore", str(ds126), str(tmp_path / "out"), "--format", fmt, "--tp", "4"], tmp_path / "out",
                 [ds126], "TP=4 does not divide ffn_hidden_size=126 (the dense layers of the MoE model)")
    spec = from_hf_config(json.loads((ds126 / "config.json").read_text()))
    assert layout_problems(spec, Layout(tp=2)) == []


# ---------------------------------------------------------------- 6, 7. counts that exhausted memory


def run_limited(*args: str) -> subprocess.CompletedProcess[str]:
    """The real CLI in a fresh process with 6 GiB of address space: a map listing a billion layers fails there with a
    MemoryError traceback, instead of taking this machine's memory."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 * 1024**3, 6 * 1024**3))
    return subprocess.run([sys.executable, "-m", "mcorekit", "convert", *args, "--quiet"], capture_output=True,
                          text=True, timeout=300, preexec_fn=limit)


def test_a_billion_deepseek_layers_fail_before_any_map_is_built(made, tmp_path: Path) -> None:
    hf = copy(made["ds"], tmp_path / "hf")
    edit_json(hf / "config.json", lambda c: c.update(num_hidden_layers=10**9))
    done = run_limited("hf-to-mcore", str(hf), str(tmp_path / "out"))
    assert_one_error(done.returncode, done.stderr,
                     "num_hidden_layers=1000000000, but the weights hold layers 0, 1, 2, 3; the config disagrees")


def test_a_billion_mtp_layers_are_refused(made, tmp_path: Path) -> None:
    cfg = config_dir(made["ds"], tmp_path / "cfg", num_nextn_predict_layers=10**9)
    done = run_limited("mcore-to-hf", str(made["ds_ckpt"]), str(tmp_path / "out"), "--hf-config", str(cfg))
    assert_one_error(done.returncode, done.stderr, "num_nextn_predict_layers=1000000000 must be an integer from 0 to "
                     "64 (the multi-token-prediction layers; DeepSeek-V3 has 1)")


@pytest.mark.parametrize("value", [-1, 65, "1", 1.0, True])
def test_mtp_layer_count_must_be_a_small_integer(made, value: object) -> None:
    config = json.loads((made["ds"] / "config.json").read_text())
    assert registry.config_problems({**config, "num_nextn_predict_layers": 64}) == []
    assert registry.config_problems({**config, "num_nextn_predict_layers": value}) == [
        f"num_nextn_predict_layers={value!r} must be an integer from 0 to 64 (the multi-token-prediction layers; "
        f"DeepSeek-V3 has 1)"]


# ---------------------------------------------------------------- 9. safetensors headers, in all


def test_shards_listing_more_tensors_than_any_model(made, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each header is bounded (100 MB), their number only by the index: a total bound too."""
    monkeypatch.setattr(hf_io, "MAX_TENSORS", 20)
    expect_error(["hf-to-mcore", str(made["llama"]), str(tmp_path / "out")], tmp_path / "out", [made["llama"]],
                 f"{made['llama']}: its shards list more than 20 tensors, more than any model has")
