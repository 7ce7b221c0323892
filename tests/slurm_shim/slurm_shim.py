"""sbatch, srun and scontrol for the GPU machine, which has GPUs but no Slurm (and no network to install it).

A MOCK, used only there: it starts a job's tasks on this one host with the environment real Slurm gives them
(SLURM_JOB_ID, SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_NODELIST, ...), so the launcher's rendered
sbatch script, submitit and `python -m mcorekit.train` run unchanged. What it does not do: scheduling, limits,
accounting, signals before the time limit, several nodes. Options it does not know are refused, not ignored.
The CPU test suite runs against a real Slurm cluster instead (slurm/cluster.sh).

    sbatch SCRIPT                  -> "Submitted batch job N"; runs SCRIPT in the background (rc in $STATE/N.rc)
    srun [-n N] [--output F] [--error F] [--unbuffered] CMD...   -> N tasks of CMD, exit code the highest of any task
    scontrol requeue N | show hostnames LIST
State (job counter, exit codes, requeue markers) lives in $SLURM_SHIM_STATE (default /tmp/slurm-shim).
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("SLURM_SHIM_STATE", "/tmp/slurm-shim"))
GRACE_S = 60  # after one task fails, the others get this long before they are killed (a collective may hang)


def this_host() -> str:
    """The node name Slurm would give; 'localhost' where the machine's own name does not resolve (a bare VM)."""
    name = socket.gethostname()
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        return "localhost"


def fail(tool: str, msg: str) -> int:
    print(f"{tool} (mcorekit test shim): {msg}", file=sys.stderr)
    return 2


def next_job_id() -> str:
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "counter", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = int(f.read().strip() or "1000") + 1
        f.seek(0)
        f.truncate()
        f.write(str(n))
    return str(n)


def expand(pattern: str, job_id: str, task: int | None = None, name: str = "") -> str:
    out = pattern.replace("%j", job_id).replace("%x", name).replace("%%", "%")
    return out.replace("%t", str(task)) if task is not None else out


def directives(script: Path) -> dict[str, str]:
    """The script's #SBATCH --key=value lines."""
    found: dict[str, str] = {}
    for line in script.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:[=\s]+(.*))?$", line.strip())
        if m:
            found[m.group(1)] = (m.group(2) or "").strip()
    return found


