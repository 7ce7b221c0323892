"""Values the launcher read wrongly or crashed on before `82fa0b1`: bytes that are not UTF-8 (in an override, the
current directory, the run root), a control character in the current directory, empty paths, unclosed quotes and
brackets, zero blend weights, a backslash in the run root, Unicode line breaks, and empty --config/--cluster. Each
case: exit 2 and the exact line, or the value as read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_input_hardening import only_error
from test_launch_options import run

from mcorekit.config.experiment import load_experiment
from mcorekit.config.loading import dump, parse_yaml
from mcorekit.errors import ConfigError
from mcorekit.launch import api

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "examples" / "llama-tiny.yaml")
LOCAL = REPO / "slurm" / "clusters" / "local.yaml"
LAUNCH = ["launch", "--config", TINY, "--dry-run"]
NOT_UTF8 = "is not UTF-8 (each \\udcXX stands for a byte that does not decode)"
CONTROL = "contains a newline or control character"


# ---------------------------------------------------------------- 1. an override that is not UTF-8


@pytest.mark.parametrize("argv,named", [
    (LAUNCH + ["optimizer.lr=\udcff"], "override 'optimizer.lr=\\udcff'"),
    (LAUNCH + ["--set", "partition=\udcff"], "override 'partition=\\udcff'"),
    (["launch", "sweep", "--config", TINY, "--dry-run", "--grid", "optimizer.lr=1e-4,\udcff"],
     "sweep axis 'optimizer.lr=1e-4,\\udcff'"),
])
def test_an_override_that_is_not_utf8_is_refused(argv: list[str], named: str) -> None:
    """$'optimizer.lr=\\xff' reached libyaml, whose UnicodeEncodeError was a traceback."""
    assert only_error(*run(*argv)) == f"mcorekit: error: {named} {NOT_UTF8}; use UTF-8"


def test_yaml_text_that_is_not_utf8_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=re.escape(f"t: 'a: \\udcff' {NOT_UTF8}; use UTF-8")):
        parse_yaml("a: \udcff", "t")


# ---------------------------------------------------------------- 2. and 3. the current directory and the run root


def launch_from(directory: Path, monkeypatch: pytest.MonkeyPatch, problem: str) -> None:
    """A relative checkpoint.dir launched from `directory` (made here) is one line naming it and `problem`."""
    directory.mkdir()
    monkeypatch.chdir(directory)
    assert only_error(*run(*LAUNCH, "checkpoint.dir=ckpts")) == (
        f"mcorekit: error: checkpoint.dir ckpts is read against the current directory {str(directory)!r}, which "
        f"{problem}; give an absolute path")


def test_a_relative_path_read_against_a_directory_with_a_newline_is_one_line(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Was pydantic's ValidationError, a traceback, when the path was made absolute."""
    launch_from(tmp_path / "c\nwd", monkeypatch, CONTROL)


def test_making_paths_absolute_never_raises_a_validation_error() -> None:
    """Whatever a path becomes, an unfit one is a ConfigError line (the backstop behind absolute()'s check)."""
    exp = load_experiment(TINY, ["checkpoint.dir=/tmp/ckpts"])
    with pytest.raises(ConfigError) as e:
        api._each_path(exp, lambda value, key: value + "\n", lambda value: False)
    assert str(e.value) == ("the experiment's paths made absolute: checkpoint.dir: checkpoint path '/tmp/ckpts\\n' "
                            "contains a newline or control character; remove it (got '/tmp/ckpts\\n')")


