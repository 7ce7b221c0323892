"""Run folders are claimed, not assumed: launches of the same second never share one, a failed or interrupted
launch removes only a folder that no queued job reads, and a chain whose rollback fails says what is left.

CPU only: a recording `sbatch` (and `scancel`) on PATH; nothing runs.
"""

from __future__ import annotations

import io
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from submitit.core.utils import DelayedSubmission

from mcorekit.launch import api, submit
from test_faults_launch import run_main

REPO = Path(__file__).resolve().parent.parent
STAMP = "20261205-120000"


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@dataclass
class Slurm:
    """The fake's state: jobs/N/script.sh for each sbatch call (job id N); touch fail-at-N to refuse call N, hold to
    make sbatch wait 2 s (after touching `started`) before it answers; scancel's calls in scancel.log."""

    bin: Path

    def scripts(self) -> dict[str, str]:
        return {d.name: (d / "script.sh").read_text() for d in sorted((self.bin / "jobs").iterdir())}

    def scancel_fails(self) -> None:
        executable(self.bin / "scancel", '#!/bin/sh\necho "$*" >> "$(dirname "$0")/scancel.log"\n'
                                         'echo "scancel: error: Kill job error on job id $1: Access/permission '
                                         'denied" >&2\nexit 1\n')

    def cancelled(self) -> list[str]:
        log = self.bin / "scancel.log"
        return log.read_text().split() if log.exists() else []


@pytest.fixture
def slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Slurm:
    bin_dir = tmp_path / "bin"
    (bin_dir / "jobs").mkdir(parents=True)
    executable(bin_dir / "srun", "#!/bin/sh\nexit 0\n")
    # mkdir takes the next job id atomically: concurrent sbatch calls get distinct ones
    executable(bin_dir / "sbatch", '#!/bin/sh\nd="$(dirname "$0")"\nn=1\n'
                                   'while ! mkdir "$d/jobs/$n" 2>/dev/null; do n=$((n + 1)); done\n'
                                   'cp "$1" "$d/jobs/$n/script.sh"\n'
                                   'if [ -e "$d/hold" ]; then touch "$d/started"; sleep 2; fi\n'
                                   'if [ -e "$d/fail-at-$n" ]; then\n'
                                   '  echo "sbatch: error: Batch job submission failed: fake refusal of job $n" >&2\n'
                                   '  exit 1\nfi\necho "Submitted batch job $n"\n')
    executable(bin_dir / "scancel", '#!/bin/sh\necho "$*" >> "$(dirname "$0")/scancel.log"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return Slurm(bin_dir)


@pytest.fixture
def same_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch plans its run folder in the same second."""
    real = time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, *t: STAMP if fmt == "%Y%m%d-%H%M%S" else real(fmt, *t))


def write_inputs(root: Path) -> tuple[Path, Path]:
    """A GPU profile (nothing runs) and a tiny experiment."""
    profile = root / "gpu2.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "test-gpu2", "partition": "debug", "gpus_per_node": 2, "cpus_per_task": 1, "time_limit": "00:10:00",
        "signal_seconds": 30, "transformer_engine": False, "run_root": str(root / "runs")}))
    experiment = root / "exp.yaml"
    experiment.write_text(yaml.safe_dump({
        "name": "jb", "model": {"preset": "llama-tiny"}, "data": {"seq_length": 128},
        "schedule": {"micro_batch_size": 1, "global_batch_size": 4}, "resources": {"time": "00:05:00"}}))
    return profile, experiment


def registry(runs: Path) -> list[dict]:
    path = runs / "jobs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def lr_in(run_dir: Path) -> float:
    return yaml.safe_load((run_dir / "config.yaml").read_text())["optimizer"]["lr"]


def payload(run_dir: Path, job: str):
    return DelayedSubmission.load(run_dir / "logs" / f"{job}_submitted.pkl").function


# ---------------------------------------------------------------- same-second launches


def test_launches_of_the_same_second_get_their_own_folders(tmp_path: Path, slurm: Slurm, same_second: None) -> None:
    """Both planned the same folder when loaded; the second submission finds it taken and moves to .1 whole: its
    config, its job's script and payload, its registry line (and the path the launcher prints, p.spec.run_dir)."""
    profile, experiment = write_inputs(tmp_path)
    first, second = (api.load(experiment, profile, [f"optimizer.lr={lr}"]) for lr in (1e-4, 2e-4))
    planned = tmp_path / "runs" / f"jb-{STAMP}"
    assert first.spec.run_dir == second.spec.run_dir == planned
    jobs = [api.submit_prepared(p) for p in (first, second)]
    moved = tmp_path / "runs" / f"jb-{STAMP}.1"
    assert [p.spec.run_dir for p in (first, second)] == [planned, moved]
    assert (lr_in(planned), lr_in(moved)) == (1e-4, 2e-4)
    assert (moved / "cluster.yaml").is_file()
    scripts = slurm.scripts()
    assert f"{planned}/" in scripts["1"] and f"{moved}/" not in scripts["1"]
    assert f"{moved}/" in scripts["2"] and f"{planned}/" not in scripts["2"]
    assert payload(moved, jobs[1].job_id).config_path == str(moved / "config.yaml")
    assert [(e["job_id"], e["run_dir"]) for e in registry(tmp_path / "runs")] == [("1", str(planned)),
                                                                                  ("2", str(moved))]


def test_concurrent_launches_never_share_a_folder(tmp_path: Path, slurm: Slurm, same_second: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    profile, experiment = write_inputs(tmp_path)
    lrs = [i * 1e-4 for i in range(1, 7)]
    prepared = [api.load(experiment, profile, [f"optimizer.lr={lr}"]) for lr in lrs]
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # redirect_stderr in each thread swaps the one sys.stderr
    start, errors = threading.Barrier(len(prepared)), []

    def launch(p: api.Prepared) -> None:
        start.wait()
        try:
            api.submit_prepared(p)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=launch, args=(p,)) for p in prepared]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    folders = {p.spec.run_dir for p in prepared}
    runs = tmp_path / "runs"
    assert folders == {runs / f"jb-{STAMP}"} | {runs / f"jb-{STAMP}.{n}" for n in range(1, len(lrs))}
    assert [lr_in(p.spec.run_dir) for p in prepared] == lrs  # each kept its own config
    assert sorted(e["run_dir"] for e in registry(runs)) == sorted(map(str, folders))


