"""`python -m mcorekit.train` by hand (issue 17): one error line without a GPU, and its run folder under the run
root (a launched run's own folder), never next to the config file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from single_rank import free_port

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


@pytest.mark.parametrize("case", ["rank variable not a number", "config name too long", "run dir under a file"])
def test_bad_environment_and_paths_are_one_line(tmp_path: Path, case: str) -> None:
    """Errors the OS raises (a file name too long, a file where the run folder goes) and rank variables that are not
    numbers: one line, exit 2. The last case reaches the run folder, which comes after the GPU check: the GPU is
    faked (torch.cuda.is_available patched in the child; nothing runs on it)."""
    env = {**os.environ, "MCOREKIT_RUN_ROOT": str(tmp_path / "root"), "CUDA_VISIBLE_DEVICES": ""}
    args, needle = ["--config", str(TINY)], ""
    if case == "rank variable not a number":
        env.update(RANK="0", WORLD_SIZE="two")
        needle = "environment variable WORLD_SIZE='two' is not a whole number"
    elif case == "config name too long":
        args, needle = ["--config", str(tmp_path / ("x" * 5000))], "File name too long"
    else:
        (tmp_path / "file").write_text("")
        args, needle = [*args, "--run-dir", str(tmp_path / "file" / "run")], "Not a directory"
    code = ("import sys, torch; torch.cuda.is_available = lambda: True\n"
            "from mcorekit.train.__main__ import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("mcorekit.train: error: ") and needle in lines[0], lines[0]


def test_a_finished_run_runs_the_exit_handlers_then_leaves_at_once(tmp_path: Path) -> None:
    """shut_down then leave, as `python -m mcorekit.train` ends a run, on a one-rank gloo group (the GPU run's NCCL
    group cannot start here). The child process stands in for torch's compile workers: it inherited our stdout and
    lives until an exit handler stops it. A plain os._exit skipped that handler and left the reader of our output
    waiting (a benchmark's pipe stayed open for 480 s on an H200); here the run ends at once, its exit handlers
    ran, its unflushed output arrived and the shutdown line has its marks."""
    script = tmp_path / "end.py"
    script.write_text(
        "import atexit, pathlib, subprocess, sys\n"
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(90)'])\n"
        "atexit.register(child.kill)\n"
        f"atexit.register(lambda: pathlib.Path({str(tmp_path / 'handler')!r}).write_text('ran'))\n"
        "sys.stdout = open(sys.stdout.fileno(), 'w', buffering=1 << 20, closefd=False)  # nothing flushes by itself\n"
        "print('last metrics line')\n"
        "from mcorekit.train.shutdown import leave, shut_down, stop_compile_workers\n"
        "stop_compile_workers()  # as the loop calls it before the final save: nothing compiled here, nothing to stop\n"
        "shut_down()\n"
        "print('after shutdown', end='')\n"
        "leave(0)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first, shutdown, last = proc.stdout.split("\n")
    assert first == "last metrics line" and last == "after shutdown"
    marks = json.loads(shutdown.removeprefix("mcorekit.train: shutdown "))
    assert list(marks) == ["trained", "host_cache_released", "ranks_through", "exit_handlers"]
    assert (tmp_path / "handler").read_text() == "ran"


RANK = """
import os, sys, time
import torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{sys.argv[2]}}", rank=rank, world_size=2)
from mcorekit.train import shutdown
shutdown.STORE_TIMEOUT_S = 5
destroyed = dist.destroy_process_group
dist.destroy_process_group = lambda *a, **k: (print("destroyed", flush=True), destroyed(*a, **k))
{body}
"""


def two_ranks(body: str, tmp_path: Path) -> list[tuple[int, str, str, float]]:
    """Two gloo ranks (NCCL needs GPUs) on a `tcp://` rendezvous, as train/build.py forms them: rank 0's process
    serves the store. Each rank's exit code, stdout, stderr and the time.time() its exit was seen."""
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(body=body))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    ended: dict[int, float] = {}
    import time

    deadline = time.time() + 120
    while len(ended) < 2 and time.time() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.time()
        time.sleep(0.01)
    outs = [p.communicate(timeout=10) for p in procs]
    return [(p.returncode, out, err, ended[r]) for r, (p, (out, err)) in enumerate(zip(procs, outs))]


