"""A resumed run trains what it started on: the first start records the settings that define the problem and the
files it reads (train/run_inputs.py); a resume that finds them changed stops with one line naming them."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from mcorekit.config.experiment import Experiment
from mcorekit.errors import ConfigError
from mcorekit.launch.plan import unseen_inputs
from mcorekit.train import run_inputs


def _experiment(tmp_path: Path, **changes: Any) -> Experiment:
    cfg: dict[str, Any] = {"name": "x", "model": {"preset": "llama-tiny"},
                           "data": {"kind": "sft", "paths": [str(tmp_path / "train.jsonl")],
                                    "tokenizer": str(tmp_path / "tok")},
                           "schedule": {"train_iters": 10}}
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = cfg
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return Experiment.model_validate(cfg)


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    (tmp_path / "train.jsonl").write_text('{"messages": []}\n')
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    run_inputs.record_or_check(_experiment(tmp_path), tmp_path / "ckpt", resuming=False)
    return tmp_path / "ckpt"


def test_a_resume_with_the_same_inputs_and_other_ways_of_running_goes_on(tmp_path: Path, inputs: Path) -> None:
    """Layout, precision, backend, saving, logging, resources, validation and GRPO's generation may change at a
    restart: they do not change the problem. Nor do a tokenizer folder's other files (a README, an NFS placeholder)."""
    again = _experiment(tmp_path, parallel__tp=2, precision__fp8="delayed", checkpoint__save_interval=7,
                        logging__log_interval=3, resources__nodes=2, data__cache_dir=str(tmp_path / "cache"),
                        model__backend="local", data__valid_paths=[str(tmp_path / "valid.jsonl")],
                        grpo__kv_cache_gb=1.0, grpo__generation="static", dpo__beta=0.5)
    (tmp_path / "tok" / "README.md").write_text("notes")
    (tmp_path / "tok" / ".nfs0000000001234").write_text("")
    run_inputs.record_or_check(again, inputs, resuming=True)


