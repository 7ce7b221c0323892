"""Every launch/status/logs/cancel option says what it does, and a command-line model source replaces the file's
(issue 17)."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from mcorekit.cli import main

TINY = str(Path(__file__).resolve().parent.parent / "examples" / "llama-tiny.yaml")
LLAMA_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("command", [["launch"], ["launch", "sweep"], ["launch", "chain"], ["launch", "plan"],
                                     ["launch", "smoke"], ["status"], ["logs"], ["cancel"]])
def test_every_option_has_help(command: list[str]) -> None:
    code, out, _ = run(*command, "--help")
    assert code == 0
    body = out.split("\noptions:\n", 1)[1]
    options = re.findall(r"^  (-[^\n]*)\n?((?:^ {6,}.*\n?)*)", body, re.M)
    assert len(options) >= 3
    for first, rest in options:
        head, _, text = first.partition("  ")  # "--flag VALUE   help text" or the help on the next lines
        assert text.strip() or rest.strip(), f"mcorekit {' '.join(command)}: {head} has no help"


def test_hf_config_override_replaces_the_files_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    code, out, err = run("launch", "--config", TINY, "--dry-run", "--set", f"run_root={tmp_path}",
                         f"model.hf_config={tmp_path}")
    assert code == 0, err
    assert "# model: llama, " in out and "  preset: null\n" in out and f"  hf_config: {tmp_path}\n" in out
    # both on the command line: one line that says which to drop
    code, _, err = run("launch", "--config", TINY, "--dry-run", f"model.hf_config={tmp_path}", "model.preset=llama-tiny")
    assert code == 2 and err.strip().splitlines() == [
        f"mcorekit: error: {TINY}: model.preset=llama-tiny and model.hf_config={tmp_path} both name the model; give "
        f"exactly one: set the other to null (e.g. model.preset=null)"]
    # and the other way: a preset on the command line replaces a file's hf_config
    exp = tmp_path / "exp.yaml"
    exp.write_text(Path(TINY).read_text().replace("preset: llama-tiny", f"hf_config: {tmp_path}"))
    code, out, err = run("launch", "--config", str(exp), "--dry-run", "--set", f"run_root={tmp_path}", "model.preset=llama-tiny")
    assert code == 0, err
    assert "  preset: llama-tiny\n" in out and "  hf_config: null\n" in out


def test_a_subcommand_after_options_is_named_not_launched() -> None:
    """`mcorekit launch --cluster local smoke` used to be read as a training launch with an override `smoke`."""
    code, out, err = run("launch", "--cluster", "local", "smoke")
    assert code == 2 and out == ""
    assert err == ("mcorekit: error: 'smoke' is a launch subcommand: name it first, then its options "
                   "(mcorekit launch smoke --cluster local)\n")
