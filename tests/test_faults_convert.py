"""Fault injection for `mcorekit convert` (issue 18), grouped by the issue's kinds.

Every bad input or fault must give exit code 2 with exactly one `mcorekit: error:` line (or an argparse usage
error for a bad option value), no traceback, nothing at the output path (no staged folder either), and inputs
byte-identical afterwards. CPU only; tiny models are built here with real transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from io import BytesIO, StringIO
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hf_models import COMMON, add_mtp_layer, make_family_model, make_model
from mcorekit import cli
from mcorekit.convert import torch_dist
from mcorekit.convert.hf_io import HFWriter
from mcorekit.convert.logits import checked_checkpoint
from mcorekit.convert.torch_dist import TorchDistReader, load_metadata
from mcorekit.errors import ConversionError, MCoreKitError

INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Read-only originals; every test copies what it changes."""
    root = tmp_path_factory.mktemp("faults")
    paths = {"llama": make_model("llama", False, root / "llama"), "mixtral": make_model("mixtral", False, root / "mixtral")}
    for name, fmt in (("ckpt", "torch_dist"), ("legacy", "torch")):
        rc, err = convert("hf-to-mcore", str(paths["llama"]), str(root / name), "--format", fmt)
        assert rc == 0, err
        paths[name] = root / name
    return paths


def convert(*args: str) -> tuple[int, str]:
    """`mcorekit convert ARGS` in this process: (exit code, stderr). --quiet where the command has it."""
    argv = ["convert", *args] + (["--quiet"] if args[0] in ("hf-to-mcore", "mcore-to-hf") else [])
    err = StringIO()
    with redirect_stderr(err), redirect_stdout(StringIO()):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse usage errors
            rc = e.code if isinstance(e.code, int) else 1
    return rc, err.getvalue()


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real entry point in a fresh process."""
    return subprocess.run([sys.executable, "-m", "mcorekit", "convert", *args], capture_output=True, text=True, timeout=timeout)


def tree_digest(path: Path) -> str:
    """Hash of every file's bytes and every symlink's target under path (or of path itself)."""
    h = hashlib.sha256()
    items = [path] if not path.is_dir() or path.is_symlink() else sorted(path.rglob("*"))
    for p in items:
        h.update(str(p.relative_to(path) if p != path else p.name).encode())
        if p.is_symlink():
            h.update(b"->" + os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def assert_one_error(rc: int, err: str, needle: str, usage: bool = False) -> None:
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    if usage:  # argparse: the usage lines, then one `PROG: error: ...` line
        assert lines[0].startswith("usage:") and ": error: " in lines[-1] and needle in lines[-1], err
    else:
        assert len(lines) == 1 and lines[0].startswith("mcorekit: error:") and needle in lines[0], err


def assert_nothing_at(out: Path) -> None:
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")] if out.parent.is_dir() else []
    assert leftovers == [], leftovers


def expect_error(args: list[str], out: Path, inputs: list[Path], needle: str, usage: bool = False) -> str:
    """Run, then check the error line, that nothing is at `out`, and that every input is unchanged."""
    before = [tree_digest(p) for p in inputs]
    rc, err = convert(*args)
    assert_one_error(rc, err, needle, usage)
    assert_nothing_at(out)
    assert [tree_digest(p) for p in inputs] == before, "an input changed"
    return err


def copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst, symlinks=True))


def shard_of(hf: Path, name: str) -> Path:
    return hf / json.loads((hf / INDEX).read_text())["weight_map"][name]


def edit_tensor(hf: Path, name: str, change: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Replace (or, when change returns None, delete) one tensor in its shard and the index."""
    shard = shard_of(hf, name)
    tensors = load_file(shard)
    new = change(tensors[name])
    if new is None:
        del tensors[name]
        index = json.loads((hf / INDEX).read_text())
        del index["weight_map"][name]
        (hf / INDEX).write_text(json.dumps(index))
    else:
        tensors[name] = new
    save_file(tensors, shard, {"format": "pt"})


def edit_json(file: Path, change: Callable[[dict], object]) -> None:
    """Change a JSON object in place (what `change` returns is ignored)."""
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


