"""Fault injection for `mcorekit export` and `mcorekit data` (CPU, real tiny models and tokenizers, nothing mocked).

Every bad input or fault must end with exit code 2, one stderr line (`mcorekit: error: ...`, or argparse's usage
error for a bad option value), no traceback, nothing at the output path, and the inputs byte-identical. Cases
are grouped by the kinds of issue 18: invalid values, exit 0 with a broken output, data loss through --force,
reads outside the model directory, tracebacks instead of messages, resource exhaustion, full and read-only
filesystems, and SIGKILL mid-write followed by a rerun.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tokenizer and model loads must never reach for the network

import transformers  # noqa: E402,F401  (imported here: import-time warnings stay out of the captured stderr)

import mcorekit.export.pipeline  # noqa: E402,F401
import mcorekit.train.data.preprocess  # noqa: E402,F401
from hf_models import WORDS, make_model, make_tokenizer  # noqa: E402
from mcorekit import cli  # noqa: E402
from mcorekit.errors import ConfigError  # noqa: E402
from mcorekit.outputs import MARKER  # noqa: E402


# ---------------------------------------------------------------- helpers


def run(*args: object) -> tuple[int, str]:
    """The real CLI in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli.main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors
            rc = int(e.code or 0)
    return rc, err.getvalue()


def fingerprint(*roots: Path) -> dict[str, str]:
    """sha256 of every file under the roots (links by their target): inputs must come out byte-identical."""
    out: dict[str, str] = {}
    for root in roots:
        for p in [root] if not root.is_dir() else [root, *sorted(root.rglob("*"))]:
            if p.is_symlink():
                out[str(p)] = "-> " + os.readlink(p)
            elif p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[str(p)] = "dir"
    return out


def assert_error(rc: int, err: str, needle: str, *absent: Path) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("mcorekit: error: "), err
    assert needle in lines[0], err
    for p in absent:
        assert not p.exists(), f"{p} exists after a failed run"


def assert_usage_error(rc: int, err: str, needle: str, *absent: Path) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert lines[0].startswith("usage: ") and ": error: argument " in lines[-1] and needle in lines[-1], err
    for p in absent:
        assert not p.exists(), f"{p} exists after a failed run"


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name or ".tmp" in p.name)


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A small tmpfs at path (root only); the test is skipped, with the reason, where mounting is not allowed."""
    path.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: read-only and full filesystems cannot be simulated")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({r.stderr.strip() or 'mount failed'}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "mcorekit", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def kill_when(proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """SIGKILL proc as soon as ready() holds (it is mid-write then); fail if it ends first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the command ended (exit {proc.returncode}) before {what}: nothing to kill")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (4 heads, 2 KV heads, 4 layers, vocab 250) in sharded safetensors."""
    return make_model("llama", tied=False, out=tmp_path_factory.mktemp("src") / "llama")


@pytest.fixture(scope="module")
def rank_files(hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engine") / "trt"
    rc, err = run("export", "trtllm", hf, out, "--target", "engine", "--tp", "2", "--quiet")
    assert rc == 0, err
    return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def corpus(path: Path, docs: int, seed: int = 0, words: int = 40) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n"
                            for _ in range(docs)))
    return path


def preprocess_args(inputs: list[Path], tok: Path, prefix: Path, *extra: str) -> list[object]:
    return ["data", "preprocess", *inputs, "--tokenizer", tok, "--output-prefix", prefix, "--workers", "1", "--quiet",
            *extra]


