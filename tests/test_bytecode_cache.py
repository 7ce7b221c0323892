"""A bytecode file cut short in mcorekit's cache folder (Python does not check that its write completed; a full disk,
a quota or a file-size limit cuts it) made every later command fail with marshal's traceback: the command now says
so in one line and removes the folder, and the next one compiles again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcorekit.caches import removed_if_damaged

REPO = Path(__file__).resolve().parent.parent


def test_a_cut_short_bytecode_file_is_one_line_and_the_folder_goes(tmp_path: Path) -> None:
    folder = tmp_path / "mcorekit" / "pycache"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPYCACHEPREFIX": str(folder)}
    cmd = [sys.executable, "-m", "mcorekit", "launch", "--config", "examples/llama-tiny.yaml", "--dry-run"]
    assert subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True).returncode == 0
    pyc = folder / str(REPO / "launch" / "cli.py").lstrip("/")
    [compiled] = pyc.parent.glob("cli.*.pyc")
    compiled.write_bytes(compiled.read_bytes()[:100])  # as a write cut at a file-size limit leaves it
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"mcorekit: error: a bytecode file in {folder} was cut short when it was written (a full disk, a quota or a "
        f"file-size limit?): marshal data too short; that cache folder is removed, run the command again"]
    assert not folder.exists()
    assert subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True).returncode == 0


def test_only_marshals_errors_in_our_own_folder_remove_anything(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ours = tmp_path / "mcorekit" / "pycache"
    ours.mkdir(parents=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "theirs"))
    assert removed_if_damaged(EOFError("marshal data too short")) is None and ours.exists()
    monkeypatch.setattr(sys, "pycache_prefix", str(ours))
    assert removed_if_damaged(ValueError("invalid literal for int()")) is None and ours.exists()
    assert removed_if_damaged(ValueError("bad marshal data (unknown type code)")) == ours and not ours.exists()


def test_a_training_process_says_so_too(tmp_path: Path) -> None:
    """python -m mcorekit.train shares the folder (its data workers and compile workers too)."""
    folder = tmp_path / "mcorekit" / "pycache"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPYCACHEPREFIX": str(folder),
           "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "mcorekit.train", "--config", "examples/llama-tiny.yaml", "--run-dir",
           str(tmp_path / "run")]
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert first.returncode == 2 and "no CUDA GPU" in first.stderr  # this machine has none: it stops there
    [compiled] = (folder / str(REPO / "config").lstrip("/")).glob("rules.*.pyc")  # imported inside main
    compiled.write_bytes(compiled.read_bytes()[:100])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"mcorekit.train: error: a bytecode file in {folder} was cut short")
    assert not folder.exists()