def test_a_current_directory_that_is_not_utf8_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch went through and wrote a config.yaml holding "\\uDCFF", which neither --resume nor the job could
    read back."""
    cwd = tmp_path / "cw\udcffd"
    launch_from(cwd, monkeypatch, NOT_UTF8)
    assert only_error(*run(*LAUNCH, "--set", "run_root=runs")) == (
        f"mcorekit: error: the run root {str(cwd / 'runs')!r} (run_root) {NOT_UTF8}: it goes into the job's script "
        f"and files; set run_root in the cluster profile or pass --set run_root=DIR")
    profile = tmp_path / "container.yaml"  # the container's workdir defaults to the current directory
    profile.write_text("name: c\ngpus_per_node: 1\ncontainer: {image: nvcr.io#nvidia/pytorch:25.01-py3}\n")
    assert only_error(*run(*LAUNCH, "--cluster", str(profile), "--set", f"run_root={tmp_path}")) == (
        f"mcorekit: error: the container's workdir is the current directory {str(cwd)!r}, which {NOT_UTF8}; set "
        f"container.workdir in the cluster profile, or launch from another directory")
    code, out, err = run(*LAUNCH, "checkpoint.dir=/tmp/ckpts", "--set", f"run_root={tmp_path}")  # nothing from here
    assert code == 0 and "  dir: /tmp/ckpts\n" in out, err


def test_a_run_root_from_the_environment_that_is_not_utf8_is_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "r\udcffr"
    monkeypatch.setenv("MCOREKIT_RUN_ROOT", str(root))
    assert only_error(*run(*LAUNCH)) == (
        f"mcorekit: error: the run root {str(root)!r} ($MCOREKIT_RUN_ROOT) {NOT_UTF8}: it goes into the job's script "
        f"and files; set run_root in the cluster profile or pass --set run_root=DIR")
    assert list(tmp_path.iterdir()) == []


def test_dump_refuses_text_that_is_not_utf8() -> None:
    """The last check before a run's config.yaml is written: whatever put such text there."""
    exp = load_experiment(TINY)
    bad = exp.model_copy(update={"checkpoint": exp.checkpoint.model_copy(update={"dir": "/tmp/a\udcffb"})})
    with pytest.raises(ConfigError) as e:
        dump(bad)
    assert str(e.value) == f"checkpoint.dir '/tmp/a\\udcffb' {NOT_UTF8}; a run's files are UTF-8: use UTF-8 names"


# ---------------------------------------------------------------- 4. empty paths


@pytest.mark.parametrize("key,what", [
    ("checkpoint.dir", "checkpoint path"), ("checkpoint.load", "checkpoint path"), ("data.cache_dir", "data path"),
    ("data.tokenizer", "data path"), ("model.hf_config", "HF config path"),
    ("peft.lora.load", "adapter checkpoint path")])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_path_is_refused(key: str, what: str, value: str) -> None:
    """Each was made absolute as the current directory."""
    assert only_error(*run(*LAUNCH, f"{key}={value}")) == (
        f"mcorekit: error: {TINY}: {key} (from the override {key}=...): {what} is empty, which would mean the current "
        f"directory; give a path, or null to leave it unset (got {value!r})")


def test_empty_paths_in_a_file_and_an_empty_run_root_are_refused(tmp_path: Path) -> None:
    exp = tmp_path / "exp.yaml"
    exp.write_text('name: x\nmodel: {preset: llama-tiny}\ncheckpoint: {dir: ""}\ndata: {paths: [/tmp/a, ""]}\n')
    assert only_error(*run("launch", "--config", str(exp), "--dry-run")) == (
        f"mcorekit: error: {exp}: data.paths: data path is empty, which would mean the current directory; give a "
        f"path, or remove the empty entry (got ['/tmp/a', '']); checkpoint.dir: checkpoint path is empty, which "
        f"would mean the current directory; give a path, or null to leave it unset (got '')")
    assert only_error(*run(*LAUNCH, "--set", "run_root=")) == (
        f"mcorekit: error: {LOCAL}: run_root (from the override run_root=...): the run root is empty, which would "
        f"mean the current directory; give a folder, or null for $MCOREKIT_RUN_ROOT or the default (got '')")