def edit_header(file: Path, change: Callable[[dict], None]) -> None:
    """Rewrite a safetensors header in place, keeping the data bytes."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    new = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


class Evil:
    """Pickles as a call to os.system (what a crafted checkpoint file does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


@contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A small tmpfs at `where`, or a skip saying why it cannot be mounted here."""
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'mount failed'}); needs root or CAP_SYS_ADMIN")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


# ---------------------------------------------------------------- code execution


def test_malicious_metadata_runs_nothing_through_the_real_cli(base, tmp_path: Path) -> None:
    ckpt = copy(base["ckpt"], tmp_path / "ckpt")
    marker = tmp_path / "MARKER"
    (ckpt / "release/.metadata").write_bytes(pickle.dumps(Evil(marker)))
    before = tree_digest(ckpt)
    for args in (["mcore-to-hf", str(ckpt), str(tmp_path / "out"), "--quiet"],
                 ["mcore-to-hf", str(ckpt / "release"), str(tmp_path / "out"), "--quiet"]):
        proc = run_cli(*args)
        assert_one_error(proc.returncode, proc.stderr, "not a checkpoint metadata file (refusing to load class posix.system)")
        assert not marker.exists()
        assert_nothing_at(tmp_path / "out")
    assert tree_digest(ckpt) == before


def test_malicious_metadata_that_also_holds_real_metadata(base, tmp_path: Path) -> None:
    """The variant that ran the command and still converted: a real Metadata with the payload inside it."""
    ckpt = copy(base["ckpt"], tmp_path / "ckpt")
    marker = tmp_path / "MARKER"
    md = load_metadata(ckpt / "release/.metadata")
    md.planner_data = Evil(marker)
    (ckpt / "release/.metadata").write_bytes(pickle.dumps(md))
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt], "refusing to load class posix.system")
    expect_error(["verify", "--logits", str(ckpt / "hf"), str(ckpt)], tmp_path / "out", [ckpt],
                 "refusing to load class posix.system")  # checked before the GPU is asked for
    with pytest.raises(ConversionError, match="refusing to load class posix.system"):
        TorchDistReader(ckpt / "release")  # the reader export uses
    assert not marker.exists()


def test_malicious_legacy_rank_file(base, tmp_path: Path) -> None:
    ckpt = copy(base["legacy"], tmp_path / "ckpt")
    marker = tmp_path / "MARKER"
    torch.save({"model": {}, "args": Evil(marker)}, ckpt / "release/mp_rank_00/model_optim_rng.pt")
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt],
                 "cannot load it as a weights-only checkpoint")
    assert not marker.exists()


def test_legacy_rank_file_holding_a_chunk_twice(base, tmp_path: Path) -> None:
    """`model` and `model0` both name chunk 0: one was read and the other ignored."""
    ckpt = copy(base["legacy"], tmp_path / "ckpt")
    file = ckpt / "release/mp_rank_00/model_optim_rng.pt"
    state = torch.load(file, weights_only=True)
    chunk = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state["model"].items()}
    torch.save({**state, "model0": chunk}, file)
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt],
                 f"{file}: holds a model chunk twice (model, model0)")


def test_malicious_bytes_entry_is_loaded_weights_only(tmp_path: Path) -> None:
    """common_state and TE extra states are torch.save blobs: read with weights_only, never plain unpickling."""
    marker = tmp_path / "MARKER"
    blob = BytesIO()
    torch.save([Evil(marker)], blob)
    torch_dist.write(tmp_path / "ckpt", [], {"common_state/shard_0_1": blob.getvalue()})
    reader = TorchDistReader(tmp_path / "ckpt")
    with pytest.raises(ConversionError, match="cannot load bytes entry 'common_state/shard_0_1' with weights_only"):
        reader.read_bytes("common_state/shard_0_1")
    with pytest.raises(MCoreKitError, match="record common_state/shard_0_1 asks to run posix.system"):
        checked_checkpoint(tmp_path / "ckpt")  # what verify --logits runs before Megatron's own (unrestricted) loader
    assert not marker.exists()


# ---------------------------------------------------------------- exit 0 with a broken output


def test_missing_q_proj_in_one_layer(base, tmp_path: Path) -> None:
    hf = copy(base["llama"], tmp_path / "hf")
    edit_tensor(hf, "model.layers.2.self_attn.q_proj.weight", lambda t: None)
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf],
                 "tensor 'model.layers.2.self_attn.q_proj.weight' is missing")


@pytest.mark.parametrize("cast", [[], ["--dtype", "bf16"]], ids=["keep", "dtype-bf16"])
def test_integer_weights_are_refused_even_with_dtype(base, tmp_path: Path, cast: list[str]) -> None:
    hf = copy(base["llama"], tmp_path / "hf")
    edit_tensor(hf, "model.layers.0.mlp.down_proj.weight", lambda t: t.to(torch.int8))
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out"), *cast], tmp_path / "out", [hf],
                 "model.layers.0.mlp.down_proj.weight is stored as torch.int8")


def test_mixed_float_dtypes_need_dtype(base, tmp_path: Path) -> None:
    hf = copy(base["llama"], tmp_path / "hf")
    edit_tensor(hf, "model.layers.1.mlp.down_proj.weight", lambda t: t.float())
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf], "mix dtypes")
    rc, err = convert("hf-to-mcore", str(hf), str(tmp_path / "out"), "--dtype", "bf16")  # floats may be cast
    assert rc == 0, err


@pytest.mark.parametrize("ckpt_name", ["ckpt", "legacy"])
def test_stored_config_with_more_layers_than_the_checkpoint(base, tmp_path: Path, ckpt_name: str) -> None:
    ckpt = copy(base[ckpt_name], tmp_path / "ckpt")
    edit_json(ckpt / "hf/config.json", lambda c: c.update(num_hidden_layers=6))
    needle = "num_hidden_layers 6 in the config, 4 in the checkpoint" if ckpt_name == "ckpt" else "hold 4 layers"
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt], needle)


@pytest.mark.parametrize("change, needle", [
    (dict(hidden_size=128), "hidden_size 128 in the config, 64 in the checkpoint"),
    (dict(vocab_size=300), "vocab_size 300 in the config, 256 embedding rows"),
    (dict(num_attention_heads=2, num_key_value_heads=1), "linear_qkv.weight is (4, 128, 64) in the checkpoint"),
], ids=["hidden", "vocab", "heads"])
def test_given_config_that_disagrees_with_the_checkpoint(base, tmp_path: Path, change: dict, needle: str) -> None:
    other = copy(base["llama"], tmp_path / "other")
    edit_json(other / "config.json", lambda c: c.update(change))
    expect_error(["mcore-to-hf", str(base["ckpt"]), str(tmp_path / "out"), "--hf-config", str(other)],
                 tmp_path / "out", [base["ckpt"], other], needle)


def test_metadata_whose_chunks_leave_a_hole(base, tmp_path: Path) -> None:
    """A slice no chunk covers would come out as uninitialised memory."""
    ckpt = copy(base["ckpt"], tmp_path / "ckpt")
    md = load_metadata(ckpt / "release/.metadata")
    md.state_dict_metadata["decoder.layers.self_attention.linear_proj.weight"].chunks.pop(2)
    (ckpt / "release/.metadata").write_bytes(pickle.dumps(md))
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt],
                 "do not cover slice (2,)")


def test_checkpoint_tensor_with_an_integer_dtype(base, tmp_path: Path) -> None:
    ckpt = copy(base["ckpt"], tmp_path / "ckpt")
    md = load_metadata(ckpt / "release/.metadata")
    md.state_dict_metadata["decoder.final_layernorm.weight"].properties.dtype = torch.int8
    (ckpt / "release/.metadata").write_bytes(pickle.dumps(md))
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out"), "--dtype", "bf16"], tmp_path / "out", [ckpt],
                 "decoder.final_layernorm.weight is stored as torch.int8")


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("failing", [0, 7], ids=["first-chunk", "last-chunk"])
def test_torch_dist_write_raises_what_failed_on_any_thread(tmp_path: Path, failing: int) -> None:
    """DCP writes some files on helper threads that swallow exceptions; the write must fail all the same."""

    def chunk(i: int) -> torch_dist.ChunkSource:
        def produce() -> torch.Tensor:
            if i == failing:
                raise ConversionError(f"chunk {i} failed")
            return torch.full((1, 4), float(i))
        return torch_dist.ChunkSource((i, 0), (1, 4), produce)

    tensors = [torch_dist.PlannedTensor(f"t{k}", (8, 4), torch.float32, [chunk(i) for i in range(8)], "layer") for k in range(2)]
    with pytest.raises(ConversionError, match=f"chunk {failing} failed"):
        torch_dist.write(tmp_path / "out", tensors, {}, threads=2)


def test_hf_writer_reports_a_failed_background_write(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "size=128k") as small:
        writer = HFWriter(small, max_shard_bytes=1 << 30)
        writer.add("a", torch.zeros(16 * 1024))  # 64 KiB, written on the background thread
        with pytest.raises(ConversionError, match="small/part-00001.safetensors: cannot write .*o space left"):
            writer.add("b", torch.zeros(64 * 1024))  # 256 KiB: its write fails; reported by add or by finish
            writer.finish()
        writer.close()


def test_hf_writer_never_writes_a_header_it_could_not_finish(tmp_path: Path) -> None:
    """The header area is written last and needs fresh blocks: on a nearly full disk pwrite may write part of it
    without raising. The shard is then either readable or reported; never closed as if complete."""
    import json as _json
    import os as _os

    from mcorekit.convert.hf_io import _Shard

    with tmpfs(tmp_path / "small", "size=512k") as small:
        for free_pages in range(0, 18, 2):
            for f in small.iterdir():
                f.unlink()
            st = _os.statvfs(small)
            (small / "filler").write_bytes(b"\0" * ((st.f_bfree - 16 - free_pages) * st.f_bsize))
            shard = _Shard(small / "s.safetensors", 65536)
            try:
                for i in range(16):
                    w = torch.full((1024,), float(i))
                    shard.write(shard.place(f"w{i}", w), w)
                shard.close()
            except OSError:
                shard.abandon()
                continue
            raw = (small / "s.safetensors").read_bytes()
            _json.loads(raw[8: 8 + int.from_bytes(raw[:8], "little")])  # closed without error: it must parse


def test_hf_writer_waits_for_an_empty_last_tensor(tmp_path: Path) -> None:
    """A 0-element tensor queued last is in its shard's header (the closing wait once skipped it: 95/200 runs)."""
    from safetensors.torch import load_file

    for i in range(40):
        out = tmp_path / str(i)
        out.mkdir()
        with HFWriter(out) as writer:
            writer.add("w", torch.zeros(64, 8))
            writer.add("e", torch.zeros(0))
            writer.finish()
        assert sorted(load_file(out / "model-00001-of-00001.safetensors")) == ["e", "w"]


def test_hf_writer_refuses_a_repeated_name_and_an_unknown_dtype(tmp_path: Path) -> None:
    with HFWriter(tmp_path) as writer:
        writer.add("a", torch.zeros(2))
        with pytest.raises(ConversionError, match="tensor 'a' written twice"):
            writer.add("a", torch.ones(2))
        with pytest.raises(ConversionError, match="b: dtype torch.complex64 has no safetensors name"):
            writer.add("b", torch.zeros(2, dtype=torch.complex64))


def test_hf_writer_reports_a_shard_it_cannot_create(tmp_path: Path) -> None:
    writer = HFWriter(tmp_path / "absent")
    with pytest.raises(ConversionError, match="absent/part-00001.safetensors: cannot write"):
        writer.add("a", torch.zeros(4))
    writer.close()


# ---------------------------------------------------------------- invalid values


@pytest.mark.parametrize("args, needle", [
    (["--tp", "0"], "argument --tp: must be >= 1, got 0"),
    (["--tp", "-1"], "argument --tp: must be >= 1, got -1"),
    (["--tp", "two"], "argument --tp: 'two' is not an integer"),
    (["--tp", "1" + "0" * 400], "argument --tp: must be <= 2,147,483,647, got 10000000000000000000..."),
    (["--pp", "0"], "argument --pp"),
    (["--ep", "-1"], "argument --ep"),
    (["--etp", "0"], "argument --etp"),
    (["--vpp", "0"], "argument --vpp"),
    (["--vocab-divisible-by", "0"], "argument --vocab-divisible-by"),
])
def test_bad_layout_numbers_are_usage_errors(base, tmp_path: Path, args: list[str], needle: str) -> None:
    expect_error(["hf-to-mcore", str(base["llama"]), str(tmp_path / "out"), *args], tmp_path / "out", [base["llama"]],
                 needle, usage=True)


def test_a_vocabulary_divisor_beyond_any_padding_is_refused(base, tmp_path: Path) -> None:
    """10**9 tried to allocate a 128 GB embedding for the tiny model, reported as a failed write."""
    expect_error(["hf-to-mcore", str(base["llama"]), str(tmp_path / "out"), "--vocab-divisible-by", str(10**9)],
                 tmp_path / "out", [base["llama"]], "--vocab-divisible-by 1000000000: must be from 1 to 65,536")


@pytest.mark.parametrize("value, needle", [(v, "") for v in ("0", "-1", "nan", "inf", "big")] + [
    ("1e300", "must be <= 1,048,576 (GB), got 1e300"),  # finite, but its bytes overflowed int(): a traceback
    ("1048577", "must be <= 1,048,576 (GB), got 1048577")])
def test_bad_shard_size_is_a_usage_error(base, tmp_path: Path, value: str, needle: str) -> None:
    expect_error(["mcore-to-hf", str(base["ckpt"]), str(tmp_path / "out"), "--max-shard-gb", value], tmp_path / "out",
                 [base["ckpt"]], f"argument --max-shard-gb: {needle}", usage=True)


@pytest.mark.parametrize("model, args, needle", [
    ("llama", ["--tp", "3"], "TP=3 does not divide num_query_groups=2"),
    ("llama", ["--tp", "4"], "TP=4 does not divide num_query_groups=2"),
    ("llama", ["--pp", "3"], "PP*VPP=3 does not divide num_layers=4"),
    ("llama", ["--pp", "2", "--vpp", "3"], "PP*VPP=6 does not divide num_layers=4"),
    ("llama", ["--vpp", "2"], "VPP=2 needs PP >= 2"),
    ("llama", ["--ep", "2"], "given for a dense model"),
    ("mixtral", ["--ep", "3"], "EP=3 does not divide num_experts=4"),
    ("mixtral", ["--etp", "3"], "ETP=3 does not divide the expert FFN size 128"),
])
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_layout_that_does_not_fit_the_model(base, tmp_path: Path, model: str, args: list[str], needle: str, fmt: str) -> None:
    expect_error(["hf-to-mcore", str(base[model]), str(tmp_path / "out"), "--format", fmt, *args], tmp_path / "out",
                 [base[model]], needle)


def test_expert_tp_other_than_tp_is_a_legacy_limit_only(base, tmp_path: Path) -> None:
    """Megatron-Core reshards torch_dist at load, to any expert TP it runs (parallel.etp); only the legacy files,
    written for one layout, need ETP 1 or TP. torch_dist was refused with the legacy rule."""
    expect_error(["hf-to-mcore", str(base["mixtral"]), str(tmp_path / "out"), "--format", "torch", "--etp", "2"],
                 tmp_path / "out", [base["mixtral"]],
                 "ETP=2: the legacy format supports expert TP of 1 or equal to TP=1")
    rc, err = convert("hf-to-mcore", str(base["mixtral"]), str(tmp_path / "td"), "--etp", "2")
    assert rc == 0, err
    rc, err = convert("mcore-to-hf", str(tmp_path / "td"), str(tmp_path / "back"))
    assert rc == 0, err
    rc, out, err = verify_cli(base["mixtral"], tmp_path / "back")
    assert rc == 0, out + err


# ---------------------------------------------------------------- data loss: --force never deletes an input


def test_hf_to_mcore_never_replaces_its_input(base, tmp_path: Path) -> None:
    parent = tmp_path / "od" / "parent"
    hf = copy(base["llama"], parent / "model")
    (parent / "sibling.txt").write_text("keep me")
    for out in (hf, hf / "inside", parent, tmp_path / "od"):
        before = tree_digest(tmp_path / "od")
        rc, err = convert("hf-to-mcore", str(hf), str(out), "--force")
        assert_one_error(rc, err, "overlaps the input")
        assert tree_digest(tmp_path / "od") == before
    assert not (hf / "inside").exists()


def test_mcore_to_hf_never_replaces_its_inputs(base, tmp_path: Path) -> None:
    ckpt = copy(base["ckpt"], tmp_path / "ckpts" / "ckpt")
    other = copy(base["llama"], tmp_path / "other")
    cases = [(ckpt, []), (ckpt / "release", []), (ckpt / "hf", []), (ckpt / "release" / "x", []), (tmp_path / "ckpts", []),
             (other, ["--hf-config", str(other)]), (other / "config.json", ["--hf-config", str(other / "config.json")])]
    for out, extra in cases:
        before = tree_digest(tmp_path)
        rc, err = convert("mcore-to-hf", str(ckpt), str(out), "--force", *extra)
        assert_one_error(rc, err, "overlaps the input")
        assert tree_digest(tmp_path) == before, out


def test_force_replaces_only_an_earlier_output(base, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    rc, err = convert("hf-to-mcore", str(base["llama"]), str(out), "--force")
    assert_one_error(rc, err, "was not written by mcorekit")
    assert (out / "thesis.tex").read_text() == "precious"
    shutil.rmtree(out)
    assert convert("hf-to-mcore", str(base["llama"]), str(out))[0] == 0
    assert convert("hf-to-mcore", str(base["llama"]), str(out), "--force")[0] == 0  # ours: replaced


# ---------------------------------------------------------------- reads outside the model directory


def move_shard_out(hf: Path, outside: Path, entry: Callable[[Path], str]) -> None:
    """Move one shard out of the model folder and point the index at it with entry(new location)."""
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = shard_of(hf, name)
    outside.mkdir(exist_ok=True)
    moved = Path(shutil.move(shard, outside / shard.name))
    edit_json(hf / INDEX, lambda i: i["weight_map"].update({k: entry(moved) for k, v in i["weight_map"].items() if v == shard.name}))


@pytest.mark.parametrize("entry, needle", [
    (lambda moved: f"../outside/{moved.name}", "only relative paths inside"),
    (lambda moved: str(moved), "only relative paths inside"),
], ids=["dotdot", "absolute"])
@pytest.mark.parametrize("command", ["hf-to-mcore", "verify"])
def test_index_naming_a_file_outside(base, tmp_path: Path, entry: Callable[[Path], str], needle: str, command: str) -> None:
    hf = copy(base["llama"], tmp_path / "hf")
    move_shard_out(hf, tmp_path / "outside", entry)
    args = [command, str(hf), str(tmp_path / "out")] if command == "hf-to-mcore" else [command, str(base["llama"]), str(hf)]
    expect_error(args, tmp_path / "out", [hf, tmp_path / "outside"], needle)


def test_symlinked_shard_leading_out(base, tmp_path: Path) -> None:
    hf = copy(base["llama"], tmp_path / "hf")
    shard = shard_of(hf, "model.embed_tokens.weight")
    (tmp_path / "outside").mkdir()
    shutil.move(shard, tmp_path / "outside" / shard.name)
    shard.symlink_to(tmp_path / "outside" / shard.name)
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf], "outside")


