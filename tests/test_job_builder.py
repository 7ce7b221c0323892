"""One job builder for dry runs and submissions: `--dry-run` prints byte for byte the script that sbatch receives,
for every launch kind (train, smoke, sweep, chain).

CPU tests put a recording `sbatch` on PATH (nothing runs); the `slurm` tests submit a held chain to the dev cluster
and read back what Slurm and submitit hold.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import stat
import subprocess
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mcorekit.cli import main
from mcorekit.launch import api

TRAIN_NODES, MAX_RESTARTS = 2, 7


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_main(*args: str | Path) -> Result:
    """`mcorekit ARGS` in this process (Megatron's imports are paid once for the whole file)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = int(e.code or 0)
    return Result(code, out.getvalue(), err.getvalue())


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def write_inputs(root: Path) -> tuple[Path, Path]:
    """A test cluster profile with 2 GPUs per node, and an experiment that asks for 2 exclusive nodes and 7 restarts.
    The nodes' python is not this one (nothing runs), so a script that took the launcher's would differ."""
    profile = root / "gpu2.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "test-gpu2", "partition": "debug", "gpus_per_node": 2, "cpus_per_task": 1, "time_limit": "00:10:00",
        "signal_seconds": 30, "transformer_engine": False, "python": "/opt/node venv/bin/python", "run_root": str(root / "runs")}))
    experiment = root / "exp.yaml"
    experiment.write_text(yaml.safe_dump({
        "name": "jb", "model": {"preset": "llama-tiny"}, "data": {"seq_length": 128},
        "schedule": {"micro_batch_size": 1, "global_batch_size": 4},
        "resources": {"nodes": TRAIN_NODES, "time": "00:05:00", "exclusive": True, "max_restarts": MAX_RESTARTS}}))
    return profile, experiment


def kind_argv(kind: str, root: Path) -> list[str | Path]:
    profile, experiment = write_inputs(root)
    return {
        "train": ["launch", "--config", experiment],
        "smoke": ["launch", "smoke", "--nodes", "2"],
        "sweep": ["launch", "sweep", "--config", experiment, "--grid", "optimizer.lr=1e-4,2e-4,3e-4", "--max-parallel", "2"],
        "chain": ["launch", "chain", "--config", experiment, "--hf-out", root / "hf", "--export-out", root / "trt",
                  "--export-target", "engine", "--engine-out", root / "engine"],
    }[kind] + ["--cluster", profile]


def scripts_in(dry_run_output: str) -> list[str]:
    """The sbatch scripts a dry run printed: each from `#!/bin/bash` to the next `# stage` header or the end."""
    return re.findall(r"^#!/bin/bash\n.*?(?=^# stage |\Z)", dry_run_output, re.S | re.M)


