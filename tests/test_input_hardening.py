"""Input hardening found by an audit: a trailing newline in names and env keys, square brackets in `status` cells, a
closed stdout pipe, control characters in model.hf_config, inputs a dry run did not look at, absurd integers and
times, and job ids Slurm gave to another job. Each case: the exit code, the exact line, nothing rendered."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from test_launch_options import run

from mcorekit.config.experiment import Experiment
from mcorekit.config.values import ENV_KEY_RE, NAME_RE, parse_time_minutes
from mcorekit.errors import ConfigError
from mcorekit.launch import accounting, jobs_cli
from mcorekit.launch.submit import JobSpec

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "examples" / "llama-tiny.yaml")
LOCAL = REPO / "slurm" / "clusters" / "local.yaml"
NAME_RULE = "must be letters, digits, '.', '_' or '-'"


def only_error(code: int, out: str, err: str) -> str:
    """Exit 2, nothing on stdout (no script rendered), one stderr line: that line."""
    assert (code, out) == (2, ""), (code, out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


# ---------------------------------------------------------------- 1. a trailing newline passed `$`


def test_name_patterns_refuse_a_trailing_newline() -> None:
    """`$` also matches before a final newline: launch/submit.py's NAME_RE.match / ENV_KEY_RE.match took 'x\\n'."""
    assert NAME_RE.match("debug\n") is None and ENV_KEY_RE.match("FOO\n") is None
    assert NAME_RE.match("debug") and ENV_KEY_RE.match("FOO")
    with pytest.raises(ConfigError, match="job name 'x\\\\n' must be"):
        JobSpec(name="x\n", run_dir=Path("/tmp/r"))


@pytest.mark.parametrize("key", ["partition", "account", "qos"])
def test_a_profile_name_with_a_trailing_newline_is_refused(key: str) -> None:
    line = only_error(*run("launch", "--config", TINY, "--dry-run", "--set", f'{key}="debug\\n"'))
    assert line == (f"mcorekit: error: {LOCAL}: {key} (from the override {key}=...): 'debug\\n' {NAME_RULE} "
                    f"(got 'debug\\n')")


def test_a_block_scalar_qos_is_refused(tmp_path: Path) -> None:
    """`qos: |` reads as "normal\\n"."""
    profile = tmp_path / "p.yaml"
    profile.write_text("name: p\ngpus_per_node: 0\ntasks_per_node: 1\ncpus_per_task: 1\nqos: |\n  normal\n")
    line = only_error(*run("launch", "--config", TINY, "--dry-run", "--cluster", str(profile)))
    assert line == f"mcorekit: error: {profile}: qos: 'normal\\n' {NAME_RULE} (got 'normal\\n')"


def test_an_env_key_with_a_trailing_newline_is_refused(tmp_path: Path) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text('name: p\ngpus_per_node: 0\ntasks_per_node: 1\ncpus_per_task: 1\nenv: {"FOO\\n": bar}\n')
    line = only_error(*run("launch", "--config", TINY, "--dry-run", "--cluster", str(profile)))
    assert line == (f"mcorekit: error: {profile}: env: environment variable name 'FOO\\n' is not a valid shell "
                    f"identifier (got {{'FOO\\n': 'bar'}})")


def test_a_resumed_run_whose_name_ends_in_a_newline_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    config = Path(TINY).read_text().replace("name: llama-tiny\n", 'name: "llama-tiny\\n"\n')
    (run_dir / "config.yaml").write_text(config)
    shutil.copy(LOCAL, run_dir / "cluster.yaml")
    line = only_error(*run("launch", "--resume", str(run_dir), "--dry-run"))
    assert line == (f"mcorekit: error: {run_dir}/config.yaml: name: name 'llama-tiny\\n' must be 1-64 characters of "
                    f"letters, digits, '.', '_' or '-' (it becomes the Slurm job name) (got 'llama-tiny\\n')")


# ---------------------------------------------------------------- 2. square brackets in status cells


def status_table(root: Path) -> tuple[int, str, str]:
    return run("status", "--runs", str(root))


def diagnosis_column(table: str) -> list[str]:
    """The last column's text per row, its wrapped lines joined (rich wraps at spaces)."""
    rows: list[list[str]] = []
    for line in table.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells[0]:  # a new row; an empty job cell continues the row above
            rows.append([])
        if cells[-1]:
            rows[-1].append(cells[-1])
    return [" ".join(parts) for parts in rows]


