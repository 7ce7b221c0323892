"""What a job does after the save a stop signal asked for (runtime/requeue.stop_and_exit), with real processes and
real signals and a recording `scontrol` on PATH: the time-limit warning requeues unless the restart cap is reached,
and the requeue survives a busy controller. (Cancel and time-limit requeue on the real cluster: test_slurm_requeue.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RUN = """
import sys
from mcorekit.launch.smoke import CountingJob
CountingJob(sys.argv[1], total_steps=10_000, step_seconds=0.05, max_restarts=int(sys.argv[2]))()
"""


def fake_scontrol(bin_dir: Path, failures: int = 0, reason: str = "TimeLimit") -> Path:
    """`scontrol` that records each call in bin/calls and fails its first `failures` requeues, as a busy slurmctld
    does; `show job` answers with the job's end `reason`, as Slurm 22.05 does once it ends a job (the dev cluster), and
    a user's Comment after it that must not count."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(f"""#!/bin/sh
echo "$@" >> {bin_dir}/calls
if [ "$1" = show ]; then
  echo "JobId=4242 JobName=x JobState=COMPLETING Reason={reason} Dependency=(null) Comment=not Reason=TimeLimit"; exit 0
fi
n=$(grep -c requeue {bin_dir}/calls)
if [ "$n" -le {failures} ]; then echo "slurm_requeue error: Socket timed out on send/recv operation" >&2; exit 1; fi
""")
    script.chmod(0o755)
    return bin_dir / "calls"


def run_until_signalled(tmp_path: Path, sig: int | tuple[int, ...], restart: int, max_restarts: int,
                        failures: int = 0, own_requeues: int = 0,
                        reason: str = "TimeLimit") -> tuple[int, str, list[str]]:
    """CountingJob as job 4242 at SLURM_RESTART_COUNT=restart, after `own_requeues` starts of it that requeued
    themselves on the time limit (restarts.json, a checkpoint at step 10 each): it steps, gets `sig` (or those
    signals, in order), saves; its exit code, stderr and the scontrol calls it made."""
    calls = fake_scontrol(tmp_path / "bin", failures, reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{tmp_path / 'bin'}:{env['PATH']}", SLURM_JOB_ID="4242", SLURM_RESTART_COUNT=str(restart),
               MCOREKIT_REQUEUE_BACKOFF_S="0.1")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if own_requeues:
        history = [{"restart": i, "start_step": 10 * i, "job_id": "4242", "requeued_at_step": 10 * (i + 1)}
                   for i in range(own_requeues)]
        (run_dir / "restarts.json").write_text(json.dumps(history))
        (run_dir / "ckpt").mkdir()
        (run_dir / "ckpt" / "latest").write_text(str(10 * own_requeues))
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(run_dir), str(max_restarts)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (run_dir / "steps.log").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    for one in sig if isinstance(sig, tuple) else (sig,):
        proc.send_signal(one)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err, calls.read_text().splitlines() if calls.exists() else []


REQUEUED, STOPPED, TERMINATED = 255, 1, 128 + signal.SIGTERM  # SystemExit(-1) after a requeue; at the cap; on TERM


def test_time_limit_warning_requeues_below_the_cap(tmp_path: Path) -> None:
    code, err, calls = run_until_signalled(tmp_path, signal.SIGUSR2, restart=1, max_restarts=3)
    assert calls == ["requeue 4242"] and code == REQUEUED, err


def test_the_time_limits_own_term_after_the_warning_still_requeues(tmp_path: Path) -> None:
    """Slurm's TERM at the time limit may arrive while the save the warning started runs: still the time limit."""
    code, err, calls = run_until_signalled(tmp_path, (signal.SIGUSR2, signal.SIGTERM), restart=1, max_restarts=3)
    assert calls == ["show job -o 4242", "requeue 4242"] and code == REQUEUED, err


def test_a_cancel_after_the_warning_stops_without_requeueing(tmp_path: Path) -> None:
    """An scancel within the warning's lead (the save still running): Slurm gives no time-limit reason, so the job
    stops as on any TERM; a requeue would have run it again (`scontrol requeue` takes a job being cancelled)."""
    code, err, calls = run_until_signalled(tmp_path, (signal.SIGUSR2, signal.SIGTERM), restart=1, max_restarts=3,
                                           reason="None")
    assert calls == ["show job -o 4242"] and code == TERMINATED, err
    assert "Slurm ends the job for another reason (None, job state COMPLETING)" in err


