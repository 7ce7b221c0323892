"""A time-limit warning (USR2) that arrives once a job's work is done must not kill it: Python's exit restores the
default action of the signals it handles (terminate) before the process ends, and a finished job killed that way is
FAILED to Slurm, so its afterok children never run (the requeue test on the dev cluster hit it on 2026-12-02).
Real processes and real signals; the warning is sent over and over from the moment the work is done until exit.
Also the restart guard (runtime/requeue.RestartGuard): its refusals and a damaged restarts.json are one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

PAYLOAD = """
from mcorekit.runtime.requeue import StopSignal
stop = StopSignal()
import torch  # a payload's exit, long enough to be hit (torch's own teardown)
{done}
print("done", flush=True)
"""


def _exit_under_warnings(done: str) -> int:
    proc = subprocess.Popen([sys.executable, "-c", PAYLOAD.format(done=done)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "done"
    while proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGUSR2)
        except ProcessLookupError:
            break
        time.sleep(0.0005)
    return proc.wait()


@pytest.mark.parametrize("attempt", range(3))
def test_warning_after_the_work_is_done_leaves_a_clean_exit(attempt: int) -> None:
    assert _exit_under_warnings("stop.work_done()") == 0


def test_without_work_done_the_warning_kills_the_exit() -> None:
    """The failure the test above guards against, shown: the flag handler alone does not survive Python's exit (5 of 5
    exits killed here; one of three is asked, the window being the last part of the exit)."""
    assert -signal.SIGUSR2 in [_exit_under_warnings("") for _ in range(3)]


def test_work_done_leaves_termination_handled() -> None:
    from mcorekit.runtime.requeue import StopSignal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM)}
    stop = StopSignal()
    try:
        stop.work_done()
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("content, needle", [
    ("{", "restarts.json: unreadable (JSONDecodeError)"),
    ("{}", "restarts.json: not a list of {restart, start_step} records"),
    ('[{"restart": 0}]', "restarts.json: not a list of {restart, start_step} records"),
])
def test_a_damaged_restart_history_is_one_line(tmp_path, monkeypatch, content: str, needle: str) -> None:
    """It gave a JSONDecodeError, AttributeError or KeyError traceback on rank 0, the other ranks left waiting."""
    from mcorekit.errors import MCoreKitError
    from mcorekit.runtime.requeue import RestartGuard

    (tmp_path / "restarts.json").write_text(content)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(MCoreKitError, match=re.escape(needle)):
        RestartGuard(tmp_path, 5).check(10)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "x")
    (tmp_path / "restarts.json").unlink()
    with pytest.raises(MCoreKitError, match="SLURM_RESTART_COUNT='x' is not a whole number"):
        RestartGuard(tmp_path, 5).check(10)


def test_the_guard_refuses_in_one_line_and_records_each_start(tmp_path, monkeypatch) -> None:
    from mcorekit.errors import MCoreKitError
    from mcorekit.runtime.requeue import RestartGuard

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    RestartGuard(tmp_path, 1).check(0)
    RestartGuard(tmp_path, 1).record_requeue(0)  # the job requeued itself without saving anything new
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(MCoreKitError, match="would resume from step 0, the same step as the previous start"):
        RestartGuard(tmp_path, 1).check(0)
    RestartGuard(tmp_path, 1).check(5)
    RestartGuard(tmp_path, 5).record_requeue(9)  # as under max_restarts=5, lowered to 1 in config.yaml since
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    with pytest.raises(MCoreKitError, match="restart 2: the job has requeued itself 2 times, more than "
                                            "resources.max_restarts=1"):
        RestartGuard(tmp_path, 1).check(9)


def test_the_restart_cap_counts_the_jobs_own_requeues_only(tmp_path, monkeypatch) -> None:
    """A node failure (Slurm requeues the job: --requeue), an admin's `scontrol requeue` or a preemption raises
    SLURM_RESTART_COUNT too; the cap counted it, so a flaky node spent a run's requeues on the time limit. Now only
    the starts that requeued themselves count (restarts.json: requeued_at_step), per job: a --resume starts afresh."""
    import json

    from mcorekit.runtime.requeue import RestartGuard

    guard = RestartGuard(tmp_path, 2)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    for restart in range(4):  # the first start and three node failures, each before a save
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        guard.check(0)
    assert guard.allow_requeue()  # restart 3, none of them the job's own
    guard.record_requeue(50)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "4")
    guard.check(50)
    assert guard.allow_requeue()
    guard.record_requeue(90)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "5")
    guard.check(90)  # 2 own requeues of max_restarts=2: this start runs, and stops at its time limit
    assert not guard.allow_requeue()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "6")
    guard.check(95)  # a node failure after that: resumes too
    assert not guard.allow_requeue()
    monkeypatch.setenv("SLURM_JOB_ID", "78")  # `mcorekit launch --resume`: a new job, its own budget
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    guard.check(100)
    assert guard.allow_requeue()
    history = json.loads((tmp_path / "restarts.json").read_text())
    assert [(h["job_id"], h["restart"], h["start_step"], h.get("requeued_at_step")) for h in history] == [
        ("77", 0, 0, None), ("77", 1, 0, None), ("77", 2, 0, None), ("77", 3, 0, 50), ("77", 4, 50, 90),
        ("77", 5, 90, None), ("77", 6, 95, None), ("78", 0, 100, None)]


def test_a_restart_slurm_made_is_no_loop_even_without_progress(tmp_path, monkeypatch) -> None:
    """A node failure or a preemption before the first save restarts from the same step: Slurm requeued the job, it
    did not requeue itself, so that is no sign of a loop (the guard refused it and ended a recoverable run)."""
    import json

    from mcorekit.runtime.requeue import RestartGuard

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    RestartGuard(tmp_path, 5).check(0)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    RestartGuard(tmp_path, 5).check(0)  # preempted before any save: resumes where it started
    RestartGuard(tmp_path, 5).record_requeue(40)  # then saved at step 40 and requeued itself on the time limit
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    RestartGuard(tmp_path, 5).check(40)
    history = json.loads((tmp_path / "restarts.json").read_text())
    assert [(h["restart"], h["start_step"], h.get("requeued_at_step")) for h in history] == [
        (0, 0, None), (1, 0, 40), (2, 40, None)]


def test_a_start_before_a_step_the_job_had_reached_is_refused(tmp_path, monkeypatch) -> None:
    """Rank 0 finding no checkpoint (NFS showing the folder missing a moment) restarted the job from step 0 with a
    warning; its first save then deleted and overwrote newer checkpoints. A start below the furthest step this job
    started from or requeued itself at (restarts.json) is one error line, naming the folder and both steps, and is
    not recorded; a restart Slurm made at that step, and a new job (`launch --resume`), go on."""
    import json

    from mcorekit.errors import MCoreKitError
    from mcorekit.runtime.requeue import RestartGuard

    guard = RestartGuard(tmp_path, 5, tmp_path / "ckpts")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    guard.check(0)
    guard.record_requeue(40)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    guard.check(40)
    guard.record_requeue(80)
    before = (tmp_path / "restarts.json").read_text()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    for start, found in ((0, "step 0 (no checkpoint of its own found)"), (40, "step 40")):
        with pytest.raises(MCoreKitError) as refused:
            guard.check(start)
        assert str(refused.value) == (
            f"restart 2: job 77 had reached step 80 ({tmp_path / 'restarts.json'}) but would start from {found} in "
            f"{tmp_path / 'ckpts'}: the newer checkpoints look missing (a file system that shows another view, such "
            f"as NFS, or removed by hand); not resuming, its saves would overwrite them: check the file system or "
            f"restore iter_0000080 there, then `mcorekit launch --resume {tmp_path}`; or start a new run")
    assert (tmp_path / "restarts.json").read_text() == before
    guard.check(80)  # the checkpoint is seen again
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    guard.check(80)  # a restart Slurm made (preemption before a save): the same step is no regression
    monkeypatch.setenv("SLURM_JOB_ID", "78")  # `mcorekit launch --resume` after restoring an older checkpoint
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    guard.check(40)
    history = json.loads((tmp_path / "restarts.json").read_text())
    assert [(h["job_id"], h["restart"], h["start_step"]) for h in history] == [
        ("77", 0, 0), ("77", 1, 40), ("77", 2, 80), ("77", 3, 80), ("78", 0, 40)]