def registry(runs: Path) -> list[dict]:
    return [json.loads(line) for line in (runs / "jobs.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- CPU: a recording sbatch, nothing runs


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """srun for submitit's check, and an sbatch that keeps each script it is given as submitted/N.sh (job id N)."""
    bin_dir = tmp_path / "bin"
    (bin_dir / "submitted").mkdir(parents=True)
    executable(bin_dir / "srun", "#!/bin/sh\nexit 0\n")
    executable(bin_dir / "sbatch", '#!/bin/sh\nd="$(dirname "$0")/submitted"\nn=$(( $(ls "$d" | wc -l) + 1 ))\n'
                                   'cp "$1" "$d/$n.sh"\necho "Submitted batch job $n"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    # A launch makes a new run folder, timestamped; the dry run and the submission get the same one here.
    monkeypatch.setattr(api, "new_run_dir", lambda profile, name: Path(profile.run_root).resolve() / name)
    # The smoke command waits for its job to end, then reads its results; this one never runs. Its state is the fake
    # one too: asking the real cluster about job "1" found whatever job 1 is there (a lost-and-restarted dev cluster
    # numbers from 1 again), and the wait never ended.
    from submitit.slurm.slurm import SlurmJob

    from mcorekit.launch import accounting
    monkeypatch.setattr(SlurmJob, "results", lambda self: [{"sum": 10.0, "expected": 10.0, "world_size": 4, "backend": "nccl"}])
    monkeypatch.setattr(accounting, "job_record", lambda job_id: accounting.JobRecord(job_id, "smoke", "COMPLETED", "0:0",
                                                                                       "00:00:01", 0))
    return bin_dir / "submitted"


@pytest.mark.parametrize("kind", ["train", "smoke", "sweep", "chain"])
def test_dry_run_prints_exactly_what_is_submitted(kind: str, tmp_path: Path, fake_slurm: Path) -> None:
    argv = kind_argv(kind, tmp_path)
    dry = run_main(*argv, "--dry-run")
    assert dry.code == 0, dry.err
    shown = scripts_in(dry.out)
    real = run_main(*argv)
    assert real.code == 0, real.err
    submitted = [p.read_text() for p in sorted(fake_slurm.iterdir(), key=lambda p: int(p.stem))]
    if kind == "chain":  # each stage depends on the one before; the fake sbatch numbers jobs 1, 2, ... in order
        shown = [s.replace(f"afterok:{api.UNSUBMITTED_PARENT}\n", f"afterok:{i}\n") for i, s in enumerate(shown)]
    assert len(submitted) == {"chain": 4}.get(kind, 1)
    assert submitted == shown

    first = submitted[0]
    assert " '/opt/node venv/bin/python' -u -m submitit.core._submit " in first  # the profile's, quoted
    if kind != "smoke":  # the experiment's shape: 2 exclusive nodes (a sweep's dry run used to drop exclusive)
        assert f"#SBATCH --nodes={TRAIN_NODES}\n" in first and "#SBATCH --exclusive\n" in first
    if kind == "sweep":
        assert "#SBATCH --array=0-2%2\n" in first
    if kind == "chain":  # later stages: one node, CPU jobs except the engine build
        assert all("#SBATCH --nodes=1\n" in s and "--exclusive" not in s for s in submitted[1:])
        assert ["--gpus-per-node=2" in s for s in submitted] == [True, False, False, True]


@pytest.mark.parametrize("kind,restarts", [("train", [MAX_RESTARTS]), ("sweep", [MAX_RESTARTS] * 3),
                                           ("chain", [MAX_RESTARTS, 3, 3, 3])])
def test_training_jobs_take_the_experiments_restarts(kind: str, restarts: list[int], tmp_path: Path,
                                                    fake_slurm: Path) -> None:
    """max_restarts is no script line: it travels in submitit's pickle (the chain's training stage had 3)."""
    r = run_main(*kind_argv(kind, tmp_path))
    assert r.code == 0, r.err
    pickles = [Path(e["run_dir"]) / "logs" / f"{e['job_id']}_submitted.pkl" for e in registry(tmp_path / "runs")]
    assert [pickle.loads(p.read_bytes())._timeout_countdown for p in pickles] == restarts


@pytest.mark.parametrize("kind", ["train", "smoke", "sweep", "chain"])
def test_every_submit_path_makes_an_sbatch_refusal_one_line(kind: str, tmp_path: Path, fake_slurm: Path) -> None:
    executable(fake_slurm.parent / "sbatch", "#!/bin/sh\necho 'sbatch: error: Batch job submission failed: "
                                             "Invalid account or account/partition combination specified' >&2\nexit 1\n")
    r = run_main(*kind_argv(kind, tmp_path))
    lines = [ln for ln in r.err.splitlines() if not ln.startswith("mcorekit: warning: ")]
    assert r.code == 2 and "Traceback" not in r.err, r.err
    assert len(lines) == 1 and re.fullmatch(r"mcorekit: error: sbatch refused job '[\w.-]+': sbatch: error: Batch job "
                                            r"submission failed: Invalid account .*", lines[0]), lines
    assert [p.name for p in (tmp_path / "runs").iterdir()] == []  # no run folder, nothing in the registry


# ---------------------------------------------------------------- the dev cluster: a held chain


def _queue() -> dict[str, str]:
    """Queued job ids and their names (other users' jobs may come and go meanwhile: tests look at names jb*)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, check=True).stdout
    return dict(line.split(maxsplit=1) for line in out.splitlines())


def _new_of_ours(before: dict[str, str]) -> set[str]:
    return {job for job, name in _queue().items() if job not in before and name.startswith("jb")}


def _cancel(job_ids: list[str]) -> None:
    """scancel, then wait (bounded) until the jobs have left the queue."""
    if not job_ids:
        return
    subprocess.run(["scancel", *job_ids], capture_output=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and set(_queue()) & set(job_ids):
        time.sleep(0.5)
    assert not set(_queue()) & set(job_ids), f"jobs {job_ids} still queued"


def scontrol_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def slurms_copy(job_id: str) -> str:
    return subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True, text=True, check=True).stdout


# The dev cluster has no GPUs (no GresTypes): sbatch refuses any --gpus-per-node outright, held or not, and a
# command-line --gpus-per-node cannot take the script's back. This sbatch hands the real one a copy of the script
# without that line, held (--hold: nothing runs); submitit's own script file is left as it wrote it.
HOLDING_SBATCH = """#!/bin/sh
copy="$(dirname "$0")/$(basename "$1").no-gpus"
grep -v '^#SBATCH --gpus-per-node=' "$1" > "$copy"
exec {sbatch} --hold "$copy"
"""


@pytest.mark.slurm
def test_held_chain_on_the_cluster_is_the_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile, experiment = write_inputs(tmp_path)
    argv = ["launch", "chain", "--config", experiment, "--cluster", profile, "--hf-out", tmp_path / "hf"]  # train -> convert
    dry = run_main(*argv, "--dry-run")
    assert dry.code == 0, dry.err
    shown = scripts_in(dry.out)

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "sbatch", HOLDING_SBATCH.format(sbatch=shutil.which("sbatch")))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    before = _queue()
    real = run_main(*argv)
    entries = registry(tmp_path / "runs") if (tmp_path / "runs" / "jobs.jsonl").exists() else []
    try:
        assert real.code == 0, real.err
        train, convert = entries
        assert _new_of_ours(before) == {train["job_id"], convert["job_id"]}

        t, c = scontrol_job(train["job_id"]), scontrol_job(convert["job_id"])
        assert (t["JobState"], t["Priority"], c["JobState"], c["Priority"]) == ("PENDING", "0", "PENDING", "0")  # held
        assert t["NumNodes"] in (f"{TRAIN_NODES}", f"{TRAIN_NODES}-{TRAIN_NODES}") and t["NumTasks"] == "4"
        assert c["NumNodes"] in ("1", "1-1")
        assert t["Dependency"] == "(null)" and c["Dependency"] == f"afterok:{train['job_id']}(unfulfilled)"
        assert (t["OverSubscribe"], c["OverSubscribe"]) == ("NO", "OK")  # --exclusive: the experiment's

        # What must differ between a dry run and a submission: the run folder (a new, timestamped one per launch)
        # and the parent's job id (unknown before submission). Nothing else is normalised.
        dry_folder = re.search(r"--output=(\S+)/jb-train/logs/", shown[0]).group(1)
        real_folder = str(Path(train["run_dir"]).parent)
        expected = [s.replace(dry_folder, real_folder) for s in shown]
        expected[1] = expected[1].replace(f"afterok:{api.UNSUBMITTED_PARENT}\n", f"afterok:{train['job_id']}\n")
        for entry, script in zip(entries, expected):
            written = (Path(entry["run_dir"]) / "logs" / f"{entry['job_id']}_submission.sh").read_text()
            assert written == script  # the script submitit wrote and handed to sbatch
            assert slurms_copy(entry["job_id"]) == script.replace("#SBATCH --gpus-per-node=2\n", "")
        assert "#SBATCH --gpus-per-node=2\n" in expected[0] and "--gpus-per-node" not in expected[1]

        pickled = Path(train["run_dir"]) / "logs" / f"{train['job_id']}_submitted.pkl"
        assert pickle.loads(pickled.read_bytes())._timeout_countdown == MAX_RESTARTS
    finally:
        _cancel([e["job_id"] for e in entries])


@pytest.mark.slurm
@pytest.mark.parametrize("kind", ["train", "sweep", "chain"])
def test_the_dev_clusters_gpu_refusal_is_one_line(kind: str, tmp_path: Path) -> None:
    """Real sbatch, no wrapper: the GPU request is refused, in one line, and nothing is left behind."""
    before = _queue()
    r = run_main(*kind_argv(kind, tmp_path))
    lines = [ln for ln in r.err.splitlines() if not ln.startswith("mcorekit: warning: ")]
    assert r.code == 2 and "Traceback" not in r.err, r.err
    assert len(lines) == 1 and re.fullmatch(r"mcorekit: error: sbatch refused job '[\w.-]+': sbatch: error: Invalid "
                                            r"generic resource \(gres\) specification", lines[0]), lines
    assert _new_of_ours(before) == set()
    assert [p.name for p in (tmp_path / "runs").iterdir()] == []