def sbatch(argv: list[str]) -> int:
    args = [a for a in argv if a != "--parsable"]
    if len(args) != 1 or args[0].startswith("-"):
        return fail("sbatch", f"only `sbatch SCRIPT` is supported, got {argv}")
    script = Path(args[0]).resolve()
    d = directives(script)
    for key in ("array", "dependency"):
        if key in d:
            return fail("sbatch", f"--{key} is not supported (one host, no scheduler)")
    if int(d.get("nodes", "1")) != 1:
        return fail("sbatch", "one node only")
    job_id = next_job_id()
    name = d.get("job-name", script.stem)
    tasks = d.get("ntasks-per-node", d.get("ntasks", "1"))
    env = {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_JOB_NAME": name,
           "SLURM_NTASKS": tasks, "SLURM_NPROCS": tasks, "SLURM_NTASKS_PER_NODE": tasks, "SLURM_JOB_NUM_NODES": "1",
           "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": this_host(), "SLURM_NODEID": "0",
           "SLURM_SUBMIT_DIR": os.getcwd(), "SLURM_CLUSTER_NAME": "shim"}
    if "gpus-per-node" in d:
        env["SLURM_GPUS_ON_NODE"] = d["gpus-per-node"]
    out = expand(d.get("output", f"slurm-{job_id}.out"), job_id, name=name)
    err = expand(d.get("error", out), job_id, name=name)
    runner = [sys.executable, __file__, "_run", job_id, str(script), out, err]
    subprocess.Popen(runner, env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    print(job_id if "--parsable" in argv else f"Submitted batch job {job_id}", flush=True)
    return 0


def run_batch(job_id: str, script: str, out: str, err: str) -> int:
    """The batch step: runs the script, again after `scontrol requeue` (SLURM_RESTART_COUNT + 1), then records rc."""
    restarts = 0
    while True:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as o, open(err, "a") as e:
            rc = subprocess.run(["bash", script], env={**os.environ, "SLURM_RESTART_COUNT": str(restarts)},
                                stdout=o, stderr=e).returncode
        marker = STATE / f"{job_id}.requeue"
        if not marker.exists():
            break
        marker.unlink()
        restarts += 1
    (STATE / f"{job_id}.rc.tmp").write_text(str(rc))
    os.replace(STATE / f"{job_id}.rc.tmp", STATE / f"{job_id}.rc")
    return rc


def srun(argv: list[str]) -> int:
    ntasks, out, err, i, grace = None, None, None, 0, GRACE_S
    while i < len(argv) and argv[i].startswith("-"):
        opt, _, value = argv[i].partition("=")
        if opt == "--kill-on-bad-exit":  # as Slurm: one task's failure ends the step's other tasks at once
            grace = GRACE_S if value == "0" else 0
        if opt in ("--unbuffered", "-u", "--kill-on-bad-exit"):
            i += 1
            continue
        if opt not in ("-n", "--ntasks", "-o", "--output", "-e", "--error"):
            return fail("srun", f"unsupported option {argv[i]} (no containers or node placement here)")
        if not value:
            i += 1
            value = argv[i]
        i += 1
        if opt in ("-n", "--ntasks"):
            ntasks = int(value)
        elif opt in ("-o", "--output"):
            out = value
        else:
            err = value
    command = argv[i:]
    if not command:
        return fail("srun", "no command")
    job_id = os.environ.get("SLURM_JOB_ID") or next_job_id()  # outside an allocation srun makes one
    n = ntasks or int(os.environ.get("SLURM_NTASKS", "1"))
    base = {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
            "SLURM_NTASKS": str(n), "SLURM_NPROCS": str(n), "SLURM_STEP_NUM_TASKS": str(n), "SLURM_NODEID": "0",
            "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": os.environ.get("SLURM_JOB_NODELIST", this_host())}
    procs = []
    for t in range(n):
        env = {**base, "SLURM_PROCID": str(t), "SLURM_LOCALID": str(t)}
        stdout = open(expand(out, job_id, t), "a") if out else None
        stderr = open(expand(err, job_id, t), "a") if err else None
        procs.append(subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr))

    def forward(signum: int, frame: object) -> None:  # Slurm signals every task of the step
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    failed_at = None
    while None in [p.poll() for p in procs]:  # every task polled, so a failed one shows while another still runs
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at >= grace:
            for p in procs:
                if p.poll() is None:  # with what it started (as Slurm ends a step's processes), then itself
                    try:
                        subprocess.run(["pkill", "-KILL", "-P", str(p.pid)], check=False)
                    except OSError:  # no pkill here: the task alone
                        pass
                    p.kill()
        time.sleep(0.2)
    # like srun: the highest exit code of any task (a task killed by signal N counts as 128 + N)
    return max(c if c >= 0 else 128 - c for c in (p.returncode for p in procs))


def scontrol(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "requeue":
        STATE.mkdir(parents=True, exist_ok=True)
        (STATE / f"{argv[1]}.requeue").touch()
        return 0
    if len(argv) == 3 and argv[:2] == ["show", "hostnames"]:
        print("\n".join(argv[2].split(",")))
        return 0
    return fail("scontrol", f"only `requeue JOB` and `show hostnames LIST` are supported, got {argv}")


if __name__ == "__main__":
    tool, rest = sys.argv[1], sys.argv[2:]
    if tool == "_run":
        sys.exit(run_batch(*rest))
    sys.exit({"sbatch": sbatch, "srun": srun, "scontrol": scontrol}[tool](rest))