def test_term_alone_stops_without_requeueing(tmp_path: Path) -> None:
    code, err, calls = run_until_signalled(tmp_path, signal.SIGTERM, restart=1, max_restarts=3)
    assert calls == [] and code == TERMINATED, err


def test_at_the_restart_cap_the_job_saves_and_stops_without_requeueing(tmp_path: Path) -> None:
    """It requeued itself and only the next start refused: a whole queue wait for nothing."""
    code, err, calls = run_until_signalled(tmp_path, signal.SIGUSR2, restart=3, max_restarts=3, own_requeues=3)
    assert calls == [] and code == STOPPED
    # one error line, which `mcorekit status` shows as the job's diagnosis (it said nothing for this FAILED job)
    line = next(ln for ln in err.splitlines() if ln.startswith("mcorekit.train: error: "))
    assert line.startswith("mcorekit.train: error: stopped at its restart cap (resources.max_restarts=3): time limit "
                           "near at step "), err
    assert "not requeueing: the job has requeued itself 3 times" in line
    assert f"`mcorekit launch --resume {tmp_path / 'run'}` continues from this checkpoint" in line
    from mcorekit.launch.diagnose import diagnose

    assert diagnose([err]) == line.removeprefix("mcorekit.train: error: ")
    assert int((tmp_path / "run" / "ckpt" / "latest").read_text()) > 30


def test_restarts_slurm_made_leave_the_restart_budget_alone(tmp_path: Path) -> None:
    """Restart 3 after one requeue of its own and two Slurm made (node failures, an admin's `scontrol requeue`,
    preemption): the cap counts the job's own requeues, 1 of 3, so the time limit requeues it. It counted
    SLURM_RESTART_COUNT, and stopped a run whose budget the cluster had spent."""
    code, err, calls = run_until_signalled(tmp_path, signal.SIGUSR2, restart=3, max_restarts=3, own_requeues=1)
    assert calls == ["requeue 4242"] and code == REQUEUED, err
    history = json.loads((tmp_path / "run" / "restarts.json").read_text())
    assert [h.get("requeued_at_step") is not None for h in history] == [True, True]
    assert history[-1]["restart"] == 3 and history[-1]["start_step"] == 10


def test_a_busy_controller_is_asked_again(tmp_path: Path) -> None:
    """`scontrol requeue` failing twice (slurmctld busy) after a good save failed the job; now retried with backoff."""
    code, err, calls = run_until_signalled(tmp_path, signal.SIGUSR2, restart=0, max_restarts=3, failures=2)
    assert calls == ["requeue 4242"] * 3 and code == REQUEUED, err
    assert "retrying" in err and "Traceback" not in err


def test_a_controller_that_never_answers_is_one_error(tmp_path: Path) -> None:
    code, err, calls = run_until_signalled(tmp_path, signal.SIGUSR2, restart=0, max_restarts=3, failures=99)
    assert len(calls) == 4 and code == STOPPED
    assert "scontrol requeue 4242 failed 4 times" in err and "mcorekit launch --resume" in err, err


TWO_RANKS = """
import sys
import torch.distributed as dist
from pathlib import Path
from mcorekit.runtime.requeue import RestartGuard, StopSignal, stop_and_exit

rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/store", rank=rank, world_size=2)
stop = StopSignal()
stop.signum = 12  # USR2 on every rank, as Slurm sends it
if len(sys.argv) > 3:  # then TERM, on every rank, while the save ran
    stop.signum, stop.time_limit = 15, True

def close() -> None:  # rank 0's loggers close slowly (W&B's finish): no rank may leave before
    if rank == 0:
        import time
        time.sleep(1)
        with open(Path(sys.argv[1], "events"), "a") as f:
            print("closed", file=f)


try:
    stop_and_exit(stop, RestartGuard(Path(sys.argv[1]), 3), rank, 5, close=close)
finally:
    with open(Path(sys.argv[1], "events"), "a") as f:  # appended: the file's order is the order things happened
        print(f"exit {rank}", file=f)
    # a gloo group left to interpreter exit at times aborts the process (SIGABRT, "terminate called without an
    # active exception": its worker thread frees a tensor after Python is gone), more often on a loaded machine
    dist.destroy_process_group()
"""


