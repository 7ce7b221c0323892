"""Fault injection for launch, status, logs and cancel (issue 18): bad inputs built here, each asserting the exit
code, the single error line, no traceback, nothing submitted or written, and inputs byte-identical afterwards.

CPU tests run the CLI in-process (`mcorekit.cli.main`); the `slurm` tests run it as a process against the dev
cluster, with this project's jobs submitted through the API and a foreign job through plain sbatch.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
import tracemalloc
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import cloudpickle
import pytest
import yaml

from mcorekit.cli import main
from mcorekit.config.experiment import Experiment
from mcorekit.config.loading import MAX_YAML_BYTES, YamlLimitError, apply_overrides
from mcorekit.errors import ConfigError, LaunchError
from mcorekit.launch import accounting, api, jobs_cli
from mcorekit.launch.submit import REGISTRY, record

# Payloads defined here travel by value: the job's Python need not import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "llama-tiny.yaml"


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_main(*args: str | Path) -> Result:
    """`mcorekit ARGS` in this process: its exit code (argparse's too) and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = int(e.code or 0)
    return Result(code, out.getvalue(), err.getvalue())


def run_cli(*args: str | Path, timeout: float = 60) -> Result:
    """`mcorekit ARGS` as its own process, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "mcorekit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def one_error(r: Result, *fragments: str) -> str:
    """Exit 2 and exactly one stderr line, `mcorekit: error: ...`, holding every fragment."""
    assert "Traceback" not in r.err, r.err
    lines = [ln for ln in r.err.splitlines() if not ln.startswith("mcorekit: warning: ")]
    assert r.code == 2 and len(lines) == 1 and lines[0].startswith("mcorekit: error: "), (r.code, r.err)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def usage_error(r: Result, option: str) -> None:
    """argparse refused the value: exit 2, its usage text, and one error line naming the option."""
    assert "Traceback" not in r.err, r.err
    assert r.code == 2, (r.code, r.err)
    assert re.match(rf"mcorekit [a-z ]+: error: argument {re.escape(option)}: ", r.err.strip().splitlines()[-1]), r.err


def snapshot(*roots: Path) -> dict[str, bytes]:
    """Every file under roots with its bytes: equal before and after means nothing was changed or added."""
    files = {}
    for root in roots:
        for p in [root] if root.is_file() else sorted(root.rglob("*")):
            if p.is_file():
                files[str(p)] = p.read_bytes()
    return files


def write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def laughs(levels: int = 9, width: int = 9, indent: str = "      ") -> list[str]:
    """A 'billion laughs' mapping: each level an anchored list of `width` aliases of the level below
    (9 x 9: 72 aliases, 9**9 values once expanded)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return [indent + ln for ln in lines]


def experiment_with(extra: list[str]) -> str:
    return "\n".join(["name: bomb", "model:", "  preset: llama-tiny", "  overrides:", "    extra:", *extra]) + "\n"


# ---------------------------------------------------------------- resource exhaustion: YAML size and aliases

YAML_LIMIT_CASES = {
    "billion laughs": (experiment_with(laughs()), "more than 100,000 values once its aliases"),
    "many aliases": (experiment_with(["      a: &a 1", f"      b: [{', '.join(['*a'] * 101)}]"]), "more than 100 aliases"),
    "recursive alias": (experiment_with(["      a: &a [*a]"]), "recursive"),
    "deep nesting": (experiment_with(["      a: " + "[" * 100 + "]" * 100]), "nested more than 64 levels"),
    "over 1 MB": ("name: big\n" + "#" * (MAX_YAML_BYTES + 10) + "\n", "larger than 1,000,000 bytes"),
}


@pytest.mark.parametrize("case", sorted(YAML_LIMIT_CASES))
def test_yaml_over_the_limits_is_refused_quickly(tmp_path: Path, case: str) -> None:
    text, expected = YAML_LIMIT_CASES[case]
    cfg = write(tmp_path / "exp.yaml", text)
    before = snapshot(tmp_path)
    start = time.monotonic()
    r = run_cli("launch", "--config", cfg, "--dry-run", "--set", f"run_root={tmp_path / 'runs'}", timeout=30)
    elapsed = time.monotonic() - start
    one_error(r, f"{cfg}: ", expected)
    assert elapsed < 2.0, f"{case}: {elapsed:.1f} s"
    assert snapshot(tmp_path) == before


def test_yaml_limits_apply_to_command_line_values(tmp_path: Path) -> None:
    flow = "{" + ", ".join(ln.strip() for ln in laughs()) + "}"
    start = time.monotonic()
    r = run_main("launch", "--config", TINY, "--dry-run", f"model.overrides={{extra: {flow}}}")
    one_error(r, "override 'model.overrides'", "more than 100,000 values")
    r = run_main("launch", "--config", TINY, "--dry-run", "--set", f"setup=[{flow}]")
    one_error(r, "override 'setup'", "more than 100,000 values")
    r = run_main("launch", "sweep", "--config", TINY, "--dry-run", "--grid", "optimizer.lr=&a [*a]")
    one_error(r, "sweep axis 'optimizer.lr'", "recursive")
    assert time.monotonic() - start < 2.0
    # Longer than one argv string may be (128 KiB), so through the API that the CLI calls.
    with pytest.raises(YamlLimitError, match="YAML above 1,000,000 is refused"):
        apply_overrides({}, ["name=" + "x" * (MAX_YAML_BYTES + 1)], Experiment)


# ---------------------------------------------------------------- traceback instead of a message: malformed files

BAD_EXPERIMENTS = {
    "invalid YAML": (b"name: x\nparallel: [1\n", "not valid YAML: line 3, column 1"),
    "list at top level": (b"- name: x\n", "expected a mapping (`key: value` lines) at the top level, got a list"),
    "text at top level": (b"just some words\n", "at the top level, got a str"),
    "empty file": (b"", "is empty"),
    "binary": (bytes(range(256)) * 8, "contains NUL bytes, so it is not a text file"),
    "not UTF-8": ("name: caf\u00e9\n".encode("latin-1"), "not UTF-8 text (byte 9)"),
    "unknown key": (b"name: x\nmodel: {preset: llama-tiny}\nschedul: {}\n", "unknown key 'schedul'; did you mean 'schedule'?"),
    "key given twice": (b"name: x\nmodel: {preset: llama-tiny}\nparallel:\n  tp: 2\n  tp: 1\n",
                        "key 'tp' is given twice (lines 4 and 5); keep one"),
    "section of wrong type": (b"name: x\nmodel: {preset: llama-tiny}\nschedule: 5\n", "schedule: Input should be a valid dictionary"),
    "time not a Slurm time": (b"name: x\nmodel: {preset: llama-tiny}\nresources: {time: soon}\n", "resources.time: time 'soon' is not a Slurm time"),
    "beta out of range": (b"name: x\nmodel: {preset: llama-tiny}\noptimizer: {adam_beta1: 1.5}\n", "optimizer.adam_beta1: Input should be less than 1"),
    "NaN learning rate": (b"name: x\nmodel: {preset: llama-tiny}\noptimizer: {lr: .nan}\n", "optimizer.lr: Input should be a finite number"),
    "negative seed": (b"name: x\nmodel: {preset: llama-tiny}\ndata: {seed: -1}\n", "data.seed: Input should be greater than or equal to 0"),
    "model field of wrong type": (b"name: x\nmodel: {preset: llama-tiny, overrides: {num_layers: four}}\n",
                                  "invalid model: model num_layers='four' must be a whole number from 1 to 2,147,"),
    "model field out of range": (b"name: x\nmodel: {preset: llama-tiny, overrides: {num_attention_heads: 0}}\n",
                                 "invalid model: model num_attention_heads=0 must be a whole number from 1"),
    "model size too large": (b"name: x\nmodel: {preset: llama-tiny, overrides: {vocab_size: 1" + b"0" * 400 + b"}}\n",
                             "invalid model: model vocab_size=1000"),
    "integer too long to read": (b"name: x\nmodel: {preset: llama-tiny}\nparallel: {tp: " + b"9" * 5000 + b"}\n",
                                 "Exceeds the limit (4300 digits) for integer string conversion"),  # was a traceback
    "unknown architecture": (b"name: x\nmodel: {preset: llama-tiny, overrides: {architecture: nope}}\n",
                             "invalid model: model architecture='nope' must be one of "),
    "optional size of wrong type": (b"name: x\nmodel: {preset: llama-tiny, overrides: {sliding_window: abc}}\n",
                                    "invalid model: model sliding_window='abc' must be a whole number from 1"),
    "clamp not a number": (b"name: x\nmodel: {preset: llama-tiny, overrides: {glu_clamp: .nan}}\n",
                           "invalid model: model glu_clamp=nan must be a positive number"),
    "window per layer": (b"name: x\nmodel: {preset: llama-tiny, overrides: {window_layers: [1, 0, 1]}}\n",
                         "invalid model: model window_layers=[1, 0, 1] must be null or a 0 or 1 for each layer"),
}


@pytest.mark.parametrize("case", sorted(BAD_EXPERIMENTS))
def test_malformed_experiment_is_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    data, expected = BAD_EXPERIMENTS[case]
    cfg = write(tmp_path / "exp.yaml", data)
    before = snapshot(tmp_path)
    one_error(run_main("launch", "--config", cfg, "--dry-run", "--set", f"run_root={tmp_path / 'runs'}"), f"{cfg}: ", expected)
    assert snapshot(tmp_path) == before


def test_an_integer_too_long_is_named_without_pythons_advice(tmp_path: Path) -> None:
    """Python's message ends with advice for the program (sys.set_int_max_str_digits): the user's line does not."""
    cfg = write(tmp_path / "exp.yaml", b"name: x\nmodel: {preset: llama-tiny}\nparallel: {tp: " + b"9" * 5000 + b"}\n")
    line = one_error(run_main("launch", "--config", cfg, "--dry-run", "--set", f"run_root={tmp_path / 'runs'}"),
                     "Exceeds the limit (4300 digits)")
    assert line.endswith("value has 5000 digits"), line


@pytest.mark.parametrize("config_json,expected", [
    (b"{not json", "not valid JSON (line 1, column 2"),
    (b'{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, '
     b'"intermediate_size": 128, "vocab_size": 256, "rope_theta": 1' + b"0" * 400 + b"}",
     "(OverflowError: int too large to convert to float)"),  # was a traceback
    (b"[1, 2]", "not an HF model config of the expected shape"),
    (b'{"model_type": "llama", "hidden_size": 64}', "num_attention_heads=None (needs a positive integer)"),
    (b"\xff\xfe\x00binary", "not UTF-8 text"),
    (b"[" * 100_000, "not valid JSON (nested too deeply)"),
    (b'{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, '
     b'"intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": "false"}',
     "tie_word_embeddings='false' (needs true or false, a JSON boolean)"),  # was read as true
    (b'{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, '
     b'"intermediate_size": 128, "vocab_size": 256, "hidden_act": "gelu"}',
     "hidden_act='gelu' is not supported"),  # a SwiGLU model was built for it
])
def test_broken_hf_config_is_one_line_naming_it(tmp_path: Path, config_json: bytes, expected: str) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    write(hf / "config.json", config_json)
    cfg = write(tmp_path / "exp.yaml", f"name: x\nmodel: {{hf_config: {hf}}}\n")
    before = snapshot(tmp_path)
    one_error(run_main("launch", "--config", cfg, "--dry-run"), f"{cfg}: model.hf_config {hf / 'config.json'}: ", expected)
    one_error(run_main("launch", "plan", "--model", hf, "--gpus", "8"), f"{hf / 'config.json'}: ", expected)
    assert snapshot(tmp_path) == before


BAD_PROFILES = {
    "count of wrong type": ("name: p\ngpus_per_node: many\n", "gpus_per_node: Input should be a valid integer"),
    "negative memory": ("name: p\ngpus_per_node: 8\nmem_per_gpu_gb: -1\n", "mem_per_gpu_gb: Input should be greater than or equal to 1"),
    "zero GPU memory": ("name: p\ngpus_per_node: 8\ngpu_memory_gb: 0\n", "gpu_memory_gb: Input should be greater than 0"),
    "env as a list": ("name: p\nenv: [A, B]\n", "env: Input should be a valid dictionary"),
    "setup as a string": ("name: p\nsetup: module load x\n", "setup: Input should be a valid list"),
    "unknown key": ("name: p\ngpus_per_nod: 0\n", "unknown key 'gpus_per_nod'; did you mean 'gpus_per_node'?"),
    "tab in run_root": ('name: p\ngpus_per_node: 0\nrun_root: "runs\\there"\n', "contains a newline or control character"),
    "newline in setup": ('name: p\ngpus_per_node: 0\nsetup: ["echo a\\n#SBATCH --x"]\n', "contains a newline or control character"),
    "binary": (b"\x00\x01\x02" * 50, "not a text file"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROFILES))
def test_malformed_cluster_profile_is_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    text, expected = BAD_PROFILES[case]
    profile = write(tmp_path / "cluster.yaml", text)
    before = snapshot(tmp_path)
    one_error(run_main("launch", "--config", TINY, "--cluster", profile, "--dry-run"), f"{profile}: ", expected)
    one_error(run_main("status", "--cluster", profile), f"{profile}: ", expected)
    assert snapshot(tmp_path) == before


def test_a_missing_profile_file_is_named_as_a_profile(tmp_path: Path) -> None:
    one_error(run_main("launch", "--config", TINY, "--cluster", tmp_path / "nope.yaml", "--dry-run"),
              f"cluster profile not found: {tmp_path / 'nope.yaml'} (a profile name from ")  # was "config file"


def test_paths_and_values_with_control_characters_are_one_line(tmp_path: Path) -> None:
    # A newline in a file name must not split the message: the name is shown escaped.
    r = run_main("launch", "--config", tmp_path / "a\nb.yaml", "--dry-run")
    assert one_error(r, "config file not found: ").endswith("a\\nb.yaml'")
    one_error(run_main("launch", "--config", TINY, "--dry-run", "--set", f"run_root={tmp_path}/x\ny"),
              "contains a newline or control character")
    one_error(run_main("launch", "--config", TINY, "--dry-run", "name=a\nb"), "contains a newline or control character")
    one_error(run_main("launch", "--config", tmp_path, "--dry-run"), f"{tmp_path}: not a file")
    one_error(run_main("launch", "chain", "--config", TINY, "--dry-run", "--hf-out", tmp_path / "hf\rx"),
              "--hf-out", "contains a newline or control character")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_run_root_is_one_line_before_anything_is_submitted(tmp_path: Path) -> None:
    blocker = write(tmp_path / "a-file", "not a folder\n")
    before = snapshot(tmp_path)
    one_error(run_main("launch", "smoke", "--set", f"run_root={blocker}/runs"), f"{blocker}/runs: cannot write the run root",
              "Not a directory", "--set run_root=DIR")
    assert snapshot(tmp_path) == before


def test_read_only_run_root_is_one_line(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mount.stderr.strip()}")
    try:
        one_error(run_main("launch", "smoke", "--set", f"run_root={ro}/runs"), f"{ro}/runs: cannot write the run root",
                  "Read-only file system")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_paths_pathlib_cannot_resolve_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A symlink loop and `~user` for an unknown user: pathlib raises RuntimeError, not OSError."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    one_error(run_main("status", "--runs", tmp_path / "a"), "Symlink loop from", str(tmp_path / "a"))
    one_error(run_main("launch", "--resume", tmp_path / "a"), "Symlink loop from")
    monkeypatch.setenv("MCOREKIT_RUN_ROOT", "~no-such-user-here/runs")
    one_error(run_main("launch", "--config", TINY, "--dry-run"),  # named: pathlib's message names no path
              "$MCOREKIT_RUN_ROOT ~no-such-user-here/runs: a path starts with ~ and a user name this machine does "
              "not know; give an absolute path")
    one_error(run_main("launch", "--config", TINY, "--dry-run", "--set", "run_root=~no-such-user-here/runs"),
              "run_root ~no-such-user-here/runs: a path starts with ~ and a user name")


@pytest.mark.parametrize("argv,error", [
    (["launch", "--resume", "RUN", "--clu", "example-h100", "--dry-run"], "unrecognized arguments: --clu"),  # ignored
    (["launch", "plan", "--mod", "llama-tiny", "--gpus", "8"], "the following arguments are required: --model"),
    (["convert", "hf-to-mcore", "HF", "OUT", "--form", "torch"], "unrecognized arguments: --form torch"),
    (["data", "preprocess", "in.jsonl", "--tok", "TOK", "--output-prefix", "p"],
     "the following arguments are required: --tokenizer"),
])
def test_abbreviated_options_are_refused(tmp_path: Path, argv: list[str], error: str) -> None:
    """Every parser takes options only as spelled (argparse's allow_abbrev off): a prefix is not silently taken for
    an option, and adding an option never changes what an existing command line means."""
    r = run_main(*[str(tmp_path / a) if a in ("RUN", "HF", "OUT") else a for a in argv])
    assert r.code == 2 and "Traceback" not in r.err and r.err.splitlines()[-1].endswith(error), r.err


def test_inputs_this_machine_cannot_see_are_warned_of_before_queueing(tmp_path: Path) -> None:
    """A data prefix, tokenizer or checkpoint that does not exist here: a warning per input at launch (the nodes may
    mount what this machine lacks, so not an error), none once they exist."""
    base = ["launch", "--config", TINY, "--dry-run", "--set", f"run_root={tmp_path / 'runs'}", "data.kind=indexed",
            f"data.paths=[{tmp_path / 'corpus'}]", f"checkpoint.load={tmp_path / 'ckpt'}"]
    r = run_main(*base)
    assert r.code == 0 and r.err.splitlines() == [
        f"mcorekit: warning: data.paths: {tmp_path / 'corpus.bin'}, {tmp_path / 'corpus.idx'} not found on this "
        f"machine; the job fails at its start unless its nodes see it",
        f"mcorekit: warning: checkpoint.load: no folder {tmp_path / 'ckpt'} on this machine; the job fails at its "
        f"start unless its nodes see it"], r.err
    for made in ("corpus.bin", "corpus.idx"):
        (tmp_path / made).write_bytes(b"")
    (tmp_path / "ckpt").mkdir()
    r = run_main(*base)
    assert r.code == 0 and r.err == "", r.err


# ---------------------------------------------------------------- invalid value accepted: numeric options

LAUNCH = ["launch", "--config", str(TINY), "--dry-run"]
SWEEP = ["launch", "sweep", "--config", str(TINY), "--dry-run", "--grid", "optimizer.lr=1e-4,2e-4"]
PLAN = ["launch", "plan", "--model", "llama-tiny", "--gpus", "8"]
NUMERIC_CASES = [
    (SWEEP + ["--max-parallel", "-1"], "--max-parallel"),
    (SWEEP + ["--max-parallel", "0"], "--max-parallel"),
    (SWEEP + ["--nodes", "-1"], "--nodes"),
    (LAUNCH + ["--nodes", "0"], "--nodes"),
    (LAUNCH + ["--nodes", "two"], "--nodes"),
    (["launch", "chain", "--config", str(TINY), "--dry-run", "--hf-out", "hf", "--nodes", "0"], "--nodes"),
    (["launch", "smoke", "--dry-run", "--nodes", "0"], "--nodes"),
    (["launch", "plan", "--model", "llama-tiny", "--gpus", "0"], "--gpus"),
    (PLAN + ["--gpus-per-node", "-8"], "--gpus-per-node"),
    (PLAN + ["--seq", "0"], "--seq"),
    (PLAN + ["--mbs", "-1"], "--mbs"),
    (PLAN + ["--gpu-memory-gb", "0"], "--gpu-memory-gb"),
    (PLAN + ["--gpu-memory-gb", "nan"], "--gpu-memory-gb"),
    (["status", "--last", "0"], "--last"),
    (["status", "--last", "-3"], "--last"),
    (["logs", "1", "--rank", "-1"], "--rank"),
    (["logs", "1", "--follow", "--wait", "-5"], "--wait"),
    (["logs", "1_../../etc/passwd"], "job"),
]


@pytest.mark.parametrize("argv,option", NUMERIC_CASES, ids=[" ".join(a[:2] + a[-2:]) for a, _ in NUMERIC_CASES])
def test_out_of_range_option_is_a_usage_error(tmp_path: Path, argv: list[str], option: str) -> None:
    where = ["--runs", str(tmp_path)] if argv[0] in ("status", "logs") else ["--set", f"run_root={tmp_path}"]
    if argv[:2] == ["launch", "plan"]:
        where = []
    r = run_main(*argv, *where)
    usage_error(r, option)
    assert "%-1" not in r.out and "#SBATCH" not in r.out  # nothing rendered
    assert list(tmp_path.iterdir()) == []


def test_sweep_grid_limits(tmp_path: Path) -> None:
    base = ["launch", "sweep", "--config", TINY, "--dry-run", "--set", f"run_root={tmp_path}"]
    one_error(run_main(*base, "--grid", "optimizer.lr=1,2", "--grid", "optimizer.lr=3"), "sweep axis 'optimizer.lr' is given twice")
    many = ",".join(str(i) for i in range(1, 34))
    one_error(run_main(*base, "--grid", f"optimizer.lr={many}", "--grid", f"optimizer.min_lr={many}"),
              "the grid has 1,089 points", "at most 1000")
    one_error(run_main(*base, "--grid", "optimizer.lr=1e-4,-1"), f"{TINY}: sweep point 1 {{'optimizer.lr': -1}}: optimizer.lr")
    # one checkpoint folder for every point: they would resume from and prune each other's checkpoints
    one_error(run_main(*base, "--grid", "optimizer.lr=1e-4,3e-4", f"checkpoint.dir={tmp_path / 'ckpt'}"),
              f"sweep points 0 and 1 share checkpoint.dir {tmp_path / 'ckpt'}")
    r = run_main(*base, "--grid", f"checkpoint.dir={tmp_path / 'a'},{tmp_path / 'b'}")  # one each: fine
    assert r.code == 0, r.err
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_sweep_values_are_whole_and_distinct(tmp_path: Path) -> None:
    base = ["launch", "sweep", "--config", TINY, "--dry-run", "--set", f"run_root={tmp_path}"]
    # one value written twice queued two identical points
    assert one_error(run_main(*base, "--grid", "optimizer.lr=1e-4,0.0001")) == (
        "mcorekit: error: sweep axis 'optimizer.lr' lists '1e-4' and '0.0001', the same value (0.0001): the grid "
        "would queue identical points; list each value once")
    from mcorekit.launch.api import parse_axes

    with pytest.raises(ConfigError, match="lists '1' and '1.0', the same value"):
        parse_axes(["a.b=0,false,1,true,1.0"])
    assert parse_axes(["a.b=0,false,1,true"]) == {"a.b": [0, False, 1, True]}  # a boolean is not a number here
    # a grid over name names the sweep's job after each point: too long is said as such, as at load
    long = "n" * 62
    assert one_error(run_main(*base, "--grid", f"name=short,{long}")) == (
        f"mcorekit: error: {TINY}: name {long!r} (62 characters) is too long for a sweep: its jobs are named "
        f"<name>-sweep, at most 64 characters; shorten name to at most 58")
    # a list is one value: the commas inside its brackets do not split the axis
    r = run_main(*base, "data.kind=indexed", "--grid", f"data.paths=[{tmp_path}/a,{tmp_path}/b],[{tmp_path}/c]")
    assert r.code == 0, r.err
    assert re.findall(r"^# point \d: (.*) -> ", r.out, re.M) == [
        f'data.paths=["{tmp_path}/a", "{tmp_path}/b"]', f'data.paths=["{tmp_path}/c"]']
    assert list(tmp_path.iterdir()) == []


def test_chain_outputs_are_checked_at_submission(tmp_path: Path) -> None:
    base = ["launch", "chain", "--config", TINY, "--dry-run", "--set", f"run_root={tmp_path / 'runs'}"]
    (tmp_path / "taken").mkdir()
    one_error(run_main(*base, "--hf-out", tmp_path / "taken"), "--hf-out", "exists")
    one_error(run_main(*base, "--hf-out", tmp_path / "hf", "--export-out", tmp_path / "hf" / "trt"),
              "--export-out", "overlaps --hf-out")
    one_error(run_main(*base, "--hf-out", tmp_path / "runs"), "--hf-out", "overlaps the training checkpoints")
    one_error(run_main(*base, "--hf-out", tmp_path / "hf", "--engine-out", tmp_path / "eng"), "--engine-out needs --export-out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


# ---------------------------------------------------------------- the job registry and id lists, without Slurm


def test_a_torn_registry_line_is_skipped_and_never_swallows_the_next_entry(tmp_path: Path, capsys) -> None:
    registry = write(tmp_path / REGISTRY, '{"job_id": "5", "name": "a", "run_dir": "/r"}\n{"job_id": "6", "na')
    record(tmp_path, job_id="7", name="b", kind="train", run_dir="/r")
    entries = jobs_cli._registry(tmp_path)
    assert [e["job_id"] for e in entries] == ["5", "7"]
    assert capsys.readouterr().err.strip() == (f"mcorekit: warning: {registry}: skipped malformed line 2 "
                                               f"(not JSON (JSONDecodeError)) and read the rest")


def test_each_skipped_registry_line_is_given_its_own_reason(tmp_path: Path, capsys) -> None:
    """The warning gave the first bad line's reason for all of them."""
    registry = write(tmp_path / REGISTRY, b'{"job_id": "5", "name": "a", "run_dir": "/r"}\n{"job_id": "6", "na\n'
                     b'\xff\n[1, 2]\n{"job_id": "1;x", "name": "x", "run_dir": "/r"}\n')
    assert [e["job_id"] for e in jobs_cli._registry(tmp_path)] == ["5"]
    assert capsys.readouterr().err.strip() == (
        f"mcorekit: warning: {registry}: skipped malformed lines 2 (not JSON (JSONDecodeError)), 3 (not JSON "
        f"(UnicodeDecodeError)), 4 (a JSON list, not an object), 5 (job_id '1;x' is not a Slurm job id) and read "
        f"the rest")
    write(tmp_path / REGISTRY, b"[]\n" * 7)
    jobs_cli._registry(tmp_path)
    assert capsys.readouterr().err.strip() == (
        f"mcorekit: warning: {registry}: skipped malformed lines "
        + ", ".join(f"{n} (a JSON list, not an object)" for n in range(1, 6)) + " and 2 more and read the rest")


def sparse_log(path: Path, size: int, end: bytes) -> Path:
    """A log of `size` bytes of zeros (a hole: no disk used), then `end`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(size)
        f.write(end)
    return path


def peak_memory(call: Callable[[], object]) -> tuple[object, int]:
    """call()'s result and the most memory Python held for it at once, in bytes."""
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_status_reads_only_the_end_of_each_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank's log was read whole for each row: status's memory grew with a long job's logs."""
    sparse_log(tmp_path / "run" / "logs" / "7_0_log.err", 64 << 20,
               b"\nstep 41/50\nTraceback (most recent call last):\n  File \"x\", line 1\nRuntimeError: CUDA out of "
               b"memory\n")
    record(tmp_path, job_id="7", name="x", kind="train", run_dir=str(tmp_path / "run"))
    monkeypatch.setattr(accounting, "sacct", lambda ids: {
        j: accounting.JobRecord(j, "x", "FAILED", "1:0", "00:01:00", 0) for j in ids})
    rows, peak = peak_memory(lambda: jobs_cli.status_rows(tmp_path, 10))
    assert [(r["last_step"], r["diagnosis"].split(":")[0]) for r in rows] == [(41, "CUDA out of memory")]
    assert peak < 8 << 20, f"{peak:,} bytes"


def test_logs_prints_a_log_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mcorekit logs` read the whole log into memory before printing it."""
    big = sparse_log(tmp_path / "big.out", 64 << 20, b"done\n")
    with open(os.devnull, "w") as sink, redirect_stdout(sink):
        pos, peak = peak_memory(lambda: jobs_cli._print_new(big, 0))
    assert pos == big.stat().st_size and peak < 8 << 20, f"{peak:,} bytes"
    # what is printed is the same, a character split between two pieces included
    data = "step 1 \u00e9\u20ac\U0001f600 ok\n".encode() + b"\xff bad byte\n"
    sparse_log(tmp_path / "run" / "logs" / "7_0_log.out", 0, data)
    record(tmp_path, job_id="7", name="x", kind="train", run_dir=str(tmp_path / "run"))
    monkeypatch.setattr(jobs_cli, "PRINT_CHUNK", 3)
    r = run_main("logs", "7", "--runs", tmp_path)
    assert (r.code, r.out, r.err) == (0, data.decode("utf-8", errors="replace"), "")


def test_cancel_id_lists_are_parsed_whole(tmp_path: Path) -> None:
    assert jobs_cli.parse_cancel_ids("12_0,13,14_[1-3,5]") == [("12_0", 12, [0]), ("13", 13, None),
                                                               ("14_[1-3,5]", 14, [1, 2, 3, 5])]
    for bad in ("12;rm", "12_", "12_[3-1]", "12_[0-99999999]", "-5", "12,,13", "\u0661\u0662"):  # Arabic-Indic 12
        with pytest.raises(LaunchError, match="nothing was cancelled"):
            jobs_cli.parse_cancel_ids(bad)
    write(tmp_path / REGISTRY, '{"job_id": "12_0", "name": "a", "run_dir": "/r"}\n')
    before = snapshot(tmp_path)
    one_error(run_main("cancel", "--runs", tmp_path, "12_0,12;touch x"), "'12;touch x' is not a job id", "nothing was cancelled")
    one_error(run_main("cancel", "--runs", tmp_path, "12_0,999"), "not this project's job: 999", "nothing was cancelled")
    assert snapshot(tmp_path) == before


def test_job_ids_are_ascii_digits(tmp_path: Path) -> None:
    """Python's \\d matches any script's digits: `logs \u0661\u0662\u0663` showed job 123's log."""
    write(tmp_path / REGISTRY, '{"job_id": "123", "name": "a", "run_dir": "/r"}\n')
    r = run_main("logs", "--runs", tmp_path, "\u0661\u0662\u0663")
    assert r.code == 2 and "Traceback" not in r.err and "argument job" in r.err.splitlines()[-1], r.err


def test_a_failing_slurm_command_is_reported_in_one_line() -> None:
    """sacct and squeue print several lines when the controller or slurmdbd is down; the error is one line."""
    from mcorekit.launch.accounting import _run

    with pytest.raises(LaunchError) as e:
        _run(["sh", "-c", "echo 'sacct: error: Problem talking to the database' >&2; echo 'second line' >&2; exit 1"])
    assert str(e.value).endswith("failed: sacct: error: Problem talking to the database second line"), str(e.value)


# ---------------------------------------------------------------- on the dev cluster


def _queue() -> dict[str, str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, check=True).stdout
    return dict(line.split() for line in out.splitlines())


def _cancel(job: str) -> None:
    """scancel, then wait (bounded) until the job has left the node, so that the next run finds it idle."""
    subprocess.run(["scancel", job], capture_output=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        time.sleep(0.5)


def nap() -> None:
    time.sleep(120)


def fail() -> None:
    raise RuntimeError("task fails on purpose")


def ok() -> str:
    print("task done", flush=True)
    return "ok"


@dataclass
class Ours:
    runs: Path
    array: str

    @property
    def registry(self) -> Path:
        return self.runs / REGISTRY


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ours]:
    """This project's array of four tasks: 0 and 1 sleep two minutes, 2 fails, 3 completes."""
    root = tmp_path_factory.mktemp("ours")
    cfg = write(root / "exp.yaml", yaml.safe_dump({"name": "faults", "model": {"preset": "llama-tiny"},
                                                   "data": {"seq_length": 128}, "resources": {"time": "00:05:00"},
                                                   "schedule": {"micro_batch_size": 1, "global_batch_size": 2}}))
    points, sweep_dir = api.prepare_sweep(cfg, "local", {"optimizer.lr": [1e-4, 2e-4, 3e-4, 4e-4]},
                                          profile_overrides=[f"run_root={root / 'runs'}", "tasks_per_node=1"])
    jobs = api.submit_sweep(points, sweep_dir, payloads=[nap, nap, fail, ok])
    array = jobs[0].job_id.split("_")[0]
    yield Ours(root / "runs", array)
    _cancel(array)


@pytest.fixture(scope="module")
def foreign() -> Iterator[str]:
    """A job of someone else: plain sbatch, not in any registry of ours."""
    job = subprocess.run(["sbatch", "--parsable", "-p", "debug", "-t", "3", "-o", "/dev/null", "--wrap", "sleep 120"],
                         capture_output=True, text=True, check=True).stdout.strip()
    yield job
    _cancel(job)


@pytest.mark.slurm
def test_sweep_and_chain_follow_the_launchers_rules_and_submit_nothing(tmp_path: Path) -> None:
    before_queue, before_files = _queue(), snapshot(TINY)
    runs = tmp_path / "runs"
    sweep = ["launch", "sweep", "--config", TINY, "--set", f"run_root={runs}"]
    one_error(run_cli(*sweep, "--grid", "optimizer.lr=1e-4,2e-4"), "profile 'local' is CPU-only")
    one_error(run_cli(*sweep, "--grid", "optimizer.lr=1e-4,2e-4", "--max-parallel", "2"), "CPU-only")
    one_error(run_cli("launch", "chain", "--config", TINY, "--set", f"run_root={runs}", "--hf-out", tmp_path / "hf"),
              "CPU-only")
    # Every point is validated as a full experiment before any other step: point 1 breaks the layout rules.
    r = run_cli(*sweep, "--grid", "parallel.tp=1,3")
    assert r.code == 2 and "Traceback" not in r.err
    assert r.err.startswith(f"mcorekit: error: {TINY}: sweep point 1 {{'parallel.tp': 3}}: invalid layout (4 problems):")
    assert set(_queue()) - set(before_queue) == set()
    assert not runs.exists() and not (tmp_path / "hf").exists()
    assert snapshot(TINY) == before_files


@pytest.mark.slurm
def test_cancel_checks_every_id_and_cancels_nothing_foreign(ours: Ours, foreign: str) -> None:
    before = snapshot(ours.registry)
    a = ours.array
    for ids, named in [(f"{a}_0,{foreign}", foreign), (foreign, foreign), (f"{foreign},{a}_0", foreign),
                       (f"{a}_[0-5]", f"{a}_4 (of {a}_[0-5])"), (f"{a}_9", f"{a}_9")]:
        one_error(run_cli("cancel", "--runs", ours.runs, ids), "not this project's job", named, "nothing was cancelled")
    one_error(run_cli("cancel", "--runs", ours.runs, f"{a}_0", foreign), foreign, "nothing was cancelled")
    queue = _queue()
    assert queue.get(foreign) in ("PENDING", "RUNNING")
    assert queue.get(f"{a}_0") in ("PENDING", "RUNNING")
    # Our own task alone is cancelled; the foreign job still runs.
    r = run_cli("cancel", "--runs", ours.runs, f"{a}_0")
    assert r.code == 0 and r.out.strip() == f"cancelled {a}_0", r.err
    assert _queue().get(foreign) in ("PENDING", "RUNNING")
    assert snapshot(ours.registry) == before


@pytest.mark.slurm
def test_logs_follow_stops_when_the_task_does_not_exist_or_never_logs(ours: Ours, tmp_path: Path) -> None:
    a = ours.array
    before = snapshot(ours.registry)  # the jobs' own logs keep growing meanwhile
    start = time.monotonic()
    one_error(run_cli("logs", "--runs", ours.runs, f"{a}_9", "--follow", timeout=20), f"job {a}_9 is not in",
              f"array {a} has tasks {a}_0 to {a}_3")
    one_error(run_cli("logs", "--runs", ours.runs, a, "--follow", timeout=20), f"job {a} is an array")
    assert time.monotonic() - start < 6
    # In the registry, unknown to Slurm: it stops after a short grace for accounting lag.
    other = tmp_path / "runs"
    other.mkdir()
    write(other / REGISTRY, ours.registry.read_bytes() + b'{"job_id": "99999999_0", "name": "x", "run_dir": "/nowhere"}\n')
    start = time.monotonic()
    one_error(run_cli("logs", "--runs", other, "99999999_0", "--follow", timeout=20), "Slurm has no such job or array task")
    assert time.monotonic() - start < 6
    # A rank the task does not have: refused at once, naming the ranks it has (its sbatch script says how many).
    start = time.monotonic()
    one_error(run_cli("logs", "--runs", ours.runs, f"{a}_1", "--rank", "5", "--follow", "--wait", "2", timeout=20),
              f"job {a}_1 has 1 task (rank 0); --rank 5 is not one of them")
    assert time.monotonic() - start < 8
    assert snapshot(ours.registry) == before


@pytest.mark.slurm
def test_logs_follow_ends_with_the_job(ours: Ours) -> None:
    a = ours.array
    done = run_cli("logs", "--runs", ours.runs, f"{a}_3", "--follow", timeout=60)
    assert done.code == 0 and "task done" in done.out, done.err
    failed = run_cli("logs", "--runs", ours.runs, f"{a}_2", "--stderr", "--follow", timeout=60)
    assert failed.code == 1 and "task fails on purpose" in failed.out
    assert failed.err.strip().splitlines()[-1] == f"mcorekit: job {a}_2 ended FAILED (exit code 1:0); `mcorekit status` shows a diagnosis"


@pytest.mark.slurm
def test_malformed_registry_lines_are_skipped_with_one_warning(ours: Ours, foreign: str, tmp_path: Path) -> None:
    a = ours.array
    runs = tmp_path / "runs"
    runs.mkdir()
    good = ours.registry.read_bytes()
    n = good.count(b"\n")
    registry = write(runs / REGISTRY, good + b'{"job_id": "1", "na\n' + b"\x00\xff\xfe binary\n" + b"[1, 2]\n"
                     + b'{"job_id": "1;rm -rf ~", "name": "x", "run_dir": "/r"}\n' + b'{"job_id": "' + foreign.encode() + b'_')
    before = snapshot(runs)
    warning = (f"mcorekit: warning: {registry}: skipped malformed lines {n + 1} (not JSON (JSONDecodeError)), "
               f"{n + 2} (not JSON (UnicodeDecodeError)), {n + 3} (a JSON list, not an object), {n + 4} (job_id "
               f"'1;rm -rf ~' is not a Slurm job id), {n + 5} (not JSON (JSONDecodeError)) and read the rest")
    status = run_cli("status", "--runs", runs)
    assert status.code == 0 and status.err.strip() == warning, status.err
    assert all(f" {a}_{i} " in status.out for i in range(4)), status.out
    cancel = run_cli("cancel", "--runs", runs, foreign)
    assert cancel.err.splitlines()[0] == warning
    one_error(cancel, f"not this project's job: {foreign}", "nothing was cancelled")
    logs = run_cli("logs", "--runs", runs, f"{a}_3", "--follow", timeout=60)
    assert logs.code == 0 and "task done" in logs.out and logs.err.strip() == warning
    assert _queue().get(foreign) in ("PENDING", "RUNNING")
    assert snapshot(runs) == before
