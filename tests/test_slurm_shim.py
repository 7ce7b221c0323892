"""The Slurm shim that GPU machines without Slurm use (tests/slurm_shim): tasks get Slurm's environment, exit codes
come back, a requeue reruns the batch script with SLURM_RESTART_COUNT + 1, unknown options are refused. (The CPU
suite's launcher tests run against a real Slurm cluster; this only keeps the mock honest.)"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

SHIM = Path(__file__).parent / "slurm_shim"


def shim(tool: str, *args: str, state: Path, **kw: object) -> subprocess.CompletedProcess:
    (SHIM / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_SHIM_STATE=str(state), PATH=f"{SHIM}:{env['PATH']}")
    return subprocess.run([str(SHIM / tool), *args], env=env, capture_output=True, text=True, timeout=60, **kw)


def test_srun_gives_each_task_its_rank_and_the_worst_exit_code(tmp_path: Path) -> None:
    r = shim("srun", "-n", "3", "--output", str(tmp_path / "%j_%t.out"), "sh", "-c",
             "echo $SLURM_PROCID $SLURM_LOCALID $SLURM_NTASKS $SLURM_JOB_ID; exit $SLURM_PROCID", state=tmp_path / "s")
    assert r.returncode == 2
    outs = sorted(tmp_path.glob("*_*.out"))
    assert [p.read_text().split()[:3] for p in outs] == [["0", "0", "3"], ["1", "1", "3"], ["2", "2", "3"]]
    job = outs[0].read_text().split()[3]
    assert all(p.name.startswith(f"{job}_") for p in outs)


def test_srun_kill_on_bad_exit_ends_the_other_tasks_at_once(tmp_path: Path) -> None:
    """What every job's srun asks for (launch/submit.py): without it the shim gives the others GRACE_S (60 s)."""
    started = time.monotonic()
    r = shim("srun", "-n", "2", "--kill-on-bad-exit=1", "sh", "-c",
             'if [ "$SLURM_PROCID" = 1 ]; then exit 3; fi; sleep 50', state=tmp_path / "s")
    assert r.returncode != 0 and time.monotonic() - started < 20


def test_srun_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    r = shim("srun", "--container-image=nvcr.io#x", "true", state=tmp_path)
    assert r.returncode == 2 and "unsupported option --container-image" in r.stderr


def test_sbatch_runs_the_script_and_requeue_runs_it_again(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks-per-node=2\n#SBATCH --output=" + str(tmp_path / "%j.out") + "\n"
                      'echo "restart $SLURM_RESTART_COUNT tasks $SLURM_NTASKS"\n'
                      'if [ "$SLURM_RESTART_COUNT" = 0 ]; then scontrol requeue $SLURM_JOB_ID; exit 1; fi\n'
                      "srun sh -c 'echo task $SLURM_PROCID'\n")
    r = shim("sbatch", str(script), state=tmp_path / "s")
    assert r.returncode == 0 and r.stdout.startswith("Submitted batch job ")
    job = r.stdout.split()[-1]
    rc = tmp_path / "s" / f"{job}.rc"
    for _ in range(100):
        if rc.exists():
            break
        time.sleep(0.1)
    assert rc.read_text() == "0"
    lines = (tmp_path / f"{job}.out").read_text().splitlines()
    assert lines[:2] == ["restart 0 tasks 2", "restart 1 tasks 2"] and sorted(lines[2:]) == ["task 0", "task 1"]