def test_symlinked_tokenizer_file_leading_out(base, tmp_path: Path) -> None:
    hf = copy(base["llama"], tmp_path / "hf")
    (tmp_path / "secret.txt").write_text("not for the output")
    (hf / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf], "outside")


def test_metadata_naming_a_data_file_outside(base, tmp_path: Path) -> None:
    ckpt = copy(base["ckpt"], tmp_path / "ckpt")
    md = load_metadata(ckpt / "release/.metadata")
    for info in md.storage_data.values():
        info.relative_path = "../../outside.distcp"
    (ckpt / "release/.metadata").write_bytes(pickle.dumps(md))
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt], "only relative paths inside")


def test_hub_snapshot_symlinks_are_read(base, tmp_path: Path) -> None:
    """The Hugging Face cache links snapshots/REV/* to ../../blobs/*: that layout must keep working."""
    repo = tmp_path / "models--tiny"
    snap = repo / "snapshots" / "rev1"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in base["llama"].iterdir():
        shutil.copy(f, repo / "blobs" / f"blob-{f.name}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob-{f.name}")
    rc, err = convert("hf-to-mcore", str(snap), str(tmp_path / "out"))
    assert rc == 0, err


# ---------------------------------------------------------------- malformed input: one line, not a traceback


def _set_config(**values: object) -> Callable[[Path], None]:
    return lambda hf: edit_json(hf / "config.json", lambda c: c.update(values))


