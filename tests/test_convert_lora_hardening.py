"""LoRA conversion (convert/lora.py) and verify --logits' checkpoint check (convert/logits.py) against bad input: an
output never replaces a folder the command reads (--force included); bad rank, alpha or dropout values, a full disk
and PEFT's activated LoRA are one `mcorekit: error:` line, exit 2, nothing written; a crafted TE extra state or
common.pt is refused before any loader could unpickle it. CPU; the tiny bf16 Llama of the audit that found them."""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import subprocess
import sys
from io import BytesIO
from pathlib import Path
from typing import Any

import megatron.core.safe_globals  # noqa: F401  # imported before te_recipe's TE stand-in, which its import trips on
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mcorekit import cli
from mcorekit.convert import lora, pipeline, torch_dist
from mcorekit.convert.logits import checked_checkpoint
from mcorekit.errors import MCoreKitError
from test_checkpoint_reader import _te_extra_state, te_recipe  # noqa: F401  # the fixture applies here too
from test_faults_convert import Evil, assert_nothing_at, assert_one_error, convert, copy, tree_digest


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Read-only originals: the HF model, a PEFT adapter of its attention, its Megatron checkpoint, that checkpoint
    back in HF (an mcorekit output, so --force may replace it) and the adapter as a Megatron LoRA checkpoint."""
    import peft

    root = tmp_path_factory.mktemp("lora_hardening")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(root / "llama")
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj",
                                                                                            "v_proj", "o_proj"]))
    adapted.save_pretrained(root / "adapter")
    pipeline.hf_to_mcore(root / "llama", root / "ck", quiet=True)
    pipeline.mcore_to_hf(root / "ck", root / "hf_model", quiet=True)
    lora.peft_to_mcore(root / "llama", root / "adapter", root / "lora_ck")
    return {name: root / name for name in ("llama", "adapter", "ck", "hf_model", "lora_ck")}


def edit_json(file: Path, **fields: Any) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **fields}))  # json writes inf as Infinity


def refused(args: list[str], out: Path, inputs: list[Path], line: str) -> None:
    """Exactly `mcorekit: error: LINE`, exit 2, nothing at `out`, every input byte for byte as it was."""
    before = [tree_digest(p) for p in inputs]
    rc, err = convert(*args)
    assert_one_error(rc, err, line)
    assert err.strip() == f"mcorekit: error: {line}", err
    if out not in inputs:  # an input named as the output is still there: its bytes are checked below
        assert_nothing_at(out)
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "a staged folder is left"
    assert [tree_digest(p) for p in inputs] == before, "an input changed"


def overlap(out: Path, given: Path | None = None) -> str:
    return (f"output {out.resolve()} overlaps the input {(given or out).resolve()} (the same folder, inside it, or "
            f"containing it); write somewhere else (--force never replaces an input)")


# ---------------------------------------------------------------- 1. --force never replaces what the command reads


def test_lora_export_never_replaces_the_hf_config_folder(made: dict[str, Path], tmp_path: Path) -> None:
    """--hf-config names an earlier mcore-to-hf output: --lora --force into it replaced it with the adapter."""
    hf, ck = copy(made["hf_model"], tmp_path / "hf_model"), copy(made["lora_ck"], tmp_path / "lora_ck")
    refused(["mcore-to-hf", str(ck), str(hf), "--lora", "--hf-config", str(hf), "--force"], hf, [hf, ck], overlap(hf))
    refused(["mcore-to-hf", str(ck), str(hf), "--merge", "--base", str(made["ck"]), "--hf-config", str(hf),
             "--force"], hf, [hf, ck], overlap(hf))


@pytest.mark.parametrize("how", ["--lora", "--merge"])
def test_lora_export_never_replaces_the_base_its_config_comes_from(made: dict[str, Path], tmp_path: Path,
                                                                   how: str) -> None:
    """lora.json's base names the base checkpoint, whose hf/config.json is the adapter's config: replaced too."""
    base, ck = copy(made["ck"], tmp_path / "base"), copy(made["lora_ck"], tmp_path / "lora_ck")
    for p in sorted((ck / "hf").iterdir()):
        p.unlink()
    (ck / "hf").rmdir()
    edit_json(ck / "release/lora.json", base=str(base))
    refused(["mcore-to-hf", str(ck), str(base), how, "--force"], base, [base, ck], overlap(base, base / "hf"))


def test_lora_import_never_replaces_its_inputs(made: dict[str, Path], tmp_path: Path) -> None:
    hf, adapter = copy(made["llama"], tmp_path / "llama"), copy(made["adapter"], tmp_path / "adapter")
    for out in (hf, adapter):
        refused(["hf-to-mcore", str(hf), str(out), "--lora", str(adapter), "--force"], out, [hf, adapter], overlap(out))


# ---------------------------------------------------------------- 3. and 5. adapter values: one line naming the field


@pytest.mark.parametrize(("fields", "problem"), [
    ({"lora_dropout": "abc"}, "lora_dropout='abc' is not a number from 0 to below 1"),
    ({"lora_dropout": 1.0}, "lora_dropout=1.0 is not a number from 0 to below 1"),
    ({"lora_dropout": True}, "lora_dropout=True is not a number from 0 to below 1"),
    ({"r": 4611686018427387904}, "r=4611686018427387904 is not a positive integer at most 128 (the largest dimension "
                                 "of the weights it adapts)"),
    ({"r": 129}, "r=129 is not a positive integer at most 128 (the largest dimension of the weights it adapts)"),
    ({"r": True}, "r=True is not a positive integer at most 128 (the largest dimension of the weights it adapts)"),
    ({"lora_alpha": float("inf")}, "lora_alpha=inf is not a finite positive number"),
    ({"lora_alpha": float("nan")}, "lora_alpha=nan is not a finite positive number"),
    ({"lora_alpha": True}, "lora_alpha=True is not a finite positive number"),
    ({"lora_alpha": 10**400}, f"lora_alpha={10**400!r} is not a finite positive number"),
    ({"alora_invocation_tokens": [1, 2, 3]}, "alora_invocation_tokens=[1, 2, 3] has no Megatron LoRA counterpart "
                                             "(supported: None)"),
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4' changes the base weights too, so "
                                             "these adapters do not apply to the HF model; save them with PEFT's "
                                             "path_initial_model_for_weight_conversion (plain LoRA) first"),
], ids=["dropout-str", "dropout-1", "dropout-bool", "r-huge", "r-129", "r-bool", "alpha-inf", "alpha-nan",
        "alpha-bool", "alpha-huge-int", "alora", "pissa"])
def test_bad_peft_values_are_one_line(made: dict[str, Path], tmp_path: Path, fields: dict, problem: str) -> None:
    adapter = copy(made["adapter"], tmp_path / "adapter")
    edit_json(adapter / "adapter_config.json", **fields)
    out = tmp_path / "out"
    refused(["hf-to-mcore", str(made["llama"]), str(out), "--lora", str(adapter)], out, [adapter, made["llama"]],
            f"{adapter / 'adapter_config.json'}: {problem}")


@pytest.mark.parametrize(("fields", "problem"), [
    ({"dropout": "abc"}, "dropout='abc' is not a number from 0 to below 1"),
    ({"alpha": float("inf")}, "alpha=inf is not a finite positive number"),
    ({"alpha": True}, "alpha=True is not a finite positive number"),
    ({"rank": 2**62}, f"rank={2**62} is not a positive integer at most 128 (the largest dimension of the weights it "
                      f"adapts)"),
    ({"target_modules": [{}]}, "target_modules=[{}] is not a list of qkv, proj, fc1, fc2"),
], ids=["dropout", "alpha-inf", "alpha-bool", "rank-huge", "targets-unhashable"])
@pytest.mark.parametrize("how", ["--lora", "--merge"])
def test_bad_lora_json_values_are_one_line(made: dict[str, Path], tmp_path: Path, fields: dict, problem: str,
                                           how: str) -> None:
    """Before: dropout a traceback; alpha Infinity a merged model of non-finite weights, exit 0."""
    ck = copy(made["lora_ck"], tmp_path / "lora_ck")
    edit_json(ck / "release/lora.json", **fields)
    out = tmp_path / "out"
    base = ["--base", str(made["ck"])] if how == "--merge" else []
    refused(["mcore-to-hf", str(ck), str(out), how, *base], out, [ck, made["ck"]],
            f"{ck / 'release/lora.json'}: {problem}")


def test_good_values_still_convert(made: dict[str, Path], tmp_path: Path) -> None:
    """The bound and the checks let real adapters through: the largest meaningful rank, dropout and alpha as PEFT
    writes them (an int alpha, dropout 0.1)."""
    assert lora.peft_config_problems({"peft_type": "LORA", "r": 64, "lora_alpha": 16, "lora_dropout": 0.1}, 64) == []
    adapter = copy(made["adapter"], tmp_path / "adapter")
    edit_json(adapter / "adapter_config.json", lora_dropout=0.1, lora_alpha=16)
    assert convert("hf-to-mcore", str(made["llama"]), str(tmp_path / "m"), "--lora", str(adapter))[0] == 0
    info = json.loads((tmp_path / "m/release/lora.json").read_text())
    assert (info["rank"], info["alpha"], info["dropout"]) == (4, 16.0, 0.1)
    rc, err = convert("mcore-to-hf", str(tmp_path / "m"), str(tmp_path / "back"), "--lora")
    assert rc == 0, err
    back = json.loads((tmp_path / "back/adapter_config.json").read_text())
    assert (back["r"], back["lora_alpha"], back["lora_dropout"]) == (4, 16.0, 0.1)


# ---------------------------------------------------------------- 4. a full disk


def test_a_full_disk_is_one_line(made: dict[str, Path], tmp_path: Path) -> None:
    """A file size limit of 8 KiB (`ulimit -f 8`; Python ignores SIGXFSZ, so the write fails with EFBIG as on a full
    disk): safetensors' own error type was a traceback. In a fresh process, as the limit is the process's."""
    ck, out = copy(made["lora_ck"], tmp_path / "lora_ck"), tmp_path / "out"
    before = tree_digest(ck)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    # a bytecode cache of its own: under the limit the .pyc files it writes come out cut short (Python does not check
    # its short writes), and every later process reading them from the shared cache (caches.py) would fail
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}
    proc = subprocess.run([sys.executable, "-B", "-m", "mcorekit", "convert", "mcore-to-hf", str(ck), str(out),
                           "--lora", "--quiet"], capture_output=True, text=True, timeout=300, preexec_fn=limit, env=env)
    assert_one_error(proc.returncode, proc.stderr, f"mcorekit: error: cannot write {out}: ")
    assert proc.stderr.strip().endswith("File too large (os error 27); nothing was written there"), proc.stderr
    assert_nothing_at(out)
    assert tree_digest(ck) == before


# ---------------------------------------------------------------- 2. verify --logits: nothing of the checkpoint runs


def _checkpoint(path: Path, blobs: dict[str, bytes]) -> Path:
    torch_dist.write(path / "release", [], {"common_state/shard_0_1": torch_dist.common_state(), **blobs})
    (path / "latest_checkpointed_iteration.txt").write_text("release")
    return path


def _saved(obj: object) -> bytes:
    buf = BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


EXTRA = torch_dist.extra_state_key("decoder.layers.self_attention.linear_qkv", 0, 2)


def test_verify_logits_refuses_a_crafted_te_extra_state(made: dict[str, Path], tmp_path: Path, te_recipe: Any) -> None:
    """TE unpickles its extra state's bytes with pickle.loads (set_extra_state): the record loads weights-only (a
    list of a uint8 tensor), so only a look inside it finds the call. Refused before the GPU is asked for."""
    marker = tmp_path / "MARKER"
    fp8 = _te_extra_state({"recipe": te_recipe.DelayedScaling(), "scale_fwd": torch.ones(3)})
    checked_checkpoint(_checkpoint(tmp_path / "fp8", {EXTRA: _saved(fp8)}))  # what TE writes passes
    ck = _checkpoint(tmp_path / "ck", {EXTRA: _saved(_te_extra_state({"recipe": Evil(marker)}))})
    line = (f"checkpoint {ck / 'release'}: record {EXTRA} asks to run posix.system when it is "
            f"unpickled: refusing to load it (a checkpoint from an untrusted source goes through `mcorekit convert`, "
            f"which runs nothing of it)")
    refused(["verify", "--logits", str(made["llama"]), str(ck)], tmp_path / "none", [ck], line)
    assert not marker.exists()


def test_verify_logits_refuses_a_crafted_common_pt(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    ck = _checkpoint(tmp_path / "ck", {EXTRA: torch_dist.empty_extra_state()})
    checked_checkpoint(ck)
    (ck / "release/common.pt").write_bytes(_saved({"args": Evil(marker)}))
    with pytest.raises(MCoreKitError, match=rf"^checkpoint {ck / 'release'}: common.pt asks to run posix.system "):
        checked_checkpoint(ck)
    assert not marker.exists()


# ---------------------------------------------------------------- options an adapter has no use for


@pytest.mark.parametrize(("options", "given"), [
    ("--format torch", "--format torch"), ("--tp 3", "--tp 3"), ("--pp 2", "--pp 2"), ("--ep 5", "--ep 5"),
    ("--etp 2", "--etp 2"), ("--vpp 7", "--vpp 7"), ("--vocab-divisible-by 64", "--vocab-divisible-by 64"),
    ("--format torch --tp 3 --vpp 7 --ep 5", "--format torch --tp 3 --ep 5 --vpp 7"),
], ids=["format", "tp", "pp", "ep", "etp", "vpp", "vocab", "several"])
def test_lora_import_refuses_options_of_a_model_conversion(made: dict[str, Path], tmp_path: Path, options: str,
                                                           given: str) -> None:
    """Before: ignored, exit 0, a torch_dist checkpoint written whatever --format and the sizes said."""
    out = tmp_path / "out"
    line = (f"{given}: --lora writes the adapter as a torch_dist checkpoint, which loads at any layout; drop "
            f"{'them' if ' --' in given else 'it'} (they apply to converting a model)")
    refused(["hf-to-mcore", str(made["llama"]), str(out), "--lora", str(made["adapter"]), *options.split()], out,
            [made["llama"], made["adapter"]], line)


# ---------------------------------------------------------------- non-finite adapters and merges


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_peft_adapter_is_refused(made: dict[str, Path], tmp_path: Path, value: float) -> None:
    adapter = copy(made["adapter"], tmp_path / "adapter")
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[name][3, 1] = value
    save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    refused(["hf-to-mcore", str(made["llama"]), str(out), "--lora", str(adapter)], out, [adapter, made["llama"]],
            f"{adapter / 'adapter_model.safetensors'}: {name} holds NaN or infinite values, which no trained adapter "
            f"has; the file is damaged: save the adapter again")


def lora_ck_with(made: dict[str, Path], dst: Path, value: float) -> Path:
    """The adapter checkpoint with `value` in layer 1's qkv lora_b (its first row: q_proj's), written again as
    peft_to_mcore writes it (the import itself now refuses a non-finite adapter)."""
    ck = copy(made["lora_ck"], dst)
    reader = torch_dist.TorchDistReader(ck / "release")
    tensors = {k: reader.read(k) for k in reader.tensor_keys()}
    tensors["decoder.layers.self_attention.linear_qkv.adapter.lora_b"][1, 0, 0] = value
    info = (ck / "release/lora.json").read_text()
    shutil.rmtree(ck / "release")
    planned = [lora._planned(k, dict(enumerate(t)), t.shape[0]) for k, t in tensors.items()]
    torch_dist.write(ck / "release", planned, {"common_state/shard_0_1": torch_dist.common_state()})
    (ck / "release/lora.json").write_text(info)
    return ck


@pytest.mark.parametrize("case", ["nan", "fp16-overflow"])
def test_merge_refuses_non_finite_weights(made: dict[str, Path], tmp_path: Path, case: str) -> None:
    """Before: NaN (or, into an fp16 base, a sum beyond 65504: inf) merged weights, exit 0. A is random and B zero
    but for the planted value, so the merged q_proj of layer 1 is the first weight it spoils."""
    if case == "nan":
        ck, base = lora_ck_with(made, tmp_path / "lora_ck", float("nan")), made["ck"]
        why = "is not finite: the adapter (or the base) holds NaN or infinite values; nothing was written"
    else:
        ck, base = lora_ck_with(made, tmp_path / "lora_ck", 1e6), tmp_path / "base16"
        pipeline.hf_to_mcore(made["llama"], base, dtype="fp16", quiet=True)
        why = "exceeds the range of torch.float16 (up to "
    out = tmp_path / "out"
    before = [tree_digest(p) for p in (ck, base)]
    rc, err = convert("mcore-to-hf", str(ck), str(out), "--merge", "--base", str(base))
    assert_one_error(rc, err, f"mcorekit: error: merging {ck / 'release'} into model.layers.1.self_attn.q_proj.weight: "
                              f"W + alpha/r * B @ A {why}")
    assert_nothing_at(out)
    assert [tree_digest(p) for p in (ck, base)] == before
    rc, err = convert("mcore-to-hf", str(made["lora_ck"]), str(tmp_path / "good"), "--merge", "--base", str(base))
    assert rc == 0, err  # the checkpoint it was made from merges


# ---------------------------------------------------------------- a LoRA checkpoint where a model is expected


def test_lora_checkpoint_given_as_a_model_says_to_merge_it(made: dict[str, Path], tmp_path: Path) -> None:
    """Before: "checkpoint and config.json disagree: missing [...], unexpected [...adapter.lora_a...]"."""
    ck, out = made["lora_ck"], tmp_path / "out"
    merge = (f"{ck} is a LoRA adapter checkpoint ({ck / 'release/lora.json'}), not a model: merge it into its base "
             f"with `mcorekit convert mcore-to-hf {ck} OUT --merge --base BASE_CKPT`")
    refused(["mcore-to-hf", str(ck), str(out)], out, [ck], f"{merge} (or write it as a PEFT adapter with --lora)")
    with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["export", "trtllm", str(ck), str(out), "--target", "pytorch", "--quiet"])
    assert rc == 2 and err.getvalue() == f"mcorekit: error: {merge}, then export OUT\n", err.getvalue()
    assert_nothing_at(out)