def test_other_ranks_leave_only_after_rank_0_requeued(tmp_path: Path) -> None:
    """A rank that exits non-zero before rank 0 has requeued can end the job FAILED first (srun, KillOnBadExit), and
    a chain's afterok children with it; the ranks wait for rank 0's requeue, then for its loggers to close. The order
    is the one the processes wrote their events in (one file, appended), not their clocks': a loaded machine changes
    no order. The slow `scontrol` gives rank 1 2-3 s to leave first and returns as soon as it has, so a rank that does
    not wait shows."""
    bin_dir, events = tmp_path / "bin", tmp_path / "events"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"""#!/bin/sh
echo "scontrol $*" >> '{events}'
end=$(($(date +%s) + 3))
until [ "$(date +%s)" -ge "$end" ] || grep -qx 'exit 1' '{events}'; do sleep 0.05; done
echo requeued >> '{events}'
""")
    (bin_dir / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="0",
               MCOREKIT_REQUEUE_BACKOFF_S="0.1")
    logs = [tmp_path / f"rank{r}.err" for r in (0, 1)]
    procs = []
    for r, log in enumerate(logs):
        with log.open("w") as err:  # a file, not a pipe: nothing blocks on a full pipe while the other is waited for
            procs.append(subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(tmp_path), str(r)], env=env,
                                          stderr=err))
    deadline = time.monotonic() + 300  # two torch imports and a gloo group, ~15 s here alone: generous when loaded
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # the return codes below fail, with both ranks' stderr
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errs = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [REQUEUED, REQUEUED], errs
    order = events.read_text().splitlines()  # scontrol requeue 4242, requeued, exit 0, exit 1 (or 1, 0)
    assert order[0] == "scontrol requeue 4242", order
    assert sorted(e for e in order if e.startswith("exit")) == ["exit 0", "exit 1"], order
    assert "requeued" in order[: order.index("exit 1")], (order, errs)
    assert order.index("requeued") < order.index("closed") < order.index("exit 1"), (order, errs)


@pytest.mark.parametrize("reason, code", [("TimeLimit", REQUEUED), ("None", TERMINATED)])
def test_two_ranks_decide_a_term_after_the_warning_together(tmp_path: Path, reason: str, code: int) -> None:
    """Two gloo ranks, TERM after the warning on both: rank 0 asks Slurm why (one `scontrol show job`), both take its
    answer: requeue at the time limit, stop on a cancel."""
    fake_scontrol(tmp_path / "bin", reason=reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{tmp_path / 'bin'}:{env['PATH']}", SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="0")
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(tmp_path), str(r), "late-term"], env=env,
                              stderr=subprocess.DEVNULL) for r in (0, 1)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    calls = (tmp_path / "bin" / "calls").read_text().splitlines()
    assert codes == [code, code]
    assert calls == ["show job -o 4242"] + (["requeue 4242"] if code == REQUEUED else [])


def test_the_loggers_close_after_the_requeue_within_a_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """W&B's finish runs once the job is requeued (the decision first, within Slurm's KillWait), for at most CLOSE_S:
    one that hangs or fails is a warning, and the exit code is the decision's; one that hangs is left by os._exit
    (the interpreter's exit would wait for W&B's service), here raising instead of ending the test process."""
    from mcorekit.runtime import requeue

    calls = fake_scontrol(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setattr(requeue, "CLOSE_S", 0.5)

    def exit_now(code: int) -> None:
        raise SystemExit(f"os._exit({code})")

    monkeypatch.setattr(requeue.os, "_exit", exit_now)
    stop = requeue.StopSignal.__new__(requeue.StopSignal)  # no handlers in the test process
    stop.signum, stop.time_limit = signal.SIGUSR2, True
    seen: list[str] = []

    def hanging() -> None:
        seen.append(calls.read_text())  # the requeue was asked before the loggers close
        time.sleep(30)

    def failing() -> None:
        raise RuntimeError("wandb: network unreachable")

    for close, said, code in ((hanging, "the loggers did not close within 0.5 s", "os._exit(255)"),
                              (failing, "closing the loggers failed (RuntimeError: wandb: network unreachable)", -1)):
        (tmp_path / close.__name__).mkdir()
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="mcorekit.requeue"), pytest.raises(SystemExit) as leaving:
            requeue.stop_and_exit(stop, requeue.RestartGuard(tmp_path / close.__name__, 9), 0, 5, close=close)
        assert leaving.value.code == code and time.monotonic() - started < 10
        assert said in caplog.text
    assert seen == ["requeue 4242\n"]