def test_null_still_leaves_an_optional_path_unset(tmp_path: Path) -> None:
    code, out, err = run(*LAUNCH, "checkpoint.dir=null", "data.cache_dir=~", "--set", "run_root=null")
    assert code == 0, err
    assert "  dir: null\n" in out and "  cache_dir: null\n" in out


# ---------------------------------------------------------------- 5. unclosed quotes and brackets


@pytest.mark.parametrize("value", ['"/tmp/my ckpts', "'/tmp/my ckpts", "[/tmp/a", "{a: 1", '"/tmp/a"b'])
def test_an_unclosed_quote_or_bracket_is_refused(value: str) -> None:
    """'checkpoint.dir="/tmp/my ckpts' became the folder <cwd>/"/tmp/my ckpts."""
    line = only_error(*run(*LAUNCH, f"checkpoint.dir={value}"))
    assert line.startswith("mcorekit: error: override 'checkpoint.dir': not valid YAML: line "), line
    assert line.endswith(f"; a value that starts with a quote or bracket is read as YAML: close the quote or bracket "
                         f"in {value!r}, or quote the whole value"), line


def test_other_text_that_is_not_yaml_stays_a_string() -> None:
    exp = load_experiment(TINY, ["checkpoint.dir=/tmp/it's", 'data.cache_dir="/tmp/a b"'])
    assert (exp.checkpoint.dir, exp.data.cache_dir) == ("/tmp/it's", "/tmp/a b")
    # brackets closed before more text: a run's name, as before (they were refused for a while)
    for name in ("[ablation] lr 3e-4", "{date}_run", "[a, b] [c]"):
        exp = load_experiment(TINY, ["logging.wandb.project=p", f"logging.wandb.name={name}"])
        assert exp.logging.wandb is not None and exp.logging.wandb.name == name


@pytest.mark.parametrize("raw,values", [
    ('"/tmp/a,b","/tmp/c"', ['"/tmp/a,b"', '"/tmp/c"']),
    ("'/tmp/a,b','it''s,x'", ["'/tmp/a,b'", "'it''s,x'"]),
    ('"a\\",b",c', ['"a\\",b"', "c"]),
    ('["a,b", c],[d]', ['["a,b", c]', "[d]"]),
    ('{k: "x,y"},{k: z}', ['{k: "x,y"}', "{k: z}"]),
    ("[a,b],[c]", ["[a,b]", "[c]"]),  # as before: the commas inside brackets
    ("1e-4,3e-4", ["1e-4", "3e-4"]),
    ("a:'b,c", ["a:'b", "c"]),  # a plain scalar: YAML opens a quote after ': ', not after ':' alone
    ("{k: 'x,y'},z", ["{k: 'x,y'}", "z"]),
    ("it's,x", ["it's", "x"]),  # a quote inside a word opens no string, as in YAML
    ('"/tmp/a,b","/tmp/c', ['"/tmp/a,b"', '"/tmp/c']),  # left open: parse_value refuses it
])
def test_grid_values_split_outside_quotes_and_brackets(raw: str, values: list[str]) -> None:
    assert api._values(raw) == values


def test_a_grid_value_may_hold_commas_inside_quotes(tmp_path: Path) -> None:
    """--grid 'checkpoint.dir="/tmp/a,b","/tmp/c"' queued 3 points, two of them paths with a quote in them."""
    base = ["launch", "sweep", "--config", TINY, "--dry-run", "--set", f"run_root={tmp_path}"]
    code, out, err = run(*base, "--grid", f'checkpoint.dir="{tmp_path}/a,b","{tmp_path}/c"')
    assert code == 0, err
    assert re.findall(r"^# point \d: (.*) -> ", out, re.M) == [f'checkpoint.dir="{tmp_path}/a,b"',
                                                               f'checkpoint.dir="{tmp_path}/c"']
    line = only_error(*run(*base, "--grid", f'checkpoint.dir="{tmp_path}/a,b","{tmp_path}/c'))
    assert line.startswith("mcorekit: error: sweep axis 'checkpoint.dir': not valid YAML: ") and line.endswith(
        f"close the quote or bracket in '\"{tmp_path}/c', or quote the whole value"), line


