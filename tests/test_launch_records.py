"""`mcorekit launch` (its dry run too) refuses a checkpoint.load whose bytes records would run code when unpickled,
before queueing, as training refuses it at its start (train/checkpoint.checked_sources): one error line, exit 2,
nothing of the record run. The checkpoints are real torch_dist ones, written on CPU by the Saver's writer
(tests/test_checkpoint_writer.py), with one crafted record as tests/test_checkpoint_reader.py makes them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_checkpoint_writer import _finalize_on_cpu, _save, _state  # noqa: F401  # the fixture applies here too
from test_launch_options import run

TINY = Path(__file__).resolve().parent.parent / "examples" / "llama-tiny.yaml"


class Evil:
    """Pickles as a call to os.system that creates `marker` (what a crafted record does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def _checkpoints(root: Path, record: Any = None) -> Path:
    """A checkpoints root holding iter_0000003 (and its tracker), with one more bytes record `record` if given;
    returns the iteration folder."""
    from megatron.core.dist_checkpointing import ShardedObject

    state = _state()
    if record is not None:
        state["layer._extra_state"] = ShardedObject("layer._extra_state", record, (1,), (0,), replica_id=0)
    iter_dir = root / "iter_0000003"
    root.mkdir(parents=True)
    _save(iter_dir, ours=True, state=state)
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    return iter_dir


def _dry_run(tmp_path: Path, load: Path) -> tuple[int, str, str]:
    return run("launch", "--config", str(TINY), f"checkpoint.load={load}", "--set", f"run_root={tmp_path}/runs",
               "--dry-run")


@pytest.mark.parametrize("named", ["root", "iteration"])
def test_a_record_that_would_run_code_is_refused_at_launch(model_parallel: None, tmp_path: Path, named: str) -> None:
    marker = tmp_path / "MARKER"
    iter_dir = _checkpoints(tmp_path / "base", [Evil(marker)])
    code, out, err = _dry_run(tmp_path, tmp_path / "base" if named == "root" else iter_dir)
    assert (code, out) == (2, ""), err
    [line] = err.splitlines()
    assert line.startswith(f"mcorekit: error: checkpoint {iter_dir}: record layer._extra_state"), line
    assert "asks to run posix.system when it is unpickled: refusing to load it" in line
    assert "Traceback" not in err and not marker.exists()
    assert not (tmp_path / "runs").exists()  # nothing made for the run


@pytest.mark.parametrize("named", ["root", "iteration"])
def test_the_same_checkpoint_without_it_launches(model_parallel: None, tmp_path: Path, named: str) -> None:
    iter_dir = _checkpoints(tmp_path / "base")
    load = tmp_path / "base" if named == "root" else iter_dir
    code, out, err = _dry_run(tmp_path, load)
    assert code == 0 and "mcorekit: error" not in err, err
    assert f"load: {load}" in out  # the job still gets the path as given (the job resolves its latest iteration)


def test_a_launch_without_checkpoint_load_does_not_import_torch(tmp_path: Path) -> None:
    """The check imports torch (seconds): a plain launch, and one whose checkpoint.load this machine lacks (a
    warning), must not pay for it."""
    script = ("import sys\nfrom mcorekit.cli import main\n"
              "code = main(sys.argv[1:])\nassert 'torch' not in sys.modules, 'torch imported'\nsys.exit(code)")
    for extra in ([], [f"checkpoint.load={tmp_path}/gone"]):
        proc = subprocess.run([sys.executable, "-c", script, "launch", "--config", str(TINY), *extra, "--set",
                               f"run_root={tmp_path}/runs", "--dry-run"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert ("no folder" in proc.stderr) == bool(extra), proc.stderr