def test_a_chain_whose_folder_was_taken_moves_its_stages_with_it(tmp_path: Path, slurm: Slurm) -> None:
    """The stages were made for the planned folder: training's config and folder, the checkpoints convert reads."""
    profile, experiment = write_inputs(tmp_path)
    p = api.load(experiment, profile)
    planned = p.spec.run_dir
    planned.mkdir(parents=True)  # another launch of the same second made it meanwhile
    (planned / "config.yaml").write_text("theirs\n")
    convert = api.cli_payload(["convert", "mcore-to-hf", str(planned / "checkpoints"), str(tmp_path / "hf")])
    stages = [api.training_stage(p), api.Stage("jb-convert", convert, gpus_per_node=0)]
    api.submit_chain(p.profile, stages, planned, save=p.save)
    moved = planned.with_name(planned.name + ".1")
    assert (planned / "config.yaml").read_text() == "theirs\n" and sorted(os.listdir(planned)) == ["config.yaml"]
    assert lr_in(moved) == p.experiment.optimizer.lr
    train, conv = payload(moved / "jb-train", "1"), payload(moved / "jb-convert", "2")
    assert (train.config_path, train.run_dir) == (str(moved / "config.yaml"), str(moved))
    assert conv.argv == ["convert", "mcore-to-hf", str(moved / "checkpoints"), str(tmp_path / "hf")]
    assert f"mcorekit convert mcore-to-hf {moved}/checkpoints " in slurm.scripts()["2"]
    assert [e["run_dir"] for e in registry(tmp_path / "runs")] == [str(moved / "jb-train"), str(moved / "jb-convert")]