@pytest.fixture(scope="module")
def dataset(tok: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A preprocessed prefix (PREFIX.bin/.idx/.json) to corrupt."""
    d = tmp_path_factory.mktemp("ds")
    rc, err = run(*preprocess_args([corpus(d / "c.jsonl", 50)], tok, d / "c"))
    assert rc == 0, err
    return d / "c"


# ---------------------------------------------------------------- export: invalid values (parse time)


@pytest.mark.parametrize("args,needle", [
    (["--target", "pytorch", "--tp", "0"], "--tp"),
    (["--target", "pytorch", "--tp", "-1"], "--tp"),
    (["--target", "pytorch", "--pp", "0"], "--pp"),
    (["--target", "pytorch", "--ep", "-2"], "--ep"),
    (["--target", "engine", "--tp", "-1"], "--tp"),  # was: exit 0, no rank files, world_size -1
    (["--target", "engine", "--pp", "two"], "--pp"),
])
def test_export_parallel_sizes_below_one_are_usage_errors(hf: Path, tmp_path: Path, args: list[str], needle: str) -> None:
    before = fingerprint(hf)
    rc, err = run("export", "trtllm", hf, tmp_path / "out", *args, "--quiet")
    assert_usage_error(rc, err, needle, tmp_path / "out")
    assert fingerprint(hf) == before


@pytest.mark.parametrize("args,needle", [
    (["--target", "pytorch", "--tp", "3"], "TP=3 does not divide num_attention_heads=4"),  # was written to the yaml
    (["--target", "pytorch", "--pp", "3"], "PP=3 does not divide num_hidden_layers=4"),
    (["--target", "pytorch", "--ep", "2"], "EP=2 given for a dense model"),
    (["--target", "engine", "--tp", "8"], "TP=8 does not divide num_attention_heads=4"),
])
def test_export_layouts_that_do_not_fit_fail_for_both_targets(hf: Path, tmp_path: Path, args: list[str],
                                                                needle: str) -> None:
    before = fingerprint(hf)
    rc, err = run("export", "trtllm", hf, tmp_path / "out", *args, "--quiet")
    assert_error(rc, err, needle, tmp_path / "out")
    assert fingerprint(hf) == before and leftovers(tmp_path) == []


# ---------------------------------------------------------------- export: calibration data


@pytest.mark.parametrize("content,needle", [
    ('{"input_ids": [1, 2]}\n{"input_ids": [3, 250]}\n', "calib.jsonl:2: token id 250 is outside"),
    ('{"input_ids": [-1, 2]}\n', "calib.jsonl:1: token id -1 is outside"),
    ('{"input_ids": [1, 2]}\n\n{"input_ids": [1,\n', "calib.jsonl:3: not valid JSON"),
    (b'{"input_ids": [1, 2]}\n\xff\xfe\x00\x01binary\n', "calib.jsonl:2: not UTF-8"),
    ("[1, 2, 3]\n", "calib.jsonl:1: expected a JSON object"),
    ('{"input_ids": "1 2"}\n', "calib.jsonl:1: input_ids must be a non-empty list"),
    ('{"ids": [1]}\n', "calib.jsonl:1: each line needs 'input_ids' or 'text'"),
    ("[" * 100_000 + "\n", "calib.jsonl:1:"),
    ('{"input_ids": [' + "1" * 5000 + "]}\n", "calib.jsonl:1: not valid JSON (Exceeds the limit"),  # a traceback
])
def test_export_bad_calibration_data(hf: Path, tmp_path: Path, content: str | bytes, needle: str) -> None:
    calib = tmp_path / "calib.jsonl"
    calib.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = fingerprint(hf, calib)
    rc, err = run("export", "trtllm", hf, tmp_path / "out", "--target", "pytorch", "--fp8", "--calib", calib, "--quiet")
    assert_error(rc, err, needle, tmp_path / "out")
    assert fingerprint(hf, calib) == before and leftovers(tmp_path) == []


# ---------------------------------------------------------------- export: --force never deletes an input


@pytest.mark.parametrize("where", ["src", "inside src", "parent of src", "calibration file"])
def test_export_output_overlapping_an_input_is_refused_even_with_force(hf: Path, tmp_path: Path, where: str) -> None:
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"input_ids": [1, 2, 3]}\n')
    out = {"src": hf, "inside src": hf / "sub", "parent of src": hf.parent, "calibration file": calib}[where]
    before = fingerprint(hf.parent, calib)
    rc, err = run("export", "trtllm", hf, out, "--target", "pytorch", "--fp8", "--calib", calib, "--force", "--quiet")
    assert_error(rc, err, "overlaps the input")
    assert fingerprint(hf.parent, calib) == before and not (hf / "sub").exists()


def test_export_force_replaces_only_an_earlier_export(hf: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not an export")
    before = fingerprint(foreign)
    rc, err = run("export", "trtllm", hf, foreign, "--target", "pytorch", "--force", "--quiet")
    assert_error(rc, err, "not written by mcorekit")
    assert fingerprint(foreign) == before
    # an earlier export is replaced, and nothing is left beside it
    out = tmp_path / "out"
    for _ in range(2):
        rc, err = run("export", "trtllm", hf, out, "--target", "pytorch", "--force", "--quiet")
        assert rc == 0, err
    assert (out / MARKER).is_file() and leftovers(tmp_path) == []


def test_export_force_never_replaces_the_folder_its_hf_config_comes_from(hf: Path, tmp_path: Path) -> None:
    """A Megatron checkpoint without hf/ takes its config and tokenizer from the hf/ beside it: that folder is an
    input too, and OUT naming it is refused even with --force (it was replaced)."""
    ckpt = tmp_path / "run" / "ckpt"
    rc, err = run("convert", "hf-to-mcore", hf, ckpt, "--quiet")
    assert rc == 0, err
    shutil.rmtree(ckpt / "hf", ignore_errors=True)
    shutil.copytree(hf, tmp_path / "run" / "hf")
    (tmp_path / "run" / "hf" / "my_notes.txt").write_text("mine")
    before = fingerprint(tmp_path / "run" / "hf")
    rc, err = run("export", "trtllm", ckpt, tmp_path / "run" / "hf", "--target", "pytorch", "--force", "--quiet")
    assert_error(rc, err, "overlaps the input")
    assert fingerprint(tmp_path / "run" / "hf") == before


def test_export_calibration_data_without_fp8_is_refused(hf: Path, tmp_path: Path) -> None:
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"input_ids": [1, 999]}\n')  # never read: refused before
    rc, err = run("export", "trtllm", hf, tmp_path / "out", "--target", "pytorch", "--calib", calib, "--quiet")
    assert_error(rc, err, "--calib is the FP8 calibration data: add --fp8", tmp_path / "out")


# ---------------------------------------------------------------- export: malformed inputs, reads outside the model


def broken_copy(hf: Path, tmp_path: Path) -> Path:
    src = tmp_path / "model"
    shutil.copytree(hf, src)
    return src


def test_export_source_config_not_json(hf: Path, tmp_path: Path) -> None:
    src = broken_copy(hf, tmp_path)
    (src / "config.json").write_text('{"model_type": "llama", ')
    before = fingerprint(src)
    rc, err = run("export", "trtllm", src, tmp_path / "out", "--target", "engine", "--quiet")
    assert_error(rc, err, "config.json", tmp_path / "out")
    assert fingerprint(src) == before


def rewrite_tensor(src: Path, name: str, change: Callable[[dict], None]) -> None:
    """Load the shard holding `name`, let `change` edit its tensors (dict), save it back."""
    from safetensors.torch import load_file, save_file

    shard = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.parametrize("damage,needle", [
    ("extra tensor", "have no Megatron counterpart"),
    ("integer head", "lm_head.weight"),
    ("transposed k_proj", "model.layers.0.self_attn.k_proj.weight"),
    ("config with more layers", "num_hidden_layers"),
])
def test_export_from_hf_checks_the_weights_against_the_config(hf: Path, tmp_path: Path, damage: str,
                                                              needle: str) -> None:
    """An HF source is checked as hf-to-mcore checks it: these were exported (exit 0: the extra tensor copied, the
    integer head kept or cast, the config's layer count written out) or failed with a traceback (the engine
    target's concatenation of a transposed k_proj)."""
    import torch

    src = broken_copy(hf, tmp_path)
    if damage == "extra tensor":
        rewrite_tensor(src, "model.norm.weight", lambda t: t.update({"model.layers.0.foo.weight": torch.ones(4)}))
    elif damage == "integer head":
        head = "lm_head.weight"
        rewrite_tensor(src, head, lambda t: t.update({head: t[head].to(torch.int16)}))
    elif damage == "transposed k_proj":
        key = "model.layers.0.self_attn.k_proj.weight"
        rewrite_tensor(src, key, lambda t: t.update({key: t[key].t().contiguous()}))
    else:
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8}))
    before = fingerprint(src)
    for target in ("pytorch", "engine"):
        rc, err = run("export", "trtllm", src, tmp_path / target, "--target", target, "--quiet")
        assert_error(rc, err, needle, tmp_path / target)
    assert fingerprint(src) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("escape", ["relative", "absolute"])