# ---------------------------------------------------------------- 6. blend weights


def test_blend_weights_must_be_positive() -> None:
    """The job's dataset builder refuses a weight <= 0 (train/data/indexed.py): [0, 0] failed only on the nodes."""
    line = only_error(*run(*LAUNCH, "data.kind=indexed", "data.paths=[/tmp/a,/tmp/b]", "data.weights=[0.5,0]"))
    assert line == (f"mcorekit: error: {TINY}: data.weights.1 (from the override data.weights=...): Input should be "
                    f"greater than 0 (got 0)")


# ---------------------------------------------------------------- 7. a backslash in the run root


def test_a_backslash_in_the_run_root_is_refused(tmp_path: Path) -> None:
    """In --output/--error a backslash turns off Slurm's %j expansion: the logs landed under a literal %j."""
    for kind in (["launch", "--config", TINY], ["launch", "smoke"]):
        line = only_error(*run(*kind, "--set", f"run_root={tmp_path}/r\\x", "--dry-run"))
        assert line.startswith(f"mcorekit: error: run directory {tmp_path}/r\\x/") and line.endswith(
            "contains a backslash, which Slurm's log file names treat specially (%j is the job id; a backslash "
            "turns that off); choose a run_root without '%' or backslashes"), line
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- 8. Unicode line breaks and C1 controls


@pytest.mark.parametrize("char,escaped", [("\x85", "\\x85"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"),
                                          ("\x9b", "\\x9b")])
def test_unicode_line_breaks_are_refused(char: str, escaped: str) -> None:
    """NEL (U+0085) in an override became a space: YAML folds it as a line break."""
    assert only_error(*run(*LAUNCH, f"checkpoint.dir=/tmp/a{char}b")) == (
        f"mcorekit: error: override 'checkpoint.dir=/tmp/a{escaped}b' {CONTROL}; remove it")


def test_a_nel_in_a_file_is_refused(tmp_path: Path) -> None:
    exp = tmp_path / "exp.yaml"
    exp.write_text('name: x\nmodel: {preset: llama-tiny}\ncheckpoint: {dir: "/tmp/a\\Nb"}\n')  # \N: YAML's NEL
    assert only_error(*run("launch", "--config", str(exp), "--dry-run")) == (
        f"mcorekit: error: {exp}: checkpoint.dir: checkpoint path '/tmp/a\\x85b' {CONTROL}; remove it "
        f"(got '/tmp/a\\x85b')")


# ---------------------------------------------------------------- 9. empty --config / --cluster, a file's top level


@pytest.mark.parametrize("argv,option", [(["launch", "--config", "", "--dry-run"], "--config"),
                                         (LAUNCH + ["--cluster", ""], "--cluster"),
                                         (["launch", "--resume", " ", "--dry-run"], "--resume"),
                                         (["status", "--runs", ""], "--runs"),
                                         (["launch", "plan", "--model", "", "--gpus", "8"], "--model")])
def test_an_empty_path_option_says_so(argv: list[str], option: str) -> None:
    """--config '' said '.: not a file'."""
    code, out, err = run(*argv)
    assert (code, out) == (2, "") and "Traceback" not in err, err
    assert err.splitlines()[-1].endswith(f": error: argument {option}: is empty (it would mean the current "
                                         f"directory); give a path or a name"), err


def test_a_file_whose_top_level_is_a_number_says_so_in_english(tmp_path: Path) -> None:
    exp = tmp_path / "exp.yaml"
    exp.write_text("3\n")
    assert only_error(*run("launch", "--config", str(exp), "--dry-run")) == (
        f"mcorekit: error: {exp}: expected a mapping (`key: value` lines) at the top level, got an int")
