"""`python -m mcorekit.train` by hand (issue 17): one error line without a GPU, and its run folder under the run
root (a launched run's own folder), never next to the config file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcorekit.train.__main__ import default_run_dir

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "llama-tiny.yaml"


def test_run_dir_is_the_launched_folder_or_under_the_run_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCOREKIT_RUN_ROOT", str(tmp_path / "root"))
    assert default_run_dir(TINY, "llama-tiny") == tmp_path / "root" / "llama-tiny-local"
    run = tmp_path / "root" / "llama-tiny-20261201-000000"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(TINY.read_text())
    assert default_run_dir(run / "config.yaml", "llama-tiny") == tmp_path / "root" / "llama-tiny-local"  # no cluster.yaml
    (run / "cluster.yaml").write_text("name: local\n")
    assert default_run_dir(run / "config.yaml", "llama-tiny") == run


def test_no_gpu_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    """CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on the GPU machine too."""
    before = sorted(p.name for p in TINY.parent.iterdir())
    env = {**os.environ, "MCOREKIT_RUN_ROOT": str(tmp_path / "root"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "mcorekit.train", "--config", str(TINY)], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [ln for ln in lines if "error" in ln] == lines and len(lines) == 1
    assert lines[0].startswith("mcorekit.train: error: no CUDA GPU on this machine")
    assert sorted(p.name for p in TINY.parent.iterdir()) == before and not (tmp_path / "root").exists()
