"""Crafted checkpoints and configs that reached a traceback or unbounded memory in the readers (audit 2026-12-05):
a .metadata claiming a huge tensor, sizes beyond int64 in config.json, .metadata and safetensors headers, control
characters in file names, legacy rank files with odd keys or shapes, num_experts_per_tok beyond the experts, and a
newline in a path splitting the error line. Each is one `mcorekit: error:` line and exit 2, before any large
allocation. CPU only; tiny models built here."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_models import CONFIGS, FAMILY_CONFIGS, make_model
from mcorekit import cli
from mcorekit.convert import torch_dist
from mcorekit.convert.torch_dist import TorchDistReader, load_metadata
from mcorekit.errors import ConversionError, one_line
from mcorekit.models import registry
from test_faults_convert import INDEX, convert, copy, edit_header, edit_json, expect_error, rank_file

EMBEDDING = "embedding.word_embeddings.weight"
PROJ = "decoder.layers.self_attention.linear_proj.weight"
ROWS = 256  # the embedding rows stored: the vocabulary of 250, padded to a multiple of 128


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Read-only originals: an untied and a tied llama, the tied one as torch_dist, the untied one as legacy TP 2."""
    root = tmp_path_factory.mktemp("hardening")
    paths = {"llama": make_model("llama", False, root / "llama"), "tied": make_model("llama", True, root / "tied")}
    for name, src, args in (("tck", "tied", []), ("lck", "llama", ["--format", "torch", "--tp", "2"])):
        rc, err = convert("hf-to-mcore", str(paths[src]), str(root / name), *args)
        assert rc == 0, err
        paths[name] = root / name
    return paths


def edit_metadata(ckpt: Path, change: Any) -> None:
    """Change the unpickled .metadata of ckpt/release in place."""
    file = ckpt / "release/.metadata"
    md = load_metadata(file)
    change(md)
    file.write_bytes(pickle.dumps(md))


def claim_rows(rows: int, as_tuple: bool = False) -> Any:
    """A change that makes .metadata claim `rows` embedding rows (a plain tuple: torch.Size cannot hold 2**63)."""
    def change(md: Any) -> None:
        md.state_dict_metadata[EMBEDDING].size = (rows, 64) if as_tuple else torch.Size((rows, 64))
    return change


def run_measured(*args: str) -> tuple[int, str, int]:
    """`mcorekit convert ARGS` in a fresh process: (exit code, stderr, that process's own peak RSS in bytes)."""
    proc = subprocess.Popen([sys.executable, "-m", "mcorekit", "convert", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    err = proc.stderr.read()
    proc.stderr.close()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's rusage, not every child's
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, err, usage.ru_maxrss * 1024


# ---------------------------------------------------------------- 1. a .metadata claiming a huge tensor


def test_metadata_claiming_a_huge_tensor_fails_at_once_in_bounded_memory(made, tmp_path: Path) -> None:
    """2**22 rows claimed on a checkpoint of kilobytes: the coverage check allocated a mask of the claimed size
    and summed it as int64 (2.5 GB here; 11 GB at 2**24) before its one-line error."""
    rc, err, baseline = run_measured("mcore-to-hf", str(made["tck"]), str(tmp_path / "ok"), "--quiet")
    assert rc == 0, err
    ckpt = copy(made["tck"], tmp_path / "ckpt")
    edit_metadata(ckpt, claim_rows(2**22))
    start = time.monotonic()
    rc, err, peak = run_measured("mcore-to-hf", str(ckpt), str(tmp_path / "out"), "--quiet")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert peak < baseline + 256 * 1024**2, (peak, baseline)
    assert err.startswith(f"mcorekit: error: {ckpt}/release/.metadata: the stored chunks of '{EMBEDDING}' do not "
                          f"cover slice () (at least {2**22 * 64 - ROWS * 64} of its {2**22 * 64} elements missing)")
    assert time.monotonic() - start < 60
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rows, as_tuple, needle", [
    (2**36, False, f"do not cover slice () (at least {2**36 * 64 - ROWS * 64} of its {2**36 * 64} elements missing)"),
    (2**62, True, f"claims size ({2**62}, 64) of torch.bfloat16, more than {2**63 - 1} bytes"),
    (2**70, True, f"tensor '{EMBEDDING}' has a bad size, dtype or chunk list"),
], ids=["2**36-rows", "2**62-rows", "2**70-rows"])
def test_metadata_claiming_more_than_torch_can_allocate(made, tmp_path: Path, rows: int, as_tuple: bool,
                                                        needle: str) -> None:
    """2**36 rows: torch's allocation failed with a traceback; 2**70: torch.empty failed to unpack the size."""
    ckpt = copy(made["tck"], tmp_path / "ckpt")
    edit_metadata(ckpt, claim_rows(rows, as_tuple))
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt], needle)