def test_settings_another_version_added_and_relative_paths_made_absolute_are_not_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run recorded by a version without some setting, or with relative paths (a torchrun start from the folder the
    paths are relative to), resumes when the launcher writes them absolute and a new version adds a setting."""
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"messages": []}\n')
    relative = Experiment.model_validate({"name": "x", "model": {"preset": "llama-tiny"},
                                          "data": {"kind": "sft", "paths": ["train.jsonl"]}})
    run_inputs.record_or_check(relative, tmp_path / "ckpt", resuming=False)
    record = tmp_path / "ckpt" / run_inputs.INPUTS
    then = json.loads(record.read_text())
    assert list(then["files"]) == [str(tmp_path / "train.jsonl")]
    then["settings"].pop("data.seq_length")  # as recorded by a version that had no such setting
    then["files"] = {"train.jsonl": then["files"][str(tmp_path / "train.jsonl")]}
    record.write_text(json.dumps(then))
    absolute = Experiment.model_validate({"name": "x", "model": {"preset": "llama-tiny"},
                                          "data": {"kind": "sft", "paths": [str(tmp_path / "train.jsonl")]}})
    run_inputs.record_or_check(absolute, tmp_path / "ckpt", resuming=True)


def test_a_changed_setting_stops_the_resume_in_one_line(tmp_path: Path, inputs: Path) -> None:
    changed = _experiment(tmp_path, schedule__train_iters=20, optimizer__lr=1e-3)
    with pytest.raises(ConfigError) as e:
        run_inputs.record_or_check(changed, inputs, resuming=True)
    assert str(e.value) == (
        "this run's inputs changed since its first start: optimizer.lr 0.0003 -> 0.001; schedule.train_iters 10 -> "
        f"20. A resumed run trains what it started on: restore them, or start a new run from this one's checkpoints "
        f"(checkpoint.load={inputs}, in a run folder and checkpoint.dir of its own)")


def test_a_file_of_another_size_other_bytes_or_gone_stops_it_one_copied_again_goes_on(
        tmp_path: Path, inputs: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    data, tokenizer = tmp_path / "train.jsonl", tmp_path / "tok" / "tokenizer.json"
    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # copied again by a job's setup: same bytes
    with caplog.at_level(logging.WARNING, logger="mcorekit.train"):
        run_inputs.record_or_check(_experiment(tmp_path), inputs, resuming=True)
    assert "rewritten" not in caplog.text  # the same bytes: nothing to say

    data.write_text('{"messages": [1]}')  # reordered lines, say: the same size, other bytes
    assert data.stat().st_size == stat.st_size
    with pytest.raises(ConfigError, match=rf"changed since its first start: {data} changed \(other bytes at the "
                                          rf"same size\)\. "):
        run_inputs.record_or_check(_experiment(tmp_path), inputs, resuming=True)
    data.write_text('{"messages": []}\n')
    monkeypatch.setattr(run_inputs, "DIGEST_BYTES", 4)  # a file too big to digest: compared by size and time
    assert run_inputs._stat(data, [10**9])[2] is None
    monkeypatch.undo()
    assert run_inputs._stat(data, [4])[2] is None  # nor past the total to digest at one start
    assert run_inputs._stat(data, [10**9])[2] is not None
    (tmp_path / "corpus.bin").write_bytes(b"tokens")  # indexed data: its .idx is digested, never the .bin
    assert run_inputs._stat(tmp_path / "corpus.bin", [10**9])[2] is None
    monkeypatch.setattr(run_inputs, "DIGEST_BYTES", 4)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    with caplog.at_level(logging.WARNING, logger="mcorekit.train"):
        run_inputs.record_or_check(_experiment(tmp_path), inputs, resuming=True)
    assert f"rewritten since this run's first start, at the same size: {data}" in caplog.text

    data.write_text('{"messages": []}\n{"messages": []}\n')
    tokenizer.unlink()
    (tmp_path / "tok" / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(ConfigError, match=rf"changed since its first start: {data} changed \(17 -> 34 bytes\); "
                                          rf"{tokenizer} is gone; {tmp_path / 'tok' / 'chat_template.jinja'} is "
                                          rf"read now, not at the first start\. "):
        run_inputs.record_or_check(_experiment(tmp_path), inputs, resuming=True)


def test_a_new_start_records_again_and_a_resume_without_a_record_records_it(tmp_path: Path, inputs: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    longer = _experiment(tmp_path, schedule__train_iters=20)
    run_inputs.record_or_check(longer, inputs, resuming=False)  # no checkpoint of its own yet: nothing to keep
    run_inputs.record_or_check(longer, inputs, resuming=True)
    (inputs / run_inputs.INPUTS).unlink()  # a run started by an earlier version
    with caplog.at_level(logging.WARNING, logger="mcorekit.train"):
        run_inputs.record_or_check(_experiment(tmp_path), inputs, resuming=True)
    assert "inputs.json is missing: this resume's inputs are recorded now" in caplog.text
    with pytest.raises(ConfigError, match="schedule.train_iters 10 -> 20"):
        run_inputs.record_or_check(longer, inputs, resuming=True)


def test_indexed_data_and_reward_files_are_inputs(tmp_path: Path) -> None:
    for name in ("corpus.bin", "corpus.idx", "reward.py"):
        (tmp_path / name).write_text("x")
    indexed = Experiment.model_validate({"name": "x", "model": {"preset": "llama-tiny"},
                                         "data": {"kind": "indexed", "paths": [str(tmp_path / "corpus")]}})
    assert run_inputs.files(indexed) == [tmp_path / "corpus.bin", tmp_path / "corpus.idx"]
    grpo = Experiment.model_validate({"name": "x", "model": {"preset": "llama-tiny"},
                                      "data": {"kind": "grpo", "paths": [str(tmp_path / "corpus.bin")]},
                                      "grpo": {"rewards": [{"function": f"{tmp_path / 'reward.py'}:score"},
                                                           {"function": "mcorekit.train.rewards:exact_match"}]}})
    assert run_inputs.files(grpo) == [tmp_path / "corpus.bin", tmp_path / "reward.py"]


def test_a_resume_through_the_start_checks_its_inputs(tmp_path: Path, inputs: Path) -> None:
    """What build() calls once the process group is up (checkpoint.pinned_sources, on rank 0): with a checkpoint of
    its own in the folder the start is a resume, and a changed input stops it."""
    from mcorekit.train import checkpoint

    own = inputs / "iter_0000004"
    own.mkdir()
    (own / "metadata.json").write_text("{}")
    (inputs / "latest_checkpointed_iteration.txt").write_text("4")
    checkpoint.pinned_sources(_experiment(tmp_path), inputs)
    with pytest.raises(ConfigError, match="data.seq_length 2048 -> 4096"):
        checkpoint.pinned_sources(_experiment(tmp_path, data__seq_length=4096), inputs)


def test_other_software_at_a_resume_is_a_warning(tmp_path: Path, inputs: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    recorded = run_inputs.software()
    assert recorded["torch"] and recorded["megatron-core"]
    monkeypatch.setattr(run_inputs, "software", lambda: {**recorded, "torch": "9.9.9"})
    with caplog.at_level(logging.WARNING, logger="mcorekit.train"):
        run_inputs.record_or_check(_experiment(tmp_path), inputs, resuming=True)
    assert f"this run started with other software: torch {recorded['torch']} -> 9.9.9" in caplog.text


def test_a_file_this_machine_does_not_see_is_left_to_the_jobs_own_check_before_queueing(
        tmp_path: Path, inputs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`launch --resume` asks on the login node (elsewhere=True), which may not see what the nodes read (a node-local
    copy, a mount only the nodes have): a recorded file it cannot see is warned of once, by the launch's plan (as for
    a fresh launch), and still a refusal where the job starts; a file it sees at another size is refused on either."""
    (tmp_path / "train.jsonl").unlink()
    with caplog.at_level(logging.WARNING, logger="mcorekit.train"):
        assert run_inputs.check(_experiment(tmp_path), inputs, elsewhere=True)
    assert caplog.text == ""
    assert unseen_inputs(_experiment(tmp_path)) == [f"data.paths: {tmp_path / 'train.jsonl'} not found on this "
                                                    f"machine; the job fails at its start unless its nodes see it"]
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'train.jsonl'} is gone"):
        run_inputs.check(_experiment(tmp_path), inputs)
    (tmp_path / "train.jsonl").write_text('{"messages": [], "more": 1}\n')
    with pytest.raises(ConfigError, match="train.jsonl changed"):
        run_inputs.check(_experiment(tmp_path), inputs, elsewhere=True)


