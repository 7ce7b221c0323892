"""Relative paths are made absolute at launch, before config.yaml is written: the job (and a later `launch --resume`
from another directory) reads them against another working directory."""

from __future__ import annotations

import io
import re
import shlex
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

from mcorekit.cli import main
from mcorekit.launch import api

TINY = Path(__file__).resolve().parent.parent / "examples" / "llama-tiny.yaml"
PATHS = ["checkpoint.dir=ckpts", "checkpoint.load=base", "peft.lora.load=adapters", "data.kind=indexed",
         "data.paths=[d1, sub/d2]", "data.valid_paths=[v1]", "schedule.eval_interval=10", "data.tokenizer=tok",
         "data.cache_dir=cache", "model.hf_config=null", "model.preset=llama-tiny"]


@pytest.fixture()
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    here = tmp_path / "here"
    (here / "tok").mkdir(parents=True)
    monkeypatch.chdir(here)
    return here


def test_path_fields_are_absolute_in_the_saved_config(elsewhere: Path, tmp_path: Path) -> None:
    p = api.load(TINY, "local", PATHS, [f"run_root={tmp_path / 'runs'}"])
    p.save()
    saved = yaml.safe_load((p.spec.run_dir / "config.yaml").read_text())
    assert saved["checkpoint"]["dir"] == str(elsewhere / "ckpts")
    assert saved["checkpoint"]["load"] == str(elsewhere / "base")
    assert saved["peft"]["lora"]["load"] == str(elsewhere / "adapters")
    assert saved["data"]["paths"] == [str(elsewhere / "d1"), str(elsewhere / "sub" / "d2")]
    assert saved["data"]["valid_paths"] == [str(elsewhere / "v1")]
    assert saved["data"]["tokenizer"] == str(elsewhere / "tok")
    assert saved["data"]["cache_dir"] == str(elsewhere / "cache")


def test_hub_ids_home_and_absolute_paths_are_kept_as_meant(elsewhere: Path, tmp_path: Path) -> None:
    p = api.load(TINY, "local", ["data.tokenizer=Qwen/Qwen3-0.6B", "checkpoint.dir=~/ck", "checkpoint.load=/abs/base"],
                 [f"run_root={tmp_path / 'runs'}"])
    assert p.experiment.data.tokenizer == "Qwen/Qwen3-0.6B"  # no such folder here: a Hub model ID
    assert p.experiment.checkpoint.dir == str(Path.home() / "ck")
    assert p.experiment.checkpoint.load == "/abs/base"


def test_sweep_points_and_chain_outputs_are_absolute(elsewhere: Path, tmp_path: Path) -> None:
    points, _ = api.prepare_sweep(TINY, "local", {"checkpoint.dir": ["a", "b"]},
                                  profile_overrides=[f"run_root={tmp_path / 'runs'}"])
    assert [p.experiment.checkpoint.dir for p in points] == [str(elsewhere / "a"), str(elsewhere / "b")]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["launch", "chain", "--config", str(TINY), "--set", f"run_root={tmp_path / 'runs'}", "--dry-run",
                     "--hf-out", "hf", "--export-out", "trt", "checkpoint.dir=ck"]) == 0
    stages = dict(re.findall(r"^# stage (\S+): (.*)$", out.getvalue(), re.M))
    assert shlex.split(stages["llama-tiny-convert"])[-2:] == [str(elsewhere / "ck"), str(elsewhere / "hf")]
    assert shlex.split(stages["llama-tiny-export"])[5:7] == [str(elsewhere / "hf"), str(elsewhere / "trt")]