def test_status_shows_square_brackets_verbatim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gloo = "/opt/conda/lib/python3.12/site-packages/torch/csrc/distributed/c10d/gloo/pair.cc:534"
    lines = {"7": f"RuntimeError: [{gloo}] Connection closed by peer",
             "8": "RuntimeError: [enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0"}
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    for job, line in lines.items():
        (logs / f"{job}_0_log.err").write_text(f"Traceback (most recent call last):\n  File \"x\", line 1\n{line}\n")
    (tmp_path / "jobs.jsonl").write_text("".join(
        json.dumps({"job_id": job, "name": "[b]x", "kind": "train", "run_dir": str(tmp_path / "run")}) + "\n"
        for job in lines))
    monkeypatch.setattr(accounting, "sacct", lambda ids: {
        j: accounting.JobRecord(j, "[b]x", "FAILED", "1:0", "00:01:00", 0) for j in ids})
    code, out, err = status_table(tmp_path)
    assert (code, err) == (0, ""), err
    assert diagnosis_column(out) == [f"Python exception: {line}" for line in lines.values()]
    assert out.count("│ [b]x ") == 2


# ---------------------------------------------------------------- 3. a closed stdout pipe


@pytest.mark.parametrize("stderr_too", [False, True])
def test_a_closed_stdout_pipe_is_not_success(stderr_too: bool) -> None:
    """`mcorekit launch ... | true`: the output cannot be written, so the command did not do its work: 141 (what a
    shell reports for SIGPIPE), never 0, and no traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        # stdout buffered, as in a shell (this machine sets PYTHONUNBUFFERED): the dry run writes at the end
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        proc = subprocess.run([sys.executable, "-m", "mcorekit", "launch", "--config", TINY, "--dry-run",
                               "checkpoint.load=/nonexistent/ckpt"], cwd=REPO, stdout=write, env=env,
                              stderr=write if stderr_too else subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 141
    if not stderr_too:  # the dry run's warning came out; no traceback nor "Exception ignored" after it
        assert proc.stderr.splitlines() == ["mcorekit: warning: checkpoint.load: no folder /nonexistent/ckpt on this "
                                            "machine; the job fails at its start unless its nodes see it"]


# ---------------------------------------------------------------- 4. model.hf_config's control characters


def test_hf_config_with_a_newline_is_refused() -> None:
    line = only_error(*run("launch", "--config", TINY, "--dry-run", 'model.hf_config="/tmp/a\\nb"'))
    assert line == (f"mcorekit: error: {TINY}: model.hf_config (from the override model.hf_config=...): HF config path "
                    f"'/tmp/a\\nb' contains a newline or control character; remove it (got '/tmp/a\\nb')")


# ---------------------------------------------------------------- 5. inputs a dry run did not look at


def warnings_of(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("mcorekit: warning: ")]


def test_missing_lora_adapters_are_a_warning() -> None:
    code, out, err = run("launch", "--config", TINY, "--dry-run", "peft.lora={rank: 4}",
                         "peft.lora.load=/nonexistent/adapters", "checkpoint.load=/nonexistent/base")
    assert code == 0 and "#SBATCH" in out, err
    assert warnings_of(err) == [
        "mcorekit: warning: checkpoint.load: no folder /nonexistent/base on this machine; the job fails at its start "
        "unless its nodes see it",
        "mcorekit: warning: peft.lora.load: no folder /nonexistent/adapters on this machine; the job fails at its "
        "start unless its nodes see it"]


def test_a_reward_file_this_machine_lacks_is_a_warning_and_none_is_imported(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    reward = tmp_path / "reward.py"
    reward.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef f(prompt, completion, **_):\n    return 1.0\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    rewards = (f'[{{function: "/nonexist.py:f"}}, {{function: "{reward}:f"}}, '
               f'{{function: "mcorekit.train.rewards:exact_match"}}]')
    code, out, err = run("launch", "--config", TINY, "--dry-run", "data.kind=grpo", f"data.tokenizer={tmp_path}",
                         f"data.paths=[{tmp_path}/prompts.jsonl]", "data.seq_length=64", "grpo.max_new_tokens=8",
                         "grpo.group_size=2", "grpo.prompts_per_step=4", f"grpo.rewards={rewards}")
    assert code == 0 and "#SBATCH" in out, err
    assert warnings_of(err) == ["mcorekit: warning: grpo.rewards: /nonexist.py:f: no file /nonexist.py on this "
                                "machine; the job fails at its start unless its nodes see it"]
    assert not marker.exists()  # the user's file was looked at, never run


@pytest.mark.parametrize("key,value,bound", [("schedule.train_iters", "100000000000000000000", 2**31 - 1),
                                             ("schedule.global_batch_size", "80000000000000000000", 2**31 - 1),
                                             ("resources.max_restarts", "100000000000000000000", 2**16 - 1)])
def test_absurd_integers_are_refused(key: str, value: str, bound: int) -> None:
    line = only_error(*run("launch", "--config", TINY, "--dry-run", f"{key}={value}"))
    assert line == (f"mcorekit: error: {TINY}: {key} (from the override {key}=...): Input should be less than or "
                    f"equal to {bound} (got {value})")


@pytest.mark.parametrize("key,bound", [("cpus_per_task", 2**31 - 1), ("signal_seconds", 2**16 - 1)])
def test_absurd_profile_integers_are_refused(key: str, bound: int) -> None:
    """They went into the script: #SBATCH --cpus-per-task=100000000000000000000; sbatch's --signal takes 16 bits."""
    line = only_error(*run("launch", "--config", TINY, "--dry-run", "--set", f"{key}={bound + 1}"))
    assert line == (f"mcorekit: error: {LOCAL}: {key} (from the override {key}=...): Input should be less than or "
                    f"equal to {bound} (got {bound + 1})")