def test_a_file_gone_from_a_folder_this_machine_sees_is_refused_before_queueing(tmp_path: Path,
                                                                                 inputs: Path) -> None:
    """A tokenizer folder the login node sees, without a file the first start read: the launch's plan sees the
    folder and says nothing, so launch --resume refuses, as the job's start would, instead of queueing it."""
    (tmp_path / "tok" / "tokenizer.json").unlink()
    assert unseen_inputs(_experiment(tmp_path)) == []
    for elsewhere in (True, False):
        with pytest.raises(ConfigError, match=rf"{tmp_path / 'tok' / 'tokenizer.json'} is gone"):
            run_inputs.check(_experiment(tmp_path), inputs, elsewhere=elsewhere)


def test_a_path_through_a_parent_folder_is_the_same_input_at_a_resume(tmp_path: Path) -> None:
    """A tokenizer given as sub/../tok (a hand run keeps the path as given) was recorded with the '..', compared
    without it: every resume refused ("tok/tokenizer.json is no longer read; sub/../tok/tokenizer.json is read now")."""
    (tmp_path / "train.jsonl").write_text('{"messages": []}\n')
    (tmp_path / "tok").mkdir()
    (tmp_path / "sub").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    exp = _experiment(tmp_path, data__tokenizer=str(tmp_path / "sub" / ".." / "tok"))
    run_inputs.record_or_check(exp, tmp_path / "ckpt", resuming=False)
    run_inputs.record_or_check(exp, tmp_path / "ckpt", resuming=True)
    assert run_inputs.check(exp, tmp_path / "ckpt", elsewhere=True)


def _hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, commit: str) -> Path:
    """An offline HF cache whose refs/main names `commit` (tests/test_hub.py's layout), a tokenizer file in it."""
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--tok"
    (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (repo / "snapshots" / commit / "tokenizer.json").write_text("{}")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return repo


def test_a_hub_tokenizer_that_moved_to_another_commit_stops_the_resume(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """data.tokenizer as a Hub ID follows the repository's newest commit: the first start records the one it read,
    a resume that would read another stops in one line naming both; the same commit goes on."""
    first, later = "a" * 40, "b" * 40
    _hub_cache(tmp_path, monkeypatch, first)
    (tmp_path / "train.jsonl").write_text('{"messages": []}\n')
    exp = _experiment(tmp_path, data__tokenizer="tiny-org/tok")
    run_inputs.record_or_check(exp, tmp_path / "ckpt", resuming=False)
    assert run_inputs.hub_revisions(exp) == {"data.tokenizer": first}
    run_inputs.record_or_check(exp, tmp_path / "ckpt", resuming=True)  # same commit: goes on
    _hub_cache(tmp_path, monkeypatch, later)  # the Hub moved on and the job downloaded it
    with pytest.raises(ConfigError, match=f"data.tokenizer tiny-org/tok resolves to the Hub's commit {later} now, "
                                          f"to {first} at the first start") as e:
        run_inputs.record_or_check(exp, tmp_path / "ckpt", resuming=True)
    assert "\n" not in str(e.value)


def test_a_hub_id_the_launching_machine_cannot_resolve_is_left_to_the_job(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    _hub_cache(tmp_path, monkeypatch, "a" * 40)
    (tmp_path / "train.jsonl").write_text('{"messages": []}\n')
    exp = _experiment(tmp_path, data__tokenizer="tiny-org/tok")
    run_inputs.record_or_check(exp, tmp_path / "ckpt", resuming=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))  # this machine's cache lacks it, and it is offline
    with caplog.at_level(logging.WARNING):
        assert run_inputs.check(exp, tmp_path / "ckpt", elsewhere=True)
    assert "its Hub revision is checked where the job runs" in caplog.text
    with pytest.raises(Exception, match="not in the Hugging Face cache"):  # the job's own start: one error line
        run_inputs.check(exp, tmp_path / "ckpt")