def _first_shard_header(change: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda hf: edit_header(shard_of(hf, "model.embed_tokens.weight"), change)


HF_CORRUPTIONS = {
    "config-invalid-json": (lambda hf: (hf / "config.json").write_text("{not json"), "config.json: invalid JSON"),
    "config-binary": (lambda hf: (hf / "config.json").write_bytes(b"\xff\xfe\x00garbage"), "config.json: not UTF-8 text"),
    "config-a-list": (lambda hf: (hf / "config.json").write_text("[1, 2]"), "expected a JSON object, found a list"),
    "config-deep": (lambda hf: (hf / "config.json").write_text("[" * 100000 + "]" * 100000), "config.json:"),
    "config-no-hidden": (lambda hf: edit_json(hf / "config.json", lambda c: c.pop("hidden_size")), "hidden_size=None (needs a positive integer)"),
    "config-hidden-str": (_set_config(hidden_size="64"), "hidden_size='64' (needs a positive integer)"),
    "config-negative-layers": (_set_config(num_hidden_layers=-4), "num_hidden_layers=-4"),
    "config-model-type-list": (_set_config(model_type=["llama"]), "model_type=['llama'] is not a name"),
    "config-heads-groups": (_set_config(num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
    "config-rope-not-object": (_set_config(rope_parameters=5), "unusable config"),
    "config-more-layers": (_set_config(num_hidden_layers=6), "num_hidden_layers=6, but the weights hold layers 0, 1, 2, 3"),
    # bool("false") is True: the model would read as tied and its lm_head be dropped
    "config-tie-string": (_set_config(tie_word_embeddings="false"),
                          "config.json: tie_word_embeddings='false' (needs true or false, a JSON boolean)"),
    "config-bias-null": (_set_config(attention_bias=None), "attention_bias=None (needs true or false, a JSON boolean)"),
    "config-eps-text": (_set_config(rms_norm_eps="tiny"), "rms_norm_eps='tiny' (needs a positive number)"),
    "config-theta-nan": (_set_config(rope_theta=float("nan")), "rope_theta=nan (needs a positive number)"),
    "index-invalid-json": (lambda hf: (hf / INDEX).write_text('{"weight_map": '), f"{INDEX}: invalid JSON"),
    "index-no-weight-map": (lambda hf: edit_json(hf / INDEX, lambda i: i.pop("weight_map")), 'no "weight_map" object'),
    "index-weight-map-list": (lambda hf: edit_json(hf / INDEX, lambda i: i.update(weight_map=["a"])), 'no "weight_map" object'),
    "index-value-not-str": (lambda hf: edit_json(hf / INDEX, lambda i: i["weight_map"].update({"lm_head.weight": 3})), "is 3, not a file name"),
    "missing-shard": (lambda hf: shard_of(hf, "lm_head.weight").unlink(), "missing shard"),
    "header-not-json": (lambda hf: shard_of(hf, "lm_head.weight").write_bytes(struct.pack("<Q", 5) + b"{oops"), "corrupt or truncated"),
    "header-too-long": (lambda hf: shard_of(hf, "lm_head.weight").write_bytes(struct.pack("<Q", 2**40) + b"{}"), "exceeds the file"),
    "header-short-file": (lambda hf: shard_of(hf, "lm_head.weight").write_bytes(b"\x01\x02"), "shorter than the 8-byte header"),
    "header-not-object": (lambda hf: shard_of(hf, "lm_head.weight").write_bytes(struct.pack("<Q", 2) + b"[]"), "not a JSON object"),
    "offsets-reversed": (_first_shard_header(lambda h: first_tensor(h)["data_offsets"].reverse()), "are reversed"),
    "offsets-negative": (_first_shard_header(lambda h: first_tensor(h).update(data_offsets=[-8, 0])), "not two non-negative integers"),
    "offsets-past-end": (_first_shard_header(lambda h: first_tensor(h).update(data_offsets=[10**9, 10**9 + 32000])), "past the end of the file"),
    "dtype-unknown": (_first_shard_header(lambda h: first_tensor(h).update(dtype="Q7")), "unsupported dtype 'Q7'"),
    "shape-vs-offsets": (_first_shard_header(lambda h: first_tensor(h).update(shape=[250, 65])), "data_offsets span"),
    "shape-not-ints": (_first_shard_header(lambda h: first_tensor(h).update(shape=["250", 64])), "not a list of non-negative integers"),
    # safetensors refuses a __metadata__ that is not an object of strings
    "metadata-not-object": (_first_shard_header(lambda h: h.update(__metadata__=[1, 2])),
                            "__metadata__ is not an object of strings"),
    "metadata-value-not-str": (_first_shard_header(lambda h: h.update(__metadata__={"format": 1})),
                               "__metadata__ is not an object of strings"),
}


@pytest.mark.parametrize("case", list(HF_CORRUPTIONS))
def test_malformed_hf_input(base, tmp_path: Path, case: str) -> None:
    corrupt, needle = HF_CORRUPTIONS[case]
    hf = copy(base["llama"], tmp_path / "hf")
    corrupt(hf)
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf], needle)


def test_a_null_metadata_header_is_no_metadata(base, tmp_path: Path) -> None:
    """"__metadata__": null, which the safetensors library reads as none, converts (it was refused for a while)."""
    hf = copy(base["llama"], tmp_path / "hf")
    _first_shard_header(lambda h: h.update(__metadata__=None))(hf)
    rc, err = convert("hf-to-mcore", str(hf), str(tmp_path / "out"))
    assert rc == 0, err


def _distcp(ckpt: Path) -> Path:
    return next((ckpt / "release").glob("*.distcp"))


CKPT_CORRUPTIONS = {
    "tracker-traversal": (lambda c: (c / "latest_checkpointed_iteration.txt").write_text("../../etc"), "holds '../../etc'; expected `release`"),
    "tracker-binary": (lambda c: (c / "latest_checkpointed_iteration.txt").write_bytes(b"\x00\xff" * 100), "expected `release` or an iteration number"),
    "tracker-empty": (lambda c: (c / "latest_checkpointed_iteration.txt").write_text(""), "holds ''"),
    "tracker-absent-iteration": (lambda c: (c / "latest_checkpointed_iteration.txt").write_text("7"), "iter_0000007 does not exist"),
    "metadata-json-invalid": (lambda c: (c / "release/metadata.json").write_text("{"), "metadata.json: invalid JSON"),
    "metadata-json-list": (lambda c: (c / "release/metadata.json").write_text("[]"), "metadata.json: expected a JSON object"),
    "metadata-json-backend": (lambda c: (c / "release/metadata.json").write_text('{"sharded_backend": "zarr"}'), "backend 'zarr', expected torch_dist"),
    "dcp-metadata-garbage": (lambda c: (c / "release/.metadata").write_bytes(os.urandom(64)), "not a"),
    "dcp-metadata-truncated": (lambda c: (c / "release/.metadata").write_bytes((c / "release/.metadata").read_bytes()[:200]), "not a readable checkpoint metadata file"),
    "dcp-metadata-not-metadata": (lambda c: (c / "release/.metadata").write_bytes(pickle.dumps({"a": 1})), "it holds a dict"),
    "dcp-metadata-missing": (lambda c: (c / "release/.metadata").unlink(), ".metadata: missing"),
    "data-file-missing": (lambda c: _distcp(c).unlink(), "missing checkpoint file"),
    "data-file-truncated": (lambda c: _distcp(c).write_bytes(_distcp(c).read_bytes()[:1000]), "truncated checkpoint file"),
    "data-file-garbage": (lambda c: _distcp(c).write_bytes(os.urandom(_distcp(c).stat().st_size)), "cannot read tensor"),
    "stored-config-invalid": (lambda c: (c / "hf/config.json").write_text("{"), "hf/config.json: invalid JSON"),
    "stored-config-binary": (lambda c: (c / "hf/config.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00"), "not UTF-8 text"),
}


@pytest.mark.parametrize("case", list(CKPT_CORRUPTIONS))
def test_malformed_checkpoint(base, tmp_path: Path, case: str) -> None:
    corrupt, needle = CKPT_CORRUPTIONS[case]
    ckpt = copy(base["ckpt"], tmp_path / "ckpt")
    corrupt(ckpt)
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt], needle)