def test_integer_bounds_are_inclusive() -> None:
    top = 2**31 - 1
    exp = Experiment.model_validate({"name": "x", "schedule": {"train_iters": top, "global_batch_size": top},
                                     "resources": {"max_restarts": 2**16 - 1}})
    assert exp.schedule.train_iters == top and exp.resources.max_restarts == 2**16 - 1
    with pytest.raises(ValidationError):
        Experiment.model_validate({"name": "x", "resources": {"max_restarts": 2**16}})


def test_an_absurd_time_is_refused() -> None:
    line = only_error(*run("launch", "--config", TINY, "--dry-run", "resources.time=99999999999999999999"))
    assert line == (f"mcorekit: error: {TINY}: resources.time (from the override resources.time=...): time "
                    f"'99999999999999999999' is longer than Slurm takes (at most 35791394 minutes, about 68 years) "
                    f"(got 99999999999999999999)")
    line = only_error(*run("launch", "--config", TINY, "--dry-run", "--set", "time_limit=24856-00:00:00"))
    assert "time_limit (from the override time_limit=...): time '24856-00:00:00' is longer than Slurm takes" in line


def test_slurm_time_bound_is_what_sbatch_parses() -> None:
    """sbatch's time_str2secs sums seconds in a C int: minutes x 60 must stay below 2**31."""
    assert parse_time_minutes("35791394") == 35791394 == (2**31 - 1) // 60
    assert parse_time_minutes("24855-00:00:00") == 24855 * 1440
    for too_long in ("35791395", "24856-00:00:00", "596524:00:00"):
        with pytest.raises(ValueError, match="longer than Slurm takes"):
            parse_time_minutes(too_long)


# ---------------------------------------------------------------- 6. a job id Slurm gave to another job


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sacct printing $FAKE_SACCT_OUT, scancel appending its arguments to <tmp>/scancel.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text('#!/bin/sh\nprintf "%s\\n" "$FAKE_SACCT_OUT"\n')
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/scancel.log\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "scancel.log"


def registry(root: Path, *entries: dict[str, str]) -> None:
    (root / "jobs.jsonl").write_text("".join(json.dumps({"kind": "train", "run_dir": str(root / "run"), **e}) + "\n"
                                             for e in entries))


