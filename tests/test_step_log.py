"""train/loop.StepLog's rates on CPU (one gloo rank; the clock and the CUDA calls replaced, as there is no GPU here):
the steps of the first line after a resume are the steps run, a save's time is left out like validation's, LoRA's
frozen weights count x4, GRPO logs no loop rates and DPO no perplexity; tokens/s counts real tokens, MFU every
position (padding included)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mcorekit.config.experiment import load_experiment
from mcorekit.models.spec import PRESETS
from mcorekit.train.flops import train_flops_per_token
from mcorekit.train.loop import StepLog
from mcorekit.train.tasks import TASKS


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: str, *overrides: str,
         start: int = 0) -> tuple[StepLog, Clock]:
    clock = Clock()
    tmp_path.mkdir(exist_ok=True)
    monkeypatch.setattr("mcorekit.train.loop.time.perf_counter", clock)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    exp = load_experiment("examples/llama-tiny.yaml", ["logging.log_interval=10", "schedule.train_iters=2000",
                                                       *overrides])
    spec = PRESETS["llama-tiny"]
    t = SimpleNamespace(spec=spec, padded_vocab=256, model=[],
                        optimizer=SimpleNamespace(param_groups=[{"lr": 1e-4}]))
    kind = TASKS[task]
    task_ = SimpleNamespace(name=task, rows_per_sample=1, packed=None, tokens=None, loop_rates=kind.loop_rates,
                            perplexity=kind.perplexity)
    return StepLog(t, exp, tmp_path, 989.0, None, task_, start), clock  # type: ignore[arg-type]


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_the_first_line_after_a_resume_counts_the_steps_run_and_saves_are_left_out(
        model_parallel: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log, clock = _log(tmp_path, monkeypatch, "lm", start=1003)
    for step in range(1004, 1011):  # 7 steps of 1 s, and a 30 s save at step 1005
        clock.now += 1.0
        if step == 1005:
            with log.paused():
                clock.now += 30.0
        log.step(step, {"loss": 2.0, "updated": True, "grad_norm": 1.0})
    row = _rows(tmp_path)[-1]
    tokens = log.tokens_per_step
    assert row["step"] == 1010 and row["tokens_per_s"] == pytest.approx(tokens * 7 / 7.0)
    assert row["step_s"] == pytest.approx(1.0)
    clock.now += 20.0
    log.step(1020, {"loss": 2.0, "updated": True, "grad_norm": 1.0})
    assert _rows(tmp_path)[-1]["tokens_per_s"] == pytest.approx(tokens * 10 / 20.0)
    assert _rows(tmp_path)[-1]["step_s"] == pytest.approx(2.0)


def test_lora_counts_frozen_weights_grpo_logs_no_loop_rates_dpo_no_perplexity(
        model_parallel: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, seq = PRESETS["llama-tiny"], load_experiment("examples/llama-tiny.yaml").data.seq_length
    lora, _ = _log(tmp_path / "a", monkeypatch, "sft", "peft.lora={rank: 4}", "checkpoint.load=/ckpt")
    assert lora.flops_per_token() == train_flops_per_token(spec, seq, 256, True) < train_flops_per_token(spec, seq, 256)
    grpo, clock = _log(tmp_path / "b", monkeypatch, "grpo")
    clock.now += 5.0
    grpo.step(10, {"loss": 0.1, "updated": True, "grad_norm": 1.0})
    assert not {"step_s", "tokens_per_s", "mfu", "tflops_per_gpu"} & set(_rows(tmp_path / "b")[-1])
    dpo, _ = _log(tmp_path / "c", monkeypatch, "dpo")
    dpo.validation(10, lambda: {"loss": 0.6})
    sft, _ = _log(tmp_path / "d", monkeypatch, "sft")
    sft.validation(10, lambda: {"loss": 0.6})
    assert "val_ppl" not in _rows(tmp_path / "c")[-1] and _rows(tmp_path / "d")[-1]["val_ppl"] == pytest.approx(1.822,
                                                                                                             abs=1e-3)


def test_mfu_is_taken_against_the_run_folders_cluster_profile(tmp_path: Path) -> None:
    """A launched run folder holds its cluster.yaml: an A100 profile's 312 TFLOP/s, not an H100's 989."""
    from mcorekit.config.cluster import gpu_peak_tflops

    assert gpu_peak_tflops(tmp_path) == 989.0
    text = Path("slurm/clusters/example-h100.yaml").read_text().replace("gpu_peak_tflops_bf16: 989",
                                                                         "gpu_peak_tflops_bf16: 312")
    (tmp_path / "cluster.yaml").write_text(text)
    assert gpu_peak_tflops(tmp_path) == 312.0


def test_packed_rows_are_charged_the_attention_within_each_example(model_parallel: None, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rows of seq_length S, one holding two examples of S/2 (and the training steps only: a step read in eval
    mode is validation): attention computed is (2 (S/2)^2 + S^2) / (2 S^2) = 3/4 of full-length rows'."""
    from mcorekit.train.tasks.base import PackedAttention

    log, clock = _log(tmp_path, monkeypatch, "sft")
    seq = log.exp.data.seq_length
    log.task.packed = PackedAttention(seq)
    log.task.packed.count([{"cu_seqlens": torch.tensor([0, seq // 2, seq], dtype=torch.int32)},
                           {"cu_seqlens": torch.tensor([0, seq], dtype=torch.int32)}])
    clock.now += 2.0
    log.step(10, {"loss": 2.0, "updated": True, "grad_norm": 1.0})
    row = _rows(tmp_path)[-1]
    want = log.flops_per_token(0.75) * log.tokens_per_step * 10 / 2.0 / 1e12
    assert row["tflops_per_gpu"] == pytest.approx(want) and log.flops_per_token(0.75) < log.flops_per_token()
    assert (log.task.packed.squares, log.task.packed.rows) == (0.0, 0)  # read once per line


def _padded(lengths: list[int], seq: int) -> dict[str, torch.Tensor]:
    """Unpacked rows as the SFT data makes them (packing.pad_one): an example of `length` positions (its first two a
    prompt), then padding to seq."""
    from mcorekit.train.data.packing import Example, pad_one

    rows = [pad_one(Example(list(range(1, n + 2)), [0, 0] + [1] * (n - 1)), seq, 0) for n in lengths]
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def test_tokens_per_s_counts_real_tokens_mfu_every_position_padding_included(
        model_parallel: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpacked SFT rows are padded to seq_length: tokens/s counts the examples' positions only (the real tokens);
    TFLOP/s and MFU count the FLOPs the GPU spent, on every position of every row (Megatron's convention). A step read
    in eval mode (validation) is not counted, and the count is read once per line."""
    from mcorekit.train.tasks.sft import SupervisedFineTuning

    log, clock = _log(tmp_path, monkeypatch, "sft", start=9)
    seq = log.exp.data.seq_length  # 128; global batch 8 = 4 micro-batches of 2 rows
    task = SupervisedFineTuning(log.exp, log.t.spec, tmp_path)
    log.task = task
    lengths = [[10, 30], [128, 127], [1, 64], [5, 7]]  # a full row, a row with one padding position
    step = [_padded(pair, seq) for pair in lengths]
    log.t.model = [SimpleNamespace(training=False)]
    task.prepare_step(log.t, [iter(step)], 4)  # validation: not training throughput
    log.t.model = [SimpleNamespace(training=True)]
    task.prepare_step(log.t, [iter(step)], 4)
    clock.now += 2.0
    log.step(10, {"loss": 2.0, "updated": True, "grad_norm": 1.0})
    row = _rows(tmp_path)[-1]
    real = sum(sum(pair) for pair in lengths)
    assert log.tokens_per_step == 8 * seq > real
    assert row["tokens_per_s"] == pytest.approx(real / 2.0) and row["step_s"] == 2.0  # 1 step: 9 -> 10
    tflops = log.flops_per_token(1.0) * 8 * seq / 2.0 / 1e12
    assert row["tflops_per_gpu"] == pytest.approx(tflops) and row["mfu"] == pytest.approx(tflops / 989.0)
    clock.now += 2.0
    log.step(20, {"loss": 2.0, "updated": True, "grad_norm": 1.0})  # no step read since: nothing counted twice
    assert _rows(tmp_path)[-1]["tokens_per_s"] == 0.0


def test_real_tokens_of_dpo_pairs_and_packed_rows(model_parallel: None) -> None:
    """DPO's unpacked rows (a chosen and a rejected sequence, each padded) and packed rows (whole examples, then the
    padding as its own segment) count their examples' positions."""
    from mcorekit.train.data.packing import Example, pack, pad_one
    from mcorekit.train.data.preference import collate
    from mcorekit.train.tasks.base import RealTokens

    seq = 32
    chosen, rejected = Example(list(range(1, 12)), [0] * 4 + [1] * 7), Example(list(range(1, 8)), [0] * 4 + [1] * 3)
    pairs = collate([{"chosen": pad_one(chosen, seq, 0), "rejected": pad_one(rejected, seq, 0),
                      "pair_ids": torch.tensor([0])}], device="cpu")
    packed = pack([chosen, rejected, Example([3, 4, 5], [0, 1, 1])], seq, 0)
    full = pack([Example(list(range(1, 20)), [0] * 3 + [1] * 16), Example(list(range(1, 16)), [0] * 3 + [1] * 12)],
                seq, 0)  # 18 + 14 positions: no padding
    counter = RealTokens()
    counter.count([pairs, {k: v.unsqueeze(0) if torch.is_tensor(v) and k != "cu_seqlens" else v
                           for k, v in packed.items()}, {k: v.unsqueeze(0) if k != "cu_seqlens" else v
                                                         for k, v in full.items() if torch.is_tensor(v)}])
    assert counter.read() == (10 + 6) + (10 + 6 + 2) + 32
    assert counter.read() == 0  # reset once read


def _peak(rank: int, tmp: Path) -> None:
    import torch.distributed as dist

    from mcorekit.train.loop import peak_memory_gb

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2)
    torch.cuda.max_memory_allocated = lambda: [3e9, 7e9][rank]  # no GPU here: each rank's peak, given
    try:
        (tmp / f"rank{rank}.txt").write_text(repr(peak_memory_gb()))
    finally:
        dist.destroy_process_group()


def test_memory_is_the_largest_peak_over_the_ranks(tmp_path: Path) -> None:
    """A pipeline stage or expert group nearer its limit than rank 0 is the one a user must see."""
    import torch.multiprocessing as mp

    mp.spawn(_peak, args=(tmp_path,), nprocs=2)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["7.0", "7.0"]