def test_overlapping_chunks_cannot_hide_a_hole(made, tmp_path: Path) -> None:
    """Four chunks of four layers' elements, two at the same layer: as many elements as the tensor, one layer
    missing."""
    ckpt = copy(made["tck"], tmp_path / "ckpt")

    def overlap(md: Any) -> None:
        chunks = md.state_dict_metadata[PROJ].chunks
        chunks[2].offsets = chunks[1].offsets  # layer 2's chunk moved onto layer 1 (whose storage it then reads)
    edit_metadata(ckpt, overlap)
    with pytest.raises(ConversionError, match=r"do not cover slice \(\) \(at least 4096 of its 16384 elements "):
        TorchDistReader(ckpt / "release").read(PROJ)


def test_coverage_is_counted_on_the_chunks_grid() -> None:
    _uncovered = torch_dist._uncovered
    assert _uncovered((4, 4), [((0, 0), (2, 4)), ((1, 0), (2, 4))]) == 4  # row 3
    assert _uncovered((4, 4), [((0, 0), (4, 2)), ((0, 2), (4, 2))]) == 0
    assert _uncovered((), [((), ())]) == 0 and _uncovered((), []) == 1
    assert _uncovered((0, 64), []) == 0
    # a size no mask could hold: the grid has 3 x 2 cells
    assert _uncovered((2**40, 2**20), [((0, 0), (2**39, 2**20)), ((2**39 + 1, 0), (2**39 - 1, 2**20))]) == 2**20


# ---------------------------------------------------------------- 2. sizes beyond int64


@pytest.mark.parametrize("change, needle", [
    (dict(intermediate_size=2**63), "config.json: intermediate_size=9223372036854775808 (larger than 2147483647"),
    (dict(hidden_size=10**30), "config.json: hidden_size=100000000000000000000000... (larger than 2147483647"),
    (dict(head_dim=2**60), "config.json: head_dim=1152921504606846976 (larger than 2147483647, the largest size read)"),
    (dict(vocab_size=2**31 - 1, hidden_size=2**31 - 1, num_attention_heads=1, num_key_value_heads=1),
     "config.json: vocab_size * hidden_size = 4611686014132420609 (more than 1152921504606846976 elements in one "
     "tensor)"),
    ({**CONFIGS["qwen3_moe"](False).to_dict(), "moe_intermediate_size": 2**63},
     "config.json: moe_intermediate_size=9223372036854775808 (larger than 2147483647, the largest size read)"),
], ids=["ffn", "hidden", "head-dim", "vocab-times-hidden", "moe-ffn"])
def test_config_sizes_beyond_int64(made, tmp_path: Path, change: dict, needle: str) -> None:
    """Each was `TypeError: empty(): ... Overflow when unpacking long long` from the meta tensors of the shapes."""
    hf = copy(made["llama"], tmp_path / "hf")
    edit_json(hf / "config.json", lambda c: c.update(change))
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf], needle)


def test_export_of_a_config_beyond_int64(made, tmp_path: Path) -> None:
    hf = copy(made["llama"], tmp_path / "hf")
    edit_json(hf / "config.json", lambda c: c.update(intermediate_size=2**63))
    err = StringIO()
    with redirect_stderr(err), redirect_stdout(StringIO()):
        rc = cli.main(["export", "trtllm", str(hf), str(tmp_path / "out"), "--target", "pytorch"])
    assert rc == 2 and err.getvalue() == ("mcorekit: error: config.json: intermediate_size=9223372036854775808 "
                                          "(larger than 2147483647, the largest size read)\n"), err.getvalue()


def test_config_integer_beyond_pythons_digit_limit(made, tmp_path: Path) -> None:
    hf = copy(made["llama"], tmp_path / "hf")
    text = (hf / "config.json").read_text()
    (hf / "config.json").write_text(text.replace('"intermediate_size": 128', '"intermediate_size": ' + "9" * 5000))
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf],
                 "config.json: invalid JSON (Exceeds the limit (4300 digits) for integer string conversion")


def test_safetensors_dimension_beyond_int64(made, tmp_path: Path) -> None:
    """An empty tensor's bytes agree with any other dimension: reshape() failed on 2**64 in `convert verify`."""
    hf = copy(made["llama"], tmp_path / "hf")
    shard = hf / json.loads((hf / INDEX).read_text())["weight_map"]["model.norm.weight"]
    edit_header(shard, lambda h: h.update(x={"dtype": "BF16", "shape": [0, 2**64], "data_offsets": [0, 0]}))
    expect_error(["verify", str(made["llama"]), str(hf)], tmp_path / "out", [hf],
                 f"{shard}: tensor 'x': shape [0, 18446744073709551616] has a dimension above 9223372036854775807")


# ---------------------------------------------------------------- 3. control characters in file names


def test_index_naming_a_shard_with_a_nul(made, tmp_path: Path) -> None:
    """`ValueError: embedded null byte` from resolving the name."""
    hf = copy(made["llama"], tmp_path / "hf")
    edit_json(hf / INDEX, lambda i: i["weight_map"].update({"lm_head.weight": "a\x00.safetensors"}))
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf],
                 f"{hf / INDEX} names 'a\\x00.safetensors': a file name with a control character is not read")