@pytest.mark.parametrize("case", ["garbage", "bad-rank-name", "missing-rank-file"])
def test_malformed_legacy_checkpoint(base, tmp_path: Path, case: str) -> None:
    ckpt = copy(base["legacy"], tmp_path / "ckpt")
    rank = ckpt / "release/mp_rank_00"
    if case == "garbage":
        (rank / "model_optim_rng.pt").write_bytes(os.urandom(4096))
        needle = "cannot load it as a weights-only checkpoint"
    elif case == "bad-rank-name":
        rank.rename(ckpt / "release/mp_rank_xx")
        needle = "not a Megatron rank directory name"
    else:
        (rank / "model_optim_rng.pt").unlink()
        needle = "missing rank file"
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt], needle)


def test_missing_paths(base, tmp_path: Path) -> None:
    expect_error(["mcore-to-hf", str(tmp_path / "nope"), str(tmp_path / "out")], tmp_path / "out", [], "not a directory")
    expect_error(["mcore-to-hf", str(base["ckpt"]), str(tmp_path / "out"), "--hf-config", str(tmp_path / "nope")],
                 tmp_path / "out", [base["ckpt"]], "no HF config at")
    expect_error(["hf-to-mcore", str(tmp_path / "nope"), str(tmp_path / "out")], tmp_path / "out", [], "no config.json")