def test_cancel_refuses_a_reused_job_id(tmp_path: Path, fake_slurm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry(tmp_path, {"job_id": "1001", "name": "llama-tiny"})
    monkeypatch.setenv("FAKE_SACCT_OUT", "1001|other-users-job|RUNNING|0:0|01:00:00")
    line = only_error(*run("cancel", "1001", "--runs", str(tmp_path)))
    assert line == ("mcorekit: error: Slurm's job 1001 is named 'other-users-job', not 'llama-tiny': the id was "
                    "reused by another job; nothing was cancelled")
    assert not fake_slurm.exists()


def test_cancel_goes_ahead_when_the_names_agree(tmp_path: Path, fake_slurm: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's tasks run as one array named <name>-sweep; the registry holds each point's name."""
    registry(tmp_path, {"job_id": "1001", "name": "llama-tiny"}, {"job_id": "200_0", "name": "sw", "kind": "sweep"})
    monkeypatch.setenv("FAKE_SACCT_OUT", "1001|llama-tiny|RUNNING|0:0|01:00:00\n200_0|sw-sweep|RUNNING|0:0|00:01:00")
    assert run("cancel", "1001", "200_0", "--runs", str(tmp_path)) == (0, "cancelled 1001, 200_0\n", "")
    assert fake_slurm.read_text() == "1001 200_0\n"


def test_an_earlier_job_with_the_id_in_accounting_is_not_ours_to_judge_by(tmp_path: Path, fake_slurm: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """sacct of our array 938 also listed a plain job 938 named 'allocation' (CI at 3fa81ac): accounting's name for a
    job whose name it does not have yet, or an earlier job of a reset cluster. Our array's tasks say whose the id
    is now."""
    registry(tmp_path, {"job_id": "938_0", "name": "faults", "kind": "sweep"})
    monkeypatch.setenv("FAKE_SACCT_OUT",
                       "938|allocation|COMPLETED|0:0|00:00:05\n938_0|faults-sweep|RUNNING|0:0|00:01:00")
    assert run("cancel", "938_0", "--runs", str(tmp_path)) == (0, "cancelled 938_0\n", "")
    assert fake_slurm.read_text() == "938_0\n"


def test_restarts_count_only_the_incarnations_of_the_job_named(fake_slurm: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """sacct -D lists a requeued job once per incarnation, and an earlier job that had the id (a reset cluster) too:
    only the lines of the current job's name before it are its restarts."""
    monkeypatch.setenv("FAKE_SACCT_OUT", "\n".join([
        "938|allocation|COMPLETED|0:0|00:00:05", "938|allocation|COMPLETED|0:0|00:00:07",
        "938|llama-tiny|REQUEUED|0:0|00:10:00", "938|llama-tiny|RUNNING|0:0|00:01:00",
        "939|other|RUNNING|0:0|00:02:00"]))
    records = accounting.sacct(["938", "939"])
    assert [(r.job_id, r.name, r.state, r.restarts) for r in records.values()] == [
        ("938", "llama-tiny", "RUNNING", 1), ("939", "other", "RUNNING", 0)]


def test_the_current_job_of_an_id_is_the_one_submitted_last(fake_slurm: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A reset cluster's accounting lists an earlier job of the id, in any order (the Slurm CI at 4ad1e75 saw status
    call our failed job 'ID REUSED': the earlier job was listed after it). The job submitted last is the current one."""
    monkeypatch.setenv("FAKE_SACCT_OUT", "\n".join([
        "51|c-bad|FAILED|1:0|00:00:01|2026-12-05T10:30:00",
        "51|allocation|COMPLETED|0:0|00:00:05|2026-12-05T09:20:00",
        "52|x|PENDING|0:0|00:00:00|Unknown"]))
    records = accounting.sacct(["51", "52"])
    assert [(r.job_id, r.name, r.state, r.exit_code, r.restarts) for r in records.values()] == [
        ("51", "c-bad", "FAILED", "1:0", 0), ("52", "x", "PENDING", "0:0", 0)]


def test_status_marks_a_reused_job_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry(tmp_path, {"job_id": "1001", "name": "llama-tiny"}, {"job_id": "1002", "name": "llama-tiny"})
    monkeypatch.setattr(accounting, "sacct", lambda ids: {
        "1001": accounting.JobRecord("1001", "other-users-job", "FAILED", "1:0", "01:00:00", 2),
        "1002": accounting.JobRecord("1002", "llama-tiny", "RUNNING", "0:0", "00:05:00", 0)})
    rows = jobs_cli.status_rows(tmp_path, 10)
    assert [(r["job"], r["state"], r["exit"], r["elapsed"], r["restarts"], r["diagnosis"]) for r in rows] == [
        ("1001", "ID REUSED", "", "", None, "Slurm's job 1001 is named 'other-users-job', not 'llama-tiny': the id "
                                            "was reused by another job"),
        ("1002", "RUNNING", "0:0", "00:05:00", 0, None)]


def test_accountings_placeholder_name_is_not_another_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sacct names a job 'allocation' until slurmdbd has its name (seen by the Slurm CI under load right after a job
    failed): that is our job, not another one that had the id."""
    registry(tmp_path, {"job_id": "1114", "name": "c-bad"})
    monkeypatch.setattr(accounting, "sacct", lambda ids: {
        "1114": accounting.JobRecord("1114", "allocation", "FAILED", "1:0", "00:00:01", 0)})
    rows = jobs_cli.status_rows(tmp_path, 10)
    assert [(r["job"], r["state"], r["exit"]) for r in rows] == [("1114", "FAILED", "1:0")]


def test_logs_refuses_a_reused_job_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry(tmp_path, {"job_id": "1001", "name": "llama-tiny"})
    monkeypatch.setattr(accounting, "job_record",
                        lambda jid: accounting.JobRecord(jid, "other-users-job", "RUNNING", "", "01:00:00", 0))
    for follow in ([], ["--follow"]):
        line = only_error(*run("logs", "1001", "--runs", str(tmp_path), *follow))
        assert line == ("mcorekit: error: Slurm's job 1001 is named 'other-users-job', not 'llama-tiny': the id was "
                        "reused by another job; its state says nothing about this project's job")
