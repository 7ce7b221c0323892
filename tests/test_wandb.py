"""logging.wandb (issue 17): rank 0's metrics to Weights & Biases next to TensorBoard, tested in offline mode by
reading back the run file wandb writes under the run folder; the launcher and the ranks refuse it, in one line,
where the wandb package is missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from mcorekit.config.experiment import Experiment, WandbConfig
from mcorekit.config.rules import Nodes, problems
from mcorekit.train.metrics import WANDB_ID_FILE, MetricsWriter


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a .wandb file: a ':W&B' header, then LevelDB-log records (32 KiB blocks, 7-byte headers:
    crc, length, type FULL/FIRST/MIDDLE/LAST) each holding one wandb_internal Record protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's zero-filled trailer
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield pb.Record.FromString(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pb.Record.FromString(pending + chunk)


def test_offline_run_holds_the_logged_values(tmp_path: Path) -> None:
    idle = MetricsWriter(tmp_path / "rank1", tensorboard=False, enabled=False,
                         wandb=WandbConfig(project="mck", mode="offline"), name="tiny")
    assert idle.wandb is None  # only rank 0 logs
    writer = MetricsWriter(tmp_path, tensorboard=False, enabled=True,
                           wandb=WandbConfig(project="mck", mode="offline"), name="tiny")
    for step in (1, 2, 3):
        writer.write(step, 3, {"step": step, "loss": 10.0 / step, "lr": 3e-4, "expert_tokens": {"1": [1, 2]}})
    writer.close()
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()  # a requeued job continues this W&B run
    [run_file] = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    records = list(wandb_records(run_file))
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, run.run_id) == ("mck", "tiny", run_id)
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): i.value_json for i in r.history.item}
            history[r.history.step.num] = {k: float(items[k]) for k in ("loss", "lr")}
    assert history == {1: {"loss": 10.0, "lr": 3e-4}, 2: {"loss": 5.0, "lr": 3e-4}, 3: {"loss": 10.0 / 3, "lr": 3e-4}}


def tiny(**logging: Any) -> Experiment:
    return Experiment.model_validate({"name": "tiny", "model": {"preset": "llama-tiny"}, "data": {"seq_length": 128},
                                      "schedule": {"micro_batch_size": 1, "global_batch_size": 2}, "logging": logging})


def test_missing_wandb_package_is_one_problem_before_training() -> None:
    exp = tiny(wandb={"project": "mck", "mode": "offline"})
    without = Nodes(transformer_engine=False, gpus=False, where="profile 'x'", wandb=False)
    assert problems(exp, 1, without) == ["logging.wandb: the wandb package is not importable on profile 'x': pip "
                                         "install 'mcorekit[wandb]' there, or set logging.wandb.mode=disabled"]
    assert problems(exp, 1, Nodes(transformer_engine=False, gpus=False, wandb=True)) == []
    assert problems(exp, 1, Nodes(transformer_engine=False, gpus=False, wandb=None)) == []  # unknown: the ranks check
    disabled = tiny(wandb={"project": "mck", "mode": "disabled"})
    assert problems(disabled, 1, without) == []