def test_read_only_output_filesystem(base, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        expect_error(["hf-to-mcore", str(base["llama"]), str(ro / "out")], ro / "out", [base["llama"]], "Read-only file system")
        expect_error(["mcore-to-hf", str(base["ckpt"]), str(ro / "sub" / "out")], ro / "sub" / "out", [base["ckpt"]],
                     "Read-only file system")


# ---------------------------------------------------------------- resource exhaustion


def test_header_claiming_8_gb_is_rejected_before_allocating(base, tmp_path: Path) -> None:
    hf = copy(base["llama"], tmp_path / "hf")
    # 8 GiB of bf16 claimed, zero bytes stored: formerly allocated by torch.empty(shape) for an empty span.
    edit_header(shard_of(hf, "lm_head.weight"), lambda h: first_tensor(h).update(shape=[2**31, 2], data_offsets=[0, 0]))
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf],
                 "needs 8589934592 bytes, data_offsets span 0")


@pytest.mark.parametrize("change, needle", [
    (dict(num_hidden_layers=10**9), "num_hidden_layers=1000000000, but the weights hold"),
    (dict(vocab_size=10**12), "vocab_size=1000000000000 (larger than 2147483647, the largest size read)"),
    (dict(intermediate_size=10**12), "intermediate_size=1000000000000 (larger than 2147483647, the largest size read)"),
    (dict(intermediate_size=2**31 - 1), "config.json implies (2147483647, 64)"),  # within int32: a shape mismatch
], ids=["layers", "vocab", "ffn", "ffn-int32"])
def test_huge_config_values_fail_fast(base, tmp_path: Path, change: dict, needle: str) -> None:
    hf = copy(base["llama"], tmp_path / "hf")
    edit_json(hf / "config.json", lambda c: c.update(change))
    start = time.monotonic()
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf], needle)
    assert time.monotonic() - start < 10


def test_metadata_claiming_more_bytes_than_stored(base, tmp_path: Path) -> None:
    ckpt = copy(base["ckpt"], tmp_path / "ckpt")
    md = load_metadata(ckpt / "release/.metadata")
    tensor = md.state_dict_metadata["decoder.final_layernorm.weight"]
    tensor.size = torch.Size([2**33])
    tensor.chunks[0].sizes = torch.Size([2**33])
    (ckpt / "release/.metadata").write_bytes(pickle.dumps(md))
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt], "stored bytes")


# ---------------------------------------------------------------- leftovers: killed runs, full disks