def test_export_index_naming_a_file_outside_the_model_is_refused(hf: Path, tmp_path: Path, escape: str) -> None:
    src = broken_copy(hf, tmp_path)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    outside = tmp_path / "outside.safetensors"
    shutil.copy(src / shard, outside)
    name = "../outside.safetensors" if escape == "relative" else str(outside)
    index["weight_map"] = {k: (name if v == shard else v) for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    before = fingerprint(src, outside)
    for target in ("pytorch", "engine"):
        rc, err = run("export", "trtllm", src, tmp_path / "out", "--target", target, "--quiet")
        assert_error(rc, err, "outside.safetensors", tmp_path / "out")
    assert fingerprint(src, outside) == before


@pytest.mark.parametrize("damage,needle", [
    ("invalid json", "config.json: not valid JSON"),
    ("integer too long", "config.json: not valid JSON (Exceeds the limit"),  # was a traceback
    ("not an object", "no 'mapping' object"),
    ("world_size -1", "world_size=-1"),
    ("world_size text", "world_size='2'"),
    ("rank missing", "missing rank1.safetensors"),
    ("no config", "no config.json"),
])
def test_engine_build_checkpoint_damage(rank_files: Path, tmp_path: Path, damage: str, needle: str) -> None:
    ckpt = tmp_path / "trt"
    shutil.copytree(rank_files, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    if damage == "invalid json":
        (ckpt / "config.json").write_text('{"mapping": {')
    elif damage == "integer too long":
        (ckpt / "config.json").write_text('{"mapping": {"world_size": ' + "9" * 5000 + "}}")
    elif damage == "not an object":
        (ckpt / "config.json").write_text("[1, 2]")
    elif damage.startswith("world_size"):
        cfg["mapping"]["world_size"] = -1 if damage.endswith("-1") else "2"
        (ckpt / "config.json").write_text(json.dumps(cfg))
    elif damage == "rank missing":
        (ckpt / "rank1.safetensors").unlink()
    else:
        (ckpt / "config.json").unlink()
    before = fingerprint(ckpt)
    rc, err = run("export", "engine", ckpt, tmp_path / "engine")
    assert_error(rc, err, needle, tmp_path / "engine")
    assert fingerprint(ckpt) == before


@pytest.mark.parametrize("args,usage,needle", [
    (["--max-batch-size", "0"], True, "--max-batch-size"),
    (["--max-seq-len", "-4096"], True, "--max-seq-len"),
    (["--max-input-len", "5000", "--max-seq-len", "4096"], False, "exceeds --max-seq-len"),
])
def test_engine_build_options(rank_files: Path, tmp_path: Path, args: list[str], usage: bool, needle: str) -> None:
    rc, err = run("export", "engine", rank_files, tmp_path / "engine", *args)
    (assert_usage_error if usage else assert_error)(rc, err, needle, tmp_path / "engine")


def test_engine_build_output_inside_the_checkpoint_is_refused(rank_files: Path) -> None:
    before = fingerprint(rank_files)
    for out in (rank_files, rank_files / "engine", rank_files.parent):
        rc, err = run("export", "engine", rank_files, out, "--force")
        assert_error(rc, err, "overlaps the input")
    assert fingerprint(rank_files) == before


# ---------------------------------------------------------------- export: read-only and full filesystems


def test_export_to_a_read_only_filesystem(hf: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        for out in (ro / "out", ro / "sub" / "out"):
            rc, err = run("export", "trtllm", hf, out, "--target", "pytorch", "--quiet")
            assert_error(rc, err, "Read-only file system", out)
        assert list(ro.iterdir()) == []


def test_export_to_a_full_filesystem(hf: Path, tmp_path: Path) -> None:
    before = fingerprint(hf)
    with tmpfs(tmp_path / "small", "size=256k") as small:  # the fp32 export needs ~0.7 MB
        for target in ("pytorch", "engine"):
            rc, err = run("export", "trtllm", hf, small / "out", "--target", target, "--dtype", "fp32", "--quiet")
            assert_error(rc, err, "No space left on device", small / "out")
            assert list(small.iterdir()) == []
    assert fingerprint(hf) == before


# ---------------------------------------------------------------- export: SIGKILL mid-write, then a rerun


def test_export_killed_mid_write_then_rerun(hf: Path, tmp_path: Path) -> None:
    """A Megatron source: converted to HF inside the staged output, so the kill lands while files are written
    there; the rerun removes the dead run's stage and completes."""
    from mcorekit.convert.pipeline import hf_to_mcore

    mcore = tmp_path / "mcore"
    hf_to_mcore(hf, mcore, quiet=True)
    before = fingerprint(mcore)
    out = tmp_path / "exports" / "out"
    out.parent.mkdir()
    proc = spawn("export", "trtllm", str(mcore), str(out), "--target", "pytorch", "--quiet")
    stage = out.parent / f".out.partial-{proc.pid}@{socket.gethostname()}"
    kill_when(proc, lambda: stage.is_dir() and any(p.is_file() for p in stage.rglob("*")), "the export wrote a file")
    assert not out.exists() and stage.exists()  # nothing complete-looking; the dead run's stage is still there
    rc, err = run("export", "trtllm", mcore, out, "--target", "pytorch", "--quiet")
    assert rc == 0, err
    assert (out / MARKER).is_file() and (out / "model.safetensors.index.json").is_file()
    assert leftovers(out.parent) == [] and not (out / ".source-hf").exists()
    assert fingerprint(mcore) == before


# ---------------------------------------------------------------- data preprocess: invalid values


@pytest.mark.parametrize("args,needle", [
    (["--workers", "-1"], "--workers"),  # was a traceback
    (["--workers", "0"], "--workers"),
    (["--max-line-mb", "0"], "--max-line-mb"),
])
def test_preprocess_bad_option_values(tok: Path, tmp_path: Path, args: list[str], needle: str) -> None:
    src = corpus(tmp_path / "a.jsonl", 3)
    rc, err = run(*preprocess_args([src], tok, tmp_path / "a"), *args)
    assert_usage_error(rc, err, needle, tmp_path / "a.bin", tmp_path / "a.idx", tmp_path / "a.json")


def test_preprocess_refuses_more_workers_than_cores(tok: Path, tmp_path: Path) -> None:
    """--workers 100000 started that many tokenizer processes (each holds a tokenizer) until memory ran out; one more
    than the cores is refused as well (without the refusal it would run: this test does not start 100000)."""
    src = corpus(tmp_path / "a.jsonl", 3)
    cores = len(os.sched_getaffinity(0))
    rc, err = run(*preprocess_args([src], tok, tmp_path / "a"), "--workers", str(cores + 1))
    assert_error(rc, err, f"workers={cores + 1}: more than the {cores} cores this process may use; give at most "
                          f"{cores}", tmp_path / "a.bin", tmp_path / "a.idx", tmp_path / "a.json")


# ---------------------------------------------------------------- data preprocess: malformed input


@pytest.mark.parametrize("content,needle", [
    (b'{"text": "hello"}\n\xff\xfe\x00binary\n', "in.jsonl:2: not UTF-8"),  # was UnicodeDecodeError
    ('{"text": "hello"}\n{"body": "no text key"}\n', "in.jsonl:2: not a JSON object with a 'text' string"),
    ('{"text": "hello"}\n"just a string"\n', "in.jsonl:2: expected a JSON object"),
    ('{"text": "a pair \\ud83d\\ude00", "meta": "lone \\udc00 elsewhere"}\n{"text": "hello \\ud800 world"}\n',
     "in.jsonl:2: field 'text' holds a lone UTF-16 surrogate"),
    ('{"text": "hello"}\n[1, 2]\n', "in.jsonl:2: expected a JSON object"),
    ('{"text": "hello"\n', "in.jsonl:1: not valid JSON"),
    ('{"text": "hello"}\n\n\n{"text": 7}\n', "in.jsonl:4: field 'text' is int"),  # blank lines keep numbering exact
    ("[" * 100_000 + "\n", "in.jsonl:1: not valid JSON"),
    ('{"text": ' + "1" * 5000 + "}\n", "in.jsonl:1: not valid JSON (Exceeds the limit (4300 digits)"),  # a traceback
    ("\n\n", "no documents"),
])
def test_preprocess_malformed_jsonl(tok: Path, tmp_path: Path, content: str | bytes, needle: str) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = fingerprint(src, tok)
    rc, err = run(*preprocess_args([src], tok, tmp_path / "out" / "p"))
    assert_error(rc, err, needle)
    assert fingerprint(src, tok) == before
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("kind,needle", [
    ("empty", "not an HF tokenizer directory"),
    ("corrupt", "not a usable HF tokenizer directory"),
    ("missing", "tokenizer not found"),
])
def test_preprocess_tokenizer_that_is_not_one(tmp_path: Path, kind: str, needle: str) -> None:
    src = corpus(tmp_path / "a.jsonl", 3)
    bad = tmp_path / "tok"
    if kind != "missing":
        bad.mkdir()
    if kind == "corrupt":
        (bad / "tokenizer.json").write_text('{"version": ')
    rc, err = run(*preprocess_args([src], bad, tmp_path / "a"))
    assert_error(rc, err, needle, tmp_path / "a.bin", tmp_path / "a.idx", tmp_path / "a.json")


def tokenizer_with_its_own_code(tok: Path, folder: Path, marker: Path) -> Path:
    """A copy of `tok` whose tokenizer_config.json asks transformers to import evil.py, which writes `marker`."""
    shutil.copytree(tok, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTok", auto_map={"AutoTokenizer": [None, "evil.EvilTok"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                    "from transformers import PreTrainedTokenizerFast as EvilTok\n")
    return folder


@pytest.mark.parametrize("reader", ["data preprocess", "train data", "export calibration"])
def test_no_reader_runs_a_tokenizer_folders_own_code(tok: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     reader: str) -> None:
    """transformers asks on stdin before it runs a folder's code: a user who answers yes (here every prompt is
    answered "y") must still get an error, with the code not run."""
    from mcorekit.errors import ExportError
    from mcorekit.export.fp8 import _tokenizer
    from mcorekit.train.data.tokenizer import load_tokenizer

    marker = tmp_path / "ran"
    evil = tokenizer_with_its_own_code(tok, tmp_path / "evil-tok", marker)
    monkeypatch.setattr("builtins.input", lambda *_: "y")
    if reader == "data preprocess":
        rc, err = run(*preprocess_args([corpus(tmp_path / "a.jsonl", 3)], evil, tmp_path / "a"))
        assert_error(rc, err, "contains custom code", tmp_path / "a.bin")
    else:
        with pytest.raises(ConfigError if reader == "train data" else ExportError, match="custom code"):
            load_tokenizer(str(evil)) if reader == "train data" else _tokenizer(evil)
    assert not marker.exists()


@pytest.mark.parametrize("model_type", ["llama", "evil_arch"])
@pytest.mark.parametrize("reader", ["export calibration", "convert logits"])
def test_no_reader_runs_a_model_folders_own_code(hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 reader: str, model_type: str) -> None:
    """A config.json whose auto_map points at the folder's own module: transformers' own class for a type it knows,
    an error for one it does not; the module never runs (every prompt answered "y")."""
    from mcorekit.convert.logits import hf_logits
    from mcorekit.errors import ExportError
    from mcorekit.export.fp8 import calibrate

    marker, folder = tmp_path / "ran", tmp_path / "evil-model"
    shutil.copytree(hf, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "evil.EvilConfig",
                                                   "AutoModelForCausalLM": "evil.EvilModel"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                    "from transformers import LlamaConfig as EvilConfig\n"
                                    "from transformers import LlamaForCausalLM as EvilModel\n")
    monkeypatch.setattr("builtins.input", lambda *_: "y")
    import torch

    ids = torch.tensor([[1, 2, 3]])
    if model_type == "llama":  # loads with transformers' own Llama (hf_logits then asks for CUDA: not here)
        if reader == "export calibration":
            assert calibrate(folder, [ids])
        else:
            with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA"):
                hf_logits(folder, ids)
    else:
        error = ExportError if reader == "export calibration" else ValueError
        with pytest.raises(error, match="custom code|trust_remote_code"):
            calibrate(folder, [ids]) if reader == "export calibration" else hf_logits(folder, ids)
    assert not marker.exists()


def test_preprocess_input_that_is_a_folder(tok: Path, tmp_path: Path) -> None:
    corpus(tmp_path / "a.jsonl", 3)
    rc, err = run(*preprocess_args([tmp_path], tok, tmp_path / "out" / "p"))
    assert_error(rc, err, f"input {tmp_path} is a folder; give its .jsonl files", tmp_path / "out")  # "not found"


def test_preprocess_input_that_cannot_be_read_is_named(tok: Path, tmp_path: Path) -> None:
    """/proc/self/mem opens but fails the first read (EIO), with no file name on the error: it was reported as the
    output's ("cannot write p.{bin,idx,json}")."""
    rc, err = run(*preprocess_args([Path("/proc/self/mem")], tok, tmp_path / "p"))
    assert_error(rc, err, "/proc/self/mem: cannot read line 1: Input/output error", tmp_path / "p.bin")


def test_preprocess_refuses_a_line_over_the_limit_before_reading_it(tok: Path, tmp_path: Path) -> None:
    src = tmp_path / "long.jsonl"
    src.write_text('{"text": "hello"}\n' + json.dumps({"text": "word " * 300_000}) + "\n")  # 1.5 MB line
    rc, err = run(*preprocess_args([src], tok, tmp_path / "p", "--max-line-mb", "1"))
    assert_error(rc, err, "long.jsonl:2: line longer than 1 MB", tmp_path / "p.bin", tmp_path / "p.idx")
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------- data preprocess: --force and inputs


def test_preprocess_output_prefix_naming_an_input_is_refused_even_with_force(tok: Path, tmp_path: Path) -> None:
    src = corpus(tmp_path / "c.json", 5)  # PREFIX.json of prefix "c" is the input itself
    before = fingerprint(tmp_path, tok)
    for extra in ([], ["--force"]):
        rc, err = run(*preprocess_args([src], tok, tmp_path / "c", *extra))
        assert_error(rc, err, "is an input file", tmp_path / "c.bin", tmp_path / "c.idx")
    rc, err = run(*preprocess_args([src], tok, tok / "tokenizer", "--force"))  # tokenizer.json would be replaced
    assert_error(rc, err, "inside the tokenizer directory")
    assert fingerprint(tmp_path, tok) == before


@pytest.mark.parametrize("foreign", ["bin only", "json not a side-car", "json with an integer too long to read"])
def test_preprocess_force_never_replaces_unknown_files(tok: Path, tmp_path: Path, foreign: str) -> None:
    src = corpus(tmp_path / "a.jsonl", 5)
    if foreign == "bin only":
        (tmp_path / "p.bin").write_bytes(b"someone else's data")
    elif foreign == "json not a side-car":
        (tmp_path / "p.json").write_text('{"eod": 2}')
    else:  # was a traceback
        (tmp_path / "p.json").write_text('{"eod": ' + "2" * 5000 + "}")
    before = fingerprint(tmp_path)
    rc, err = run(*preprocess_args([src], tok, tmp_path / "p"))
    assert_error(rc, err, "pass --force")
    rc, err = run(*preprocess_args([src], tok, tmp_path / "p", "--force"))
    assert_error(rc, err, "not a side-car written by `mcorekit data preprocess`", tmp_path / "p.idx")
    assert fingerprint(tmp_path) == before


def test_preprocess_prefix_naming_a_folder_is_refused(tok: Path, tmp_path: Path) -> None:
    src = corpus(tmp_path / "a.jsonl", 3)
    rc, err = run(*preprocess_args([src], tok, f"{tmp_path}/out/"))
    assert_error(rc, err, "names a folder", tmp_path / "out")


def test_preprocess_force_replaces_an_earlier_output(tok: Path, tmp_path: Path) -> None:
    src = corpus(tmp_path / "a.jsonl", 5)
    rc, err = run(*preprocess_args([src], tok, tmp_path / "p"))
    assert rc == 0, err
    corpus(src, 7, seed=1)
    rc, err = run(*preprocess_args([src], tok, tmp_path / "p", "--force"))
    assert rc == 0, err
    assert json.loads((tmp_path / "p.json").read_text())["documents"] == 7 and leftovers(tmp_path) == []


# ---------------------------------------------------------------- data preprocess: filesystems and SIGKILL


def test_preprocess_to_read_only_and_full_filesystems(tok: Path, tmp_path: Path) -> None:
    src = corpus(tmp_path / "a.jsonl", 3000)  # ~240 KB of uint16 tokens
    before = fingerprint(src, tok)
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        for prefix in (ro / "p", ro / "sub" / "p"):
            rc, err = run(*preprocess_args([src], tok, prefix))
            assert_error(rc, err, "Read-only file system")
        assert list(ro.iterdir()) == []
    with tmpfs(tmp_path / "small", "size=64k") as small:
        rc, err = run(*preprocess_args([src], tok, small / "p"))
        assert_error(rc, err, "No space left on device")
        assert list(small.iterdir()) == []
    assert fingerprint(src, tok) == before


def test_preprocess_killed_mid_write_then_rerun(tok: Path, tmp_path: Path) -> None:
    src = corpus(tmp_path / "big.jsonl", 30_000, words=50)  # ~1.5M tokens: seconds of writing
    out = tmp_path / "out"
    out.mkdir()
    proc = spawn("data", "preprocess", str(src), "--tokenizer", str(tok), "--output-prefix", str(out / "p"),
                 "--workers", "1", "--quiet")
    partial = out / f"p.bin.tmp-{proc.pid}"
    kill_when(proc, lambda: partial.is_file() and partial.stat().st_size > 0, "preprocess wrote tokens")
    assert not (out / "p.idx").exists() and not (out / "p.bin").exists()  # nothing complete-looking
    rc, err = run(*preprocess_args([src], tok, out / "p"))
    assert rc == 0, err
    assert leftovers(out) == [] and sorted(p.name for p in out.iterdir()) == ["p.bin", "p.idx", "p.json"]
    assert json.loads((out / "p.json").read_text())["documents"] == 30_000


# ---------------------------------------------------------------- reading datasets: .idx/.bin/.json and SFT jsonl


@pytest.mark.parametrize("damage,needle", [
    ("idx cut to 20 bytes", ".idx: truncated"),
    ("idx cut short", ".idx: truncated or corrupt"),
    ("idx foreign", ".idx: not a Megatron indexed-dataset index"),
    ("bin cut short", ".bin: "),
    ("bin longer than its index", "(truncated, or the pair does not belong together)"),  # an .idx of a smaller set
    ("idx with no documents", ".idx: holds no documents"),  # Megatron's reader: an mmap traceback
    # the middle of the index, which Megatron's reader trusts: a traceback at the step that first read the document
    ("a length negative", ".idx: sequence 7 has length -5 at byte"),
    ("a length too long", ".idx: sequence 8 has length"),  # the next sequence starts inside this one
    ("an offset past the end", ".idx: sequence 7 has length"),
    ("the document index short of the sequences", ".idx: its document index ends at sequence"),
    ("the document index falling", ".idx: its document index does not rise from 0"),
    ("float tokens", ".idx: token dtype code 7 is not an integer type"),
    ("json invalid", ".json: not a valid JSON side-car"),
    ("json integer too long", ".json: not a valid JSON side-car (ValueError)"),  # was a traceback
    ("json without eod", ".json: eod missing or not an integer"),
    ("json a list", ".json: expected a JSON object"),
])
def test_indexed_dataset_damage_is_one_line_naming_the_file(dataset: Path, tmp_path: Path, damage: str,
                                                            needle: str) -> None:
    from mcorekit.train.data.indexed import build_gpt_dataset

    prefix = tmp_path / "c"
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(str(dataset) + ext, str(prefix) + ext)
    idx, bin_, meta = (Path(str(prefix) + e) for e in (".idx", ".bin", ".json"))
    if damage == "idx cut to 20 bytes":
        idx.write_bytes(idx.read_bytes()[:20])
    elif damage == "idx cut short":
        idx.write_bytes(idx.read_bytes()[:-12])
    elif damage == "idx foreign":
        idx.write_bytes(b"NOTANIDX!" + idx.read_bytes()[9:])
    elif damage == "bin cut short":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif damage == "bin longer than its index":
        bin_.write_bytes(bin_.read_bytes() + bytes(64))
    elif damage == "idx with no documents":
        from mcorekit.train.data.indexed import HEAD, INDEX_HEADER

        code = HEAD.unpack(idx.read_bytes()[:HEAD.size])[2]
        idx.write_bytes(HEAD.pack(INDEX_HEADER, 1, code, 0, 1) + bytes(8))  # no sequences, the document index [0]
        bin_.write_bytes(b"")
    elif damage.startswith(("a length", "an offset", "the document index", "float")):
        from mcorekit.train.data.indexed import HEAD

        _, _, code, sequences, documents = HEAD.unpack(idx.read_bytes()[:HEAD.size])
        lengths = np.memmap(idx, np.int32, "r+", HEAD.size, (sequences,))
        offsets = np.memmap(idx, np.int64, "r+", HEAD.size + sequences * 4, (sequences,))
        starts = np.memmap(idx, np.int64, "r+", HEAD.size + sequences * 12, (documents,))
        if damage == "a length negative":
            lengths[7] = -5
        elif damage == "a length too long":
            lengths[7] += 1000
        elif damage == "an offset past the end":
            offsets[7] = 10**9
        elif damage == "the document index short of the sequences":
            starts[-1] -= 1
        elif damage == "the document index falling":
            starts[3] = 1
        else:
            idx.write_bytes(idx.read_bytes()[:HEAD.size - 17] + bytes([7]) + idx.read_bytes()[HEAD.size - 16:])
        for a in (lengths, offsets, starts):
            a.flush()
    elif damage == "json invalid":
        meta.write_text('{"eod": ')
    elif damage == "json integer too long":
        meta.write_text('{"eod": ' + "2" * 5000 + "}")
    elif damage == "json without eod":
        meta.write_text('{"vocab_size": 200}')
    else:
        meta.write_text("[2, 200]")
    with pytest.raises(ConfigError) as e:
        build_gpt_dataset([str(prefix)], None, 32, 10, 1, tmp_path / "cache", None, 256)
    message = str(e.value)
    assert message.startswith(str(prefix)) and needle in message and "\n" not in message, message


@pytest.mark.parametrize("content,needle", [
    (b'{"prompt": "a", "response": "b"}\n\xff\xfe\x00\n', "sft.jsonl:2: not UTF-8"),
    ('{"prompt": "a", "response": "b"}\n[1]\n', "sft.jsonl:2: expected a JSON object"),
    ('{"messages": [{"role": "user"}, "hello"]}\n', "sft.jsonl:1: 'messages' must be a list"),
    ('{"messages": "hello"}\n', "sft.jsonl:1: 'messages' must be a list"),
    ('{"prompt": null, "response": 5}\n', "sft.jsonl:1: 'prompt', 'response' must be text, got NoneType, int"),
    ('{"prompt": "a \\ud800", "response": "b"}\n', "sft.jsonl:1: holds a lone UTF-16 surrogate escape"),  # TypeError
    ('{"messages": ' + "[" * 800 + "]" * 800 + "}\n", "sft.jsonl:1: 'messages' must be a list"),  # no RecursionError
    ('{"instruction": "a", "output": "b", "input": 3}\n', "sft.jsonl:1: 'input' must be text, got int"),
])
def test_sft_jsonl_damage_is_one_line_naming_the_file(tok: Path, tmp_path: Path, content: str | bytes,
                                                      needle: str) -> None:
    from mcorekit.train.data.sft import SFTDataset

    path = tmp_path / "sft.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as e:
        SFTDataset([str(path)], str(tok), 64, 0, False, 256)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a usable HF tokenizer directory"):
        SFTDataset([str(path)], str(tmp_path / "empty"), 64, 0, False, 256)


def test_sft_examples_skipped_are_counted_with_the_reason(tok: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """ShareGPT roles (human/gpt) give no assistant turn: such examples were dropped without a word, and the
    truncation warning counted against the kept examples ("3 of 1")."""
    from mcorekit.train.data.sft import SFTDataset

    path = tmp_path / "sft.jsonl"
    gpt = [{"role": "human", "content": "hello"}, {"role": "gpt", "content": "answer"}]
    lines = [{"messages": gpt}] * 2 + [{"prompt": "the " * 40, "response": "yes", "input": 3},  # input: not read
                                       {"prompt": "hello", "response": "the " * 40}, {"prompt": "a", "response": "b"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with caplog.at_level("WARNING"):
        ds = SFTDataset([str(path)], str(tok), 16, 0, False, 256)
    assert len(ds.examples) == 2
    assert "2 of 5 SFT examples have no response to learn and were skipped (roles seen: gpt, human; the loss is on " \
           "'assistant' turns)" in caplog.text
    assert "2 of 5 SFT examples were longer than seq_length=16 and were truncated (1 of them kept no response and " \
           "were skipped)" in caplog.text
