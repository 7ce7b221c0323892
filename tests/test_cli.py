"""The CLI's contract: every command explains itself, bad input is one line and exit 2, nothing pretends."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mcorekit.cli import PARTS, main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mcorekit", *args], capture_output=True, text=True)


def test_missing_config_is_one_line_naming_the_file() -> None:
    proc = run_cli("launch", "--config", "does-not-exist.yaml")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["mcorekit: error: config file not found: does-not-exist.yaml"]


@pytest.mark.parametrize("command", sorted(PARTS))
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main([command, "--help"])
    except SystemExit as e:  # argparse's own --help exits
        code = e.code
    assert code == 0
    assert f"mcorekit {command}" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["convert"], ["export"], ["data"], ["nonsense"], ["convert", "nonsense"]])
def test_a_missing_or_unknown_command_is_a_usage_error(argv: list[str]) -> None:
    proc = run_cli(*argv)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("usage: mcorekit") and "error:" in proc.stderr.splitlines()[-1], proc.stderr


@pytest.mark.parametrize("argv", [["--nope"], ["convert", "--tp", "2"]])
def test_an_option_before_the_command_is_named(argv: list[str]) -> None:
    """argparse said only that COMMAND was missing."""
    proc = run_cli(*argv)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].endswith(
        f"error: unknown option {argv[-2] if len(argv) > 1 else argv[0]}; a command comes first, its options after it "
        f"(`mcorekit {argv[0] + ' ' if len(argv) > 1 else ''}COMMAND --help`)"), proc.stderr


def test_version() -> None:
    from importlib.metadata import version

    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout == f"mcorekit {version('mcorekit')}\n"


def test_top_level_help_lists_commands() -> None:
    proc = run_cli("--help")
    for command in PARTS:
        assert command in proc.stdout


def test_training_on_a_cpu_only_profile_is_refused_before_submission(tmp_path) -> None:
    proc = run_cli("launch", "--config", "examples/llama-tiny.yaml", "--cluster", "local", "--set", f"run_root={tmp_path}")
    assert proc.returncode == 2 and "CPU-only" in proc.stderr
    assert not (tmp_path / "jobs.jsonl").exists()
