"""bench/cold_start.py on a CPU: each case's process is stopped, with what it started, at its startup line; each case
gets the caches it names (under --out, never the user's; the first runs empty ones, first-serial with the background
compile's lock held); the table and results.json. The training process is a stand-in here (no GPU); the GPU run is
recorded in docs/results."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import cold_start  # noqa: E402

STARTUP = {"imports": 1.5, "checks": 6.0, "dist_init": 6.1, "model": 6.6, "optimizer": 7.0, "resume": 7.1,
           "step1": 11.0}


def test_the_process_and_its_children_are_stopped_at_the_startup_line(tmp_path: Path) -> None:
    child_pid = tmp_path / "child.pid"
    script = (
        "import json, subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(child_pid)!r}, 'w').write(str(c.pid))\n"
        "print('loading', flush=True)\n"
        f"print('mcorekit.train: startup ' + json.dumps({STARTUP!r}), flush=True)\n"
        "time.sleep(600)\n")
    start = time.time()
    marks, out = cold_start.until_step1([sys.executable, "-c", script], dict(os.environ), tmp_path / "log.txt")
    assert marks == STARTUP and time.time() - start < 60
    assert (tmp_path / "log.txt").read_text() == out and out.startswith("loading\n")
    pid = int(child_pid.read_text())
    for _ in range(100):  # the grandchild went with the group (a zombie until its parent's reaper runs)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"process {pid} still running")


def test_a_process_that_ends_without_the_line_is_an_error(tmp_path: Path) -> None:
    marks, out = cold_start.until_step1([sys.executable, "-c", "print('mcorekit.train: error: no GPU')"],
                                        dict(os.environ), tmp_path / "log.txt")
    assert marks == {} and "no GPU" in out


def test_each_case_gets_its_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, str]] = []
    locked: list[bool] = []
    out = tmp_path / "out"
    pycache = out / "cache" / "mcorekit" / "pycache"

    def fake(cmd: list[str], env: dict[str, str], log: Path) -> tuple[dict[str, float], str]:
        assert cmd[1:3] == ["-m", "mcorekit.train"] and Path(cmd[cmd.index("--config") + 1]).is_file()
        seen.append(env)
        if len(seen) <= 2:  # the first runs find the caches empty; first-serial finds the precompile's lock held
            assert [p.name for p in (out / "cache").rglob("*")] == ["mcorekit", "pycache", "precompile.lock"]
            with open(pycache / "precompile.lock") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked.append(False)
                except OSError:
                    locked.append(True)
        (pycache / f"written-by-{len(seen)}").write_text("")
        Path(env["CUDA_CACHE_PATH"]).mkdir(exist_ok=True)
        (Path(env["CUDA_CACHE_PATH"]) / f"kernels-{len(seen)}").write_bytes(b"k" * 250_000)
        log.write_text("output")
        return ({} if len(seen) == 5 else STARTUP), "Traceback: CUDA out of memory"

    monkeypatch.setattr(cold_start, "until_step1", fake)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/users/own")
    monkeypatch.setenv("CUDA_CACHE_PATH", "/users/own/nv")
    monkeypatch.setenv("CUDA_CACHE_DISABLE", "1")
    assert cold_start.main(["--out", str(out)]) == 1  # a case failed
    assert len(seen) == len(cold_start.CASES) == 6 and locked == [True, False]
    assert sorted(p.name for p in pycache.glob("written-by-*")) == [f"written-by-{i}" for i in (2, 3, 4, 5, 6)]
    for case, env in zip(cold_start.CASES, seen):
        assert env["XDG_CACHE_HOME"] == str(out / "cache") and "TORCHINDUCTOR_CACHE_DIR" not in env
        cuda = out / ("no-cuda-cache-folder" if case == "no-cuda-cache" else "cache/cuda")
        assert env["CUDA_CACHE_PATH"] == str(cuda) and "CUDA_CACHE_DISABLE" not in env
        assert env["TRITON_CACHE_DIR"] == str(out / "cache" / "triton")
        assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1"
        assert ("PYTHONPYCACHEPREFIX" in env) == (case == "no-bytecode")
    assert seen[4]["PYTHONPYCACHEPREFIX"] == str(out / "no-bytecode-prefix")
    got: list[dict[str, Any]] = json.loads((out / "results.json").read_text())
    assert got[0]["case"] == "environment" and set(got[0]) == {"case", "PYTHONDONTWRITEBYTECODE",
                                                              "torch_installed_with_bytecode", "cold_disk"}
    assert got[0]["cold_disk"] is False
    assert got[1]["phases"] == {"imports": 1.5, "checks": 4.5, "dist_init": 0.1, "model": 0.5, "optimizer": 0.4,
                                "resume": 0.1, "step1": 3.9}
    assert got[5] == {"case": "no-bytecode", "error": "Traceback: CUDA out of memory"}
    # the first runs start from empty caches: one file each, then the later cases add theirs, but for no-cuda-cache,
    # which writes to a folder of its own and reports that (the 5th failed after writing)
    assert [r["cache_mb"]["cuda"] for r in got[1:] if "cache_mb" in r] == [0.2, 0.2, 0.5, 0.2, 1.0]
    assert (out / "no-cuda-cache-folder" / "kernels-4").is_file()
    assert got[1]["cache_mb"] == {"bytecode": 0.0, "torch_compile": 0.0, "cuda": 0.2, "triton": 0.0}
    table = cold_start.table(got[1:])
    assert "| first-serial | 11.00 | 1.50 | 4.50 | 0.10 | 0.50 | 0.40 | 0.10 | 3.90 |" in table
    assert "| no-bytecode | failed | | | | | | | |" in table and table.splitlines()[1] == "|---" * 9 + "|"


def test_dry_run_checks_the_experiment_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cold_start.main(["--dry", "--out", str(tmp_path)]) == 0
    assert "cold start: " in capsys.readouterr().out


def test_a_silent_process_is_stopped_after_the_time_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cold_start, "TIMEOUT_S", 1.0)
    start = time.time()
    marks, _ = cold_start.until_step1([sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ),
                                      tmp_path / "log.txt")
    assert marks == {} and time.time() - start < 30


def test_cold_disk_drops_the_installs_before_each_first_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--cold-disk: before each first run (not the later cases), every folder holding one of the packages and
    the standard library leaves the page cache. The dropping itself is start_save.drop_page_cache (posix_fadvise)."""
    runs: list[int] = []
    dropped: list[tuple[int, Path]] = []
    monkeypatch.setattr(cold_start, "until_step1", lambda cmd, env, log: (runs.append(1), (STARTUP, ""))[1])
    monkeypatch.setattr(cold_start, "drop_page_cache", lambda folder: dropped.append((len(runs), folder)))
    assert cold_start.main(["--out", str(tmp_path / "out"), "--cold-disk"]) == 0
    folders = cold_start.install_folders()
    import torch

    assert Path(torch.__file__).parent.parent in folders and folders[-1] == Path(os.__file__).parent
    assert dropped == [(i, f) for i in range(2) for f in folders] and len(runs) == 6
    assert json.loads((tmp_path / "out" / "results.json").read_text())[0]["cold_disk"] is True