def test_metadata_naming_a_data_file_with_a_nul(made, tmp_path: Path) -> None:
    ckpt = copy(made["tck"], tmp_path / "ckpt")

    def rename(md: Any) -> None:
        for info in md.storage_data.values():
            info.relative_path = "__0_0\x00.distcp"
    edit_metadata(ckpt, rename)
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt],
                 "names '__0_0\\x00.distcp': a file name with a control character is not read")


# ---------------------------------------------------------------- 4. legacy rank files


@pytest.mark.parametrize("name, value, needle", [
    (7, torch.zeros(1), "{r0}: model holds the key 7, not a tensor name; a damaged rank file"),
    (EMBEDDING, torch.tensor(1.0, dtype=torch.bfloat16),
     f"{{r0}}: '{EMBEDDING}' (model chunk 0) has shape (), but its tensor-parallel parts are joined on dimension 0"),
    ("decoder.layers.0.self_attention.linear_proj.weight", torch.zeros(64, dtype=torch.bfloat16),
     "{r0}: 'decoder.layers.0.self_attention.linear_proj.weight' (model chunk 0) has shape (64,), but its "
     "tensor-parallel parts are joined on dimension 1"),
], ids=["int-key", "0-dim-embedding", "1-dim-row-split"])
def test_legacy_rank_files_with_odd_keys_or_shapes(made, tmp_path: Path, name: Any, value: torch.Tensor,
                                                   needle: str) -> None:
    """A TypeError in matching the names, a RuntimeError in joining the parts: tracebacks."""
    ckpt = copy(made["lck"], tmp_path / "ckpt")
    for rank in (0, 1):
        state = torch.load(rank_file(ckpt, rank), weights_only=True)
        state["model"][name] = value
        torch.save(state, rank_file(ckpt, rank))
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt],
                 needle.format(r0=rank_file(ckpt, 0)))


# ---------------------------------------------------------------- 5. num_experts_per_tok


def _family_config(family: str) -> tuple[dict[str, Any], int]:
    """A valid config of `family` and its expert count."""
    config = (CONFIGS[family](False) if family in CONFIGS else FAMILY_CONFIGS[family]()).to_dict()
    return config, next(config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if config.get(k))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("topk", [0, 99, "2", True, None])
def test_top_k_must_pick_among_the_experts(family: str, topk: object) -> None:
    """99 of 4 experts converted with exit 0 (moe_router_topk 99 in mcorekit.json, top_k 99 in an engine)."""
    config, experts = _family_config(family)
    assert registry.config_problems(config) == []
    problems = registry.config_problems({**config, "num_experts_per_tok": topk})
    assert any(p.startswith(f"num_experts_per_tok={topk!r} (needs ") for p in problems), problems
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):  # gpt_oss and deepseek_v3 say "a positive integer" to 0, "2"
        assert f"num_experts_per_tok={topk!r} (needs an integer from 1 to the number of experts, {experts})" in problems


def test_top_k_beyond_the_experts_is_refused_by_the_converter(made, tmp_path: Path) -> None:
    hf = copy(made["llama"], tmp_path / "hf")
    (hf / "config.json").write_text(json.dumps({**CONFIGS["mixtral"](False).to_dict(), "num_experts_per_tok": 99}))
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf],
                 "config.json: num_experts_per_tok=99 (needs an integer from 1 to the number of experts, 4)")


# ---------------------------------------------------------------- 6. one line, whatever the path holds


def test_a_newline_in_a_path_stays_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "no\nsuch"
    rc, err = convert("hf-to-mcore", str(bad), str(tmp_path / "out"))
    assert (rc, err) == (2, f"mcorekit: error: {tmp_path}/no\\nsuch: no config.json; pass an HF model directory\n")


def test_one_line_escapes_what_would_not_print() -> None:
    assert one_line(ConversionError("a\nb\r\x00c\u2028d\te")) == "a\\nb\\r\\x00c\\u2028d\\te"
    assert one_line(FileNotFoundError(2, "No such file or directory", "x\ny")) == "x\\ny: No such file or directory"
    assert one_line(ConversionError("plain 'quoted' ünïcode")) == "plain 'quoted' ünïcode"
    # spaces and joiners in names print as themselves (a non-breaking and an ideographic space, a zero-width joiner)
    assert one_line(ConversionError("/data/my\xa0model/モデル\u3000v2/👨\u200d👩")) == "/data/my\xa0model/モデル\u3000v2/👨\u200d👩"
    assert one_line(ValueError("a bug")) is None
    # several layout problems keep a line each (config.rules.listed); a newline inside one is escaped
    from mcorekit.config.rules import listed
    from mcorekit.errors import LayoutError

    assert one_line(LayoutError(listed("invalid layout", ["TP=3 does not divide 4", "a\nb"]))) == (
        "invalid layout (2 problems):\n  - TP=3 does not divide 4\n  - a\\nb")