def test_ranks_leave_together_without_destroying_their_groups(tmp_path: Path) -> None:
    """Two ranks end a run as `python -m mcorekit.train` does: shut_down, then leave. Their process groups are not
    destroyed, both exit 0 with no warning, and rank 0, whose process serves the store, is the last to go: rank 1,
    slow to leave here, posts that it leaves right before it does, and rank 0 waits for that (without it, rank 0
    left 2 s before rank 1, and a rank still asking the store would have found it gone)."""
    ranks = two_ranks("""
if rank == 1:
    time.sleep(1)  # rank 0 reaches the end first
shutdown.shut_down()
if rank == 1:
    time.sleep(2)  # slow to leave
print(f"leaving {time.time()}", flush=True)
shutdown.leave(0)
""", tmp_path)
    assert [code for code, *_ in ranks] == [0, 0], ranks
    assert not any("warning" in err.lower() or "Traceback" in err for _, _, err, _ in ranks), ranks
    assert not any("destroyed" in out for _, out, _, _ in ranks), ranks
    rank1_leaving = float(ranks[1][1].rsplit("leaving ", 1)[1])
    assert ranks[0][3] >= rank1_leaving, (ranks[0][3], rank1_leaving)
    assert "ranks_through" in ranks[0][1] and "mcorekit.train: shutdown" not in ranks[1][1]


def test_a_rank_that_never_reports_only_warns(tmp_path: Path) -> None:
    """Rank 1 ends without leaving through leave() (as if killed after the barrier): rank 0 waits STORE_TIMEOUT_S
    for it, warns in one line and still ends with 0 (its work is saved)."""
    ranks = two_ranks("""
shutdown.shut_down()
if rank == 1:
    os._exit(0)
shutdown.leave(0)
""", tmp_path)
    assert [code for code, *_ in ranks] == [0, 0], ranks
    warning = [ln for ln in ranks[0][2].splitlines() if ln.startswith("mcorekit.train: warning: ")]
    assert len(warning) == 1 and "not every rank reported the end of the run (left" in warning[0], ranks[0][2]
    assert ranks[0][3] - ranks[1][3] >= 4.5  # rank 0 waited its 5 s for rank 1


def test_a_rank_that_ends_through_the_interpreter_destroys_its_groups(tmp_path: Path) -> None:
    """After shut_down, a process that does not leave (a failing submitit runner; a caller that returns) ends through
    the interpreter: its process groups are destroyed at exit, so torch's finalization meets none alive."""
    ranks = two_ranks("""
shutdown.shut_down()
print("returned", flush=True)
""", tmp_path)
    assert [code for code, *_ in ranks] == [0, 0], ranks
    assert all(out.split("returned\n", 1)[1] == "destroyed\n" for _, out, _, _ in ranks), ranks


@pytest.mark.parametrize("ending", ["saved", "fails after saving", "exits 3 before saving"])
def test_a_launched_run_leaves_once_the_runner_is_done(tmp_path: Path, ending: str) -> None:
    """train/job.py's ending inside submitit's runner, with the runner stood in for by the script's last lines (it
    saves the job's result after the payload returns): once the result is saved the process leaves without the
    interpreter's finalization (the witness's __del__, which that finalization would run, never runs). A runner
    that fails after saving, or exits before, keeps the ordinary exit and its exit code."""
    result = tmp_path / "result.pkl"
    script = tmp_path / "runner.py"
    script.write_text(
        "import pathlib, sys\n"
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "class Witness:\n"
        f"    def __del__(self): pathlib.Path({str(tmp_path / 'finalized')!r}).write_text('yes')\n"
        "witness = Witness()\n"
        "from mcorekit.train.shutdown import leave_after_runner, shut_down\n"
        "shut_down()\n"
        f"leave_after_runner(pathlib.Path({str(result)!r}))\n"
        f"if {ending == 'exits 3 before saving'}:\n"
        "    sys.exit(3)\n"
        f"pathlib.Path({str(result)!r}).write_text('success')  # the runner saves the result\n"
        "print('runner done', end='')\n"
        f"if {ending == 'fails after saving'}:\n"
        "    raise RuntimeError('the runner failed after the payload')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    if ending == "saved":
        assert proc.returncode == 0, proc.stderr
        assert result.exists() and proc.stdout.endswith("runner done") and not (tmp_path / "finalized").exists()
        return
    assert (tmp_path / "finalized").exists()  # the ordinary exit
    if ending == "fails after saving":
        assert proc.returncode == 1 and "RuntimeError: the runner failed" in proc.stderr
    else:
        assert proc.returncode == 3 and not result.exists()


def test_the_launcher_payload_shuts_down_after_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainJob (what each srun task runs) trains, then shut_down, then leave_after_runner, in that order (training
    itself needs a GPU: stood in for here)."""
    from mcorekit.train import loop, shutdown
    from mcorekit.train.job import TrainJob

    calls: list[str] = []
    monkeypatch.setattr(loop, "train", lambda exp, run_dir, peak: calls.append(f"train {exp.name}") or [2.5, 2.0])
    monkeypatch.setattr(shutdown, "shut_down", lambda: calls.append("shut_down"))
    monkeypatch.setattr(shutdown, "leave_after_runner", lambda result: calls.append(f"leave_after_runner {result}"))
    monkeypatch.delenv("SUBMITIT_FOLDER", raising=False)  # not under submitit's runner: no result file to wait for
    assert TrainJob(str(TINY), str(tmp_path))() == {"steps": 2, "final_loss": 2.0}
    assert calls == ["train llama-tiny", "shut_down", "leave_after_runner None"]