def test_sigkill_mid_write_then_rerun(tmp_path: Path) -> None:
    """A real conversion killed while its output is staged leaves nothing that looks complete; the next run
    removes the dead process's staged folder and succeeds."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 1024})
    hf = tmp_path / "big"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(hf)  # ~40 MB
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "mcorekit", "convert", "hf-to-mcore", str(hf), str(out), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.partial-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    staged = list(tmp_path.glob(".out.partial-*"))
    assert staged and not out.exists(), "the kill did not land while the output was staged"
    before = tree_digest(hf)
    rc, err = convert("hf-to-mcore", str(hf), str(out))
    assert rc == 0, err
    assert (out / "release/metadata.json").is_file() and (out / ".mcorekit-output").is_file()
    assert list(tmp_path.glob(".out.*")) == []
    assert tree_digest(hf) == before


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # a helper thread's traceback
def test_disk_full(base, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "size=128k") as small:
        for args in (["hf-to-mcore", str(base["llama"]), str(small / "out")],
                     ["hf-to-mcore", str(base["llama"]), str(small / "out"), "--format", "torch"],
                     ["mcore-to-hf", str(base["ckpt"]), str(small / "out")]):
            expect_error(args, small / "out", [base["llama"], base["ckpt"]], "o space left on device")
            assert list(small.iterdir()) == []


# ---------------------------------------------------------------- inputs checked against each other (audit 2026-12)


@pytest.fixture(scope="module")
def legacy_tp2(base, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama as legacy per-rank files at TP 2 (read-only), which convert back as they are."""
    root = tmp_path_factory.mktemp("tp2")
    rc, err = convert("hf-to-mcore", str(base["llama"]), str(root / "legacy"), "--format", "torch", "--tp", "2")
    assert rc == 0, err
    rc, err = convert("mcore-to-hf", str(root / "legacy"), str(root / "back"))
    assert rc == 0, err
    assert verify_cli(base["llama"], root / "back")[0] == 0
    return root / "legacy"


def rank_file(ckpt: Path, tp_rank: int) -> Path:
    return ckpt / f"release/mp_rank_{tp_rank:02d}/model_optim_rng.pt"


@pytest.mark.parametrize("rank, name, change, needle", [
    # torch.cat promoted the int16 part to bf16: wrong q/k/v, exit 0
    (0, "decoder.layers.0.self_attention.linear_qkv.weight", lambda t: t.view(torch.int16),
     "is torch.int16 (64, 64) in {r0} but torch.bfloat16 (64, 64) in {r1}"),
    # torch.cat failed: a traceback (read while the output is written: layer 0 alone is read up front)
    (1, "decoder.layers.1.self_attention.linear_proj.weight", lambda t: t[:63].clone(),
     "is torch.bfloat16 (64, 32) in {r0} but torch.bfloat16 (63, 32) in {r1}"),
], ids=["dtype", "shape"])
def test_legacy_tensor_parallel_parts_must_agree(legacy_tp2, tmp_path: Path, rank: int, name: str,
                                                 change: Callable[[torch.Tensor], torch.Tensor], needle: str) -> None:
    ckpt = copy(legacy_tp2, tmp_path / "ckpt")
    state = torch.load(rank_file(ckpt, rank), weights_only=True)
    state["model"][name] = change(state["model"][name])
    torch.save(state, rank_file(ckpt, rank))
    needle = f"{name!r} (model chunk 0) " + needle.format(r0=rank_file(ckpt, 0), r1=rank_file(ckpt, 1))
    err = expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt], needle)
    assert "tensor-parallel parts of a tensor are equal splits" in err


def single_file(src: Path, dst: Path) -> Path:
    """A copy of the model as one model.safetensors (its shards and index gone)."""
    hf = copy(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(hf.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
        shard.unlink()
    (hf / INDEX).unlink()
    save_file(tensors, hf / "model.safetensors", {"format": "pt"})
    return hf


def test_safetensors_offsets_must_tile_the_data(base, tmp_path: Path) -> None:
    """Each tensor starts where the one before it ends, from 0 to the file's end (safetensors' own rule): an
    embedding pointed at the head's bytes converted with exit 0 into a model whose embedding was its head."""
    from safetensors import SafetensorError

    hf = single_file(base["llama"], tmp_path / "hf")
    file = hf / "model.safetensors"
    edit_header(file, lambda h: h["model.embed_tokens.weight"].update(data_offsets=h["lm_head.weight"]["data_offsets"]))
    with pytest.raises(SafetensorError, match="invalid offset for tensor"):
        load_file(file)
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf],
                 f"corrupt or truncated safetensors file {file}: tensor 'model.embed_tokens.weight': data_offsets "
                 f"[0, 32000] overlap tensor 'lm_head.weight', which ends at 32000")

    hf = single_file(base["llama"], tmp_path / "hf2")  # bytes after the last tensor belong to none
    raw = (hf / "model.safetensors").read_bytes()
    data = len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]
    with open(hf / "model.safetensors", "ab") as f:
        f.write(bytes(64))
    expect_error(["verify", str(base["llama"]), str(hf)], tmp_path / "out", [hf],
                 f"the tensors end at data byte {data}, but the file holds {data + 64} data bytes")