def test_a_sweep_or_smoke_whose_folder_was_taken_moves_and_says_where(tmp_path: Path, slurm: Slurm, same_second: None,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    profile, experiment = write_inputs(tmp_path)
    runs = tmp_path / "runs"
    sweeps = [api.prepare_sweep(experiment, profile, {"optimizer.lr": [lr, lr * 2]}) for lr in (1e-4, 1e-3)]
    for points, sweep_dir in sweeps:
        api.submit_sweep(points, sweep_dir)
    planned, moved = runs / f"jb-sweep-{STAMP}", runs / f"jb-sweep-{STAMP}.1"
    assert capsys.readouterr().err == ""  # the points name their folder: launch/cli.py prints it
    assert [lr_in(planned / "point-1"), lr_in(moved / "point-1")] == [2e-4, 2e-3]
    assert [p.spec.run_dir for p in sweeps[1][0]] == [moved / "point-0", moved / "point-1"]
    assert f"--config {moved}/point-$SLURM_ARRAY_TASK_ID/config.yaml" in slurm.scripts()["2"]
    assert [e["point_dir"] for e in registry(runs)][2:] == [str(moved / "point-0"), str(moved / "point-1")]
    # smoke: the launcher prints its job's spec.run_dir, which moves with it
    from mcorekit.config.cluster import load_profile

    built = api.smoke_job(load_profile(profile), 1)
    built.spec.run_dir.mkdir()
    submit.submit_one(built, print, kind="smoke")
    assert built.spec.run_dir == runs / f"smoke-{STAMP}.1"
    assert f"{built.spec.run_dir}/logs/" in slurm.scripts()["3"]


# ---------------------------------------------------------------- a chain's rollback


def chain(tmp_path: Path) -> list[str | Path]:
    profile, experiment = write_inputs(tmp_path)
    return ["launch", "chain", "--config", experiment, "--cluster", profile, "--hf-out", tmp_path / "hf"]


def test_a_chain_whose_earlier_job_cannot_be_cancelled_keeps_its_folder(tmp_path: Path, slurm: Slurm) -> None:
    """The training stage stays queued: its run folder (config.yaml, its pickled payload) must stay too, and the
    message says which job is left and how to cancel it."""
    (slurm.bin / "fail-at-2").touch()
    slurm.scancel_fails()
    r = run_main(*chain(tmp_path))
    [run] = [d for d in (tmp_path / "runs").iterdir() if d.is_dir()]
    assert r.code == 2 and "Traceback" not in r.err, r.err
    assert r.err.splitlines() == [
        f"mcorekit: warning: kept the run folder {run}: job 1 may be queued and reads it; check `squeue --me` (or "
        f"`mcorekit status`), and remove the folder only once no job of it is queued",
        "mcorekit: error: sbatch refused job 'jb-convert': sbatch: error: Batch job submission failed: fake refusal "
        "of job 2; could not cancel job 1 (scancel: error: Kill job error on job id 1: Access/permission denied): "
        "cancel by hand with `scancel 1`"]
    assert slurm.cancelled() == ["1"]
    assert (run / "config.yaml").is_file() and (run / "cluster.yaml").is_file()
    assert (run / "jb-train" / "logs" / "1_submitted.pkl").is_file()
    assert [(e["job_id"], e["run_dir"]) for e in registry(tmp_path / "runs")] == [("1", str(run / "jb-train"))]


def test_a_chain_whose_earlier_jobs_are_cancelled_leaves_no_folder(tmp_path: Path, slurm: Slurm) -> None:
    (slurm.bin / "fail-at-2").touch()
    r = run_main(*chain(tmp_path))
    assert r.code == 2 and r.err.splitlines() == [
        "mcorekit: error: sbatch refused job 'jb-convert': sbatch: error: Batch job submission failed: fake refusal "
        "of job 2; cancelled the chain's earlier jobs 1"], r.err
    assert slurm.cancelled() == ["1"]
    assert [d for d in (tmp_path / "runs").iterdir() if d.is_dir()] == []


# ---------------------------------------------------------------- signals during a submission


def test_sigterm_while_sbatch_runs_keeps_the_folder_and_says_so(tmp_path: Path, slurm: Slurm) -> None:
    """sbatch may have queued the job: its folder (payload, config) stays, with one line saying where to look."""
    (slurm.bin / "hold").touch()
    profile, experiment = write_inputs(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "mcorekit", "launch", "--config", str(experiment), "--cluster",
                             str(profile)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PATH": f"{slurm.bin}:{os.environ['PATH']}"})
    deadline = time.monotonic() + 120
    while not (slurm.bin / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    [run] = [d for d in (tmp_path / "runs").iterdir() if d.is_dir()]
    assert proc.returncode == 130 and out == "", (proc.returncode, err)
    assert err.splitlines()[-2:] == [
        f"mcorekit: warning: kept the run folder {run}: job 'jb' (its sbatch was interrupted) may be queued and "
        f"reads it; check `squeue --me` (or `mcorekit status`), and remove the folder only once no job of it is "
        f"queued", "mcorekit: interrupted"]
    assert (run / "config.yaml").is_file() and (run / "cluster.yaml").is_file()


def test_sigterm_before_sbatch_removes_the_half_made_folder(tmp_path: Path, slurm: Slurm,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        pytest.skip("SIGTERM has a handler in this process: the launcher leaves it alone")
    profile, experiment = write_inputs(tmp_path)
    p = api.load(experiment, profile)
    write_atomic = api.write_atomic

    def killed_after_the_first_file(path: Path, text: str) -> None:  # config.yaml written, cluster.yaml not
        write_atomic(path, text)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(api, "write_atomic", killed_after_the_first_file)
    with pytest.raises(submit.Interrupted, match="SIGTERM"):
        api.submit_prepared(p)
    assert not p.spec.run_dir.exists() and registry(tmp_path / "runs") == []
    assert slurm.scripts() == {}  # sbatch never ran
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the process's own again


def test_an_ignored_sighup_stays_ignored(tmp_path: Path) -> None:
    """`nohup mcorekit launch ...`: a hangup must not interrupt the submission."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with submit.run_folder(tmp_path / "run"):
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_sbatch_does_not_see_the_users_overrides_of_the_scripts_options(tmp_path: Path, slurm: Slurm,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch takes SBATCH_* variables over the script's #SBATCH lines: SBATCH_JOB_NAME would make Slurm's name
    differ from the registry's (status, logs and cancel would take every job for one whose id Slurm reused),
    SBATCH_TIMELIMIT would change the time the requeue signal is planned against. Those of options the script sets
    are left out, said once; others (an account the profile does not set) pass."""
    executable(slurm.bin / "sbatch", '#!/bin/sh\nfor v in SBATCH_JOB_NAME SBATCH_TIMELIMIT SBATCH_ACCOUNT; do\n'
                                     '  eval "echo $v=\\${$v-unset}"; done > "$(dirname "$0")/env"\n'
                                     'echo "Submitted batch job 7"\n')
    for name, value in (("SBATCH_JOB_NAME", "from-the-shell"), ("SBATCH_TIMELIMIT", "1"), ("SBATCH_ACCOUNT", "lab")):
        monkeypatch.setenv(name, value)
    profile, experiment = write_inputs(tmp_path)
    r = run_main("launch", "--config", experiment, "--cluster", profile)
    assert r.code == 0, r.err
    assert (slurm.bin / "env").read_text().split() == ["SBATCH_JOB_NAME=unset", "SBATCH_TIMELIMIT=unset",
                                                      "SBATCH_ACCOUNT=lab"]
    assert ("mcorekit: warning: SBATCH_JOB_NAME, SBATCH_TIMELIMIT in this environment would override the job "
            "script's own settings: left out of sbatch's environment") in r.err.splitlines()
    assert os.environ["SBATCH_JOB_NAME"] == "from-the-shell"  # put back for the launcher's caller
    assert [e["name"] for e in registry(tmp_path / "runs")] == ["jb"]