def test_tied_config_with_a_head_of_its_own(base, tmp_path: Path) -> None:
    """Megatron keeps only the embedding of a tied model: a stored head must be an identical copy of it."""
    hf = copy(base["llama"], tmp_path / "hf")
    edit_json(hf / "config.json", lambda c: c.update(tie_word_embeddings=True))
    expect_error(["hf-to-mcore", str(hf), str(tmp_path / "out")], tmp_path / "out", [hf],
                 f"{shard_of(hf, 'lm_head.weight')}: lm_head.weight differs from model.embed_tokens.weight, but "
                 f"config.json says tie_word_embeddings=true, so Megatron would keep only the embedding")
    embed = load_file(shard_of(hf, "model.embed_tokens.weight"))["model.embed_tokens.weight"]
    edit_tensor(hf, "lm_head.weight", lambda t: embed.clone())  # an identical copy is fine
    rc, err = convert("hf-to-mcore", str(hf), str(tmp_path / "out"))
    assert rc == 0, err
    rc, err = convert("mcore-to-hf", str(tmp_path / "out"), str(tmp_path / "back"))
    assert rc == 0, err
    back = {k: v for f in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(back["model.embed_tokens.weight"], embed) and "lm_head.weight" not in back


def verify_cli(a: Path, b: Path) -> tuple[int, str, str]:
    """`mcorekit convert verify A B` in this process: (exit code, stdout, stderr)."""
    out, err = StringIO(), StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        rc = cli.main(["convert", "verify", str(a), str(b)])
    return rc, out.getvalue(), err.getvalue()


def add_tensor(hf: Path, name: str, t: torch.Tensor) -> None:
    """One more tensor in the embedding's shard and the index (as the FP8 export's 0-dim scales)."""
    shard = shard_of(hf, "model.embed_tokens.weight")
    save_file({**load_file(shard), name: t}, shard, {"format": "pt"})
    edit_json(hf / INDEX, lambda i: i["weight_map"].update({name: shard.name}))


def test_verify_compares_0_dim_tensors(base, tmp_path: Path) -> None:
    """A 0-dim tensor cannot be viewed as bytes: verify crashed (exit 1, the code of "differs")."""
    name = "model.layers.0.mlp.down_proj.weight_scale"
    a, b = copy(base["llama"], tmp_path / "a"), copy(base["llama"], tmp_path / "b")
    add_tensor(a, name, torch.tensor(0.5))
    add_tensor(b, name, torch.tensor(0.5))
    rc, out, err = verify_cli(a, b)
    assert (rc, err) == (0, "") and out.splitlines()[-1] == "verify: 40 of 40 tensors bitwise equal", out + err
    add_tensor(b, name, torch.tensor(0.25))
    rc, out, err = verify_cli(a, b)
    assert (rc, err) == (1, ""), out + err
    assert out.splitlines() == [f"different  {name}  1 elements differ in their bits, 1 as numbers "
                                f"(max |diff| 2.500e-01)", "verify: 39 of 40 tensors bitwise equal, 1 not"]


def test_verify_says_why_numerically_equal_tensors_differ(base, tmp_path: Path) -> None:
    """-0.0 vs 0.0 and NaNs with other payloads are different bits: exit 1 with a line that says so (it said
    "max |diff| 0.000e+00, 0 elements differ")."""
    name = "model.norm.weight"
    nan = torch.tensor([0x7FC0, 0x7FC1], dtype=torch.int16).view(torch.bfloat16)  # two NaN payloads
    a, b = copy(base["llama"], tmp_path / "a"), copy(base["llama"], tmp_path / "b")
    edit_tensor(a, name, lambda t: torch.cat([torch.tensor([0.0], dtype=t.dtype), nan[:1], t[2:]]))
    edit_tensor(b, name, lambda t: torch.cat([torch.tensor([-0.0], dtype=t.dtype), nan[1:], t[2:]]))
    rc, out, err = verify_cli(a, b)
    assert (rc, err) == (1, ""), out + err
    assert out.splitlines()[0] == (f"different  {name}  2 elements differ in their bits, all equal as numbers "
                                   f"(signed zeros or NaN payloads)")


@pytest.fixture(scope="module")
def carried_mtp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """DeepSeek-V3-tiny as conversions before commit 90d678a left it (read-only): the decoder converted, its MTP
    layer (model.layers.4.*) carried through as HF tensors in CKPT/mtp/; and the whole HF model ("hf")."""
    root = tmp_path_factory.mktemp("carried")
    decoder = make_family_model("deepseek_v3", root / "decoder")  # its config declares one MTP layer
    assert json.loads((decoder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    rc, err = convert("hf-to-mcore", str(decoder), str(root / "ckpt"))
    assert rc == 0, err
    hf = copy(decoder, root / "hf")
    mtp = add_mtp_layer(hf)
    (root / "ckpt/mtp").mkdir()
    save_file(mtp, root / "ckpt/mtp/model.safetensors", {"format": "pt"})
    shutil.copy(hf / "config.json", root / "ckpt/mtp/config.json")
    return {"ckpt": root / "ckpt", "hf": hf}


def test_carried_mtp_layer_comes_back(carried_mtp, tmp_path: Path) -> None:
    rc, err = convert("mcore-to-hf", str(carried_mtp["ckpt"]), str(tmp_path / "back"))
    assert rc == 0, err
    assert verify_cli(carried_mtp["hf"], tmp_path / "back")[0] == 0


@pytest.mark.parametrize("tensors, needle", [
    ({"model.layers.7.anything.weight": torch.zeros(4, dtype=torch.int32)},
     "'model.layers.7.anything.weight' is not a tensor of the model's multi-token-prediction layers (layer 4, "
     "num_nextn_predict_layers=1)"),
    ({"model.embed_tokens.scale": torch.zeros(4)},
     "'model.embed_tokens.scale' is not a tensor of the model's multi-token-prediction"),
    ({"model.layers.4.anything.weight": torch.zeros(4, dtype=torch.int32)},
     "model.layers.4.anything.weight is stored as torch.int32"),
    ({}, "holds MTP layer(s) none, but the config declares num_nextn_predict_layers=1 (layer 4)"),
], ids=["other-layer", "not-a-layer", "int32", "empty"])
def test_carried_mtp_folder_holds_only_the_mtp_layers(carried_mtp, tmp_path: Path, tensors: dict, needle: str) -> None:
    """Whatever lay in CKPT/mtp/ was copied into the HF output."""
    ckpt = copy(carried_mtp["ckpt"], tmp_path / "ckpt")
    file = ckpt / "mtp/model.safetensors"
    save_file({**(load_file(file) if tensors else {}), **tensors}, file, {"format": "pt"})
    expect_error(["mcore-to-hf", str(ckpt), str(tmp_path / "out")], tmp_path / "out", [ckpt], needle)


def test_mtp_folder_of_a_model_without_mtp_layers_is_not_read(base, tmp_path: Path) -> None:
    """Llama declares no MTP layers: an int32 `model.layers.7.anything.weight` in CKPT/mtp/ landed in its output."""
    ckpt = copy(base["ckpt"], tmp_path / "ckpt")
    (ckpt / "mtp").mkdir()
    save_file({"model.layers.7.anything.weight": torch.zeros(4, dtype=torch.int32)}, ckpt / "mtp/model.safetensors")
    shutil.copy(ckpt / "hf/config.json", ckpt / "mtp/config.json")
    rc, err = convert("mcore-to-hf", str(ckpt), str(tmp_path / "back"))
    assert rc == 0, err
    rc, out, err = verify_cli(base["llama"], tmp_path / "back")
    assert rc == 0, out + err
