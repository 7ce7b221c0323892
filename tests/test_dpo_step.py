"""DPO's prepare_step on CPU with real gloo ranks (one in-process, two as processes): the step's pairs and, with
dpo.sft_weight, its chosen response tokens are counted over the micro-batches and the data-parallel ranks in one
all-reduce, the shares are those of base.step_share, and the step loss (the micro-batches' mean, as Megatron's
schedule takes it) is the formula's over the whole step. The model's per-token losses are given."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mcorekit.train.tasks.base import step_share
from mcorekit.train.tasks.dpo import METRICS, DirectPreferenceOptimization, chosen_tokens, micro_batch_loss


def _task(sft: float, beta: float = 0.3, ls: float = 0.1) -> DirectPreferenceOptimization:
    """The task for one step alone (no experiment file, no model): the live reference's log-probs are given."""
    task = DirectPreferenceOptimization.__new__(DirectPreferenceOptimization)
    task.exp = SimpleNamespace(dpo=SimpleNamespace(reference="live", beta=beta, label_smoothing=ls, sft_weight=sft))
    task.packed, task.tokens, task.rows_per_sample, task.datasets = None, None, 2, {}
    task.metrics = METRICS + (("nll_loss",) if sft else ())
    task.reference = SimpleNamespace(logps=lambda step: [b["given_ref"] for b in step])
    return task


@pytest.mark.parametrize("sft", [0.0, 0.5])
def test_one_all_reduce_gives_the_step_loss_of_the_formula(model_parallel: None, sft: float,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Micro-batches of 1 and 5 pairs (as packed rows hold different numbers): sft_weight's NLL is the mean over
    every chosen response token of the step, the DPO term the mean over its pairs."""
    from test_dpo import expected, fixed_batch, sums

    from mcorekit.train.tasks.dpo import sequence_logps

    pairs, beta, ls = 6, 0.3, 0.1
    policy, reference, mask = fixed_batch(pairs, 20, seed=7)
    ref, _ = sequence_logps(-reference, mask, None, 2 * pairs)
    rows = [ids + [pairs + i for i in ids] for ids in ([0], [1, 2, 3, 4, 5])]
    step = [{"tokens": torch.zeros(len(r), 20, dtype=torch.long), "pair_ids": torch.tensor(r[: len(r) // 2]),
             "loss_mask": mask[r], "given_ref": ref[r]} for r in rows]
    reduced = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **kw: reduced.append(t.shape) or all_reduce(t, *a, **kw))
    task = _task(sft, beta, ls)
    out = task.prepare_step(None, [iter(step), iter(step)], 2)  # type: ignore[arg-type]
    assert reduced == [torch.Size([2 if sft else 1])]  # one all-reduce: pairs (and chosen tokens) stacked
    monkeypatch.undo()

    assert [list(o) for o in out] == [step, step]
    chosen = [int(mask[i].sum()) for i in range(pairs)]
    assert float(step[0]["pair_share"]) == 6 / 2 and torch.equal(step[0]["pair_share"], step_share([1, 5], "cpu"))
    counts = {name: 6.0 for name in METRICS}
    if sft:
        share = step_share([chosen_tokens(b) for b in step], "cpu")
        assert torch.equal(step[1]["chosen_share"], share) and float(share) == sum(chosen) / 2
        counts["nll_loss"] = float(sum(chosen))
    else:
        assert step[0]["chosen_share"] is None
    assert {k: float(v) for k, v in task.step_counts.items()} == counts

    results = [micro_batch_loss(-policy[r], b, mask[r], beta, ls, sft, None, b["pair_share"], b["chosen_share"])
               for r, b in zip(rows, step)]
    p, q = sums(policy, mask), sums(reference, mask)
    want = expected(p[:pairs], p[pairs:], q[:pairs], q[pairs:], beta, ls, sft, chosen)
    assert abs(float(sum(loss for loss, _ in results) / 2) - want["loss"]) < 1e-5
    assert set(results[0][1]) == set(task.metrics)
    for name in task.metrics:
        assert abs(float(sum(m[name] for _, m in results) / 2) - want[name]) < 1e-5, name


def _rank_step(rank: int) -> list[dict[str, Any]]:
    """Rank 0: micro-batches of 1 and 3 pairs, 2 + 7 chosen response tokens; rank 1: 2 and 2 pairs, 4 + 5."""
    step = []
    for tokens_per_pair in ([[2], [3, 2, 2]], [[3, 1], [4, 1]])[rank]:
        n = len(tokens_per_pair)
        mask = torch.zeros(2 * n, 8)
        for i, k in enumerate(tokens_per_pair):
            mask[i, :k] = 1  # chosen rows: k response tokens
            mask[n + i, :3] = 1  # rejected rows: never counted
        step.append({"tokens": torch.zeros(2 * n, 8, dtype=torch.long), "pair_ids": torch.arange(n),
                     "loss_mask": mask, "given_ref": torch.zeros(2 * n)})
    return step


def _rank(rank: int, tmp: Path) -> None:
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2)
    ps.initialize_model_parallel()
    try:
        task = _task(0.5)
        step = _rank_step(rank)
        task.prepare_step(None, [iter(step)], 2)  # type: ignore[arg-type]
        got = {"pair_share": float(step[0]["pair_share"]), "chosen_share": float(step[1]["chosen_share"]),
               "counts": {k: float(v) for k, v in task.step_counts.items()}}
        (tmp / f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_the_counts_cover_every_data_parallel_rank(tmp_path: Path) -> None:
    """8 pairs and 18 chosen response tokens over 2 micro-batches x 2 DP ranks, on both ranks."""
    mp.spawn(_rank, args=(tmp_path,), nprocs=2)
    want = {"pair_share": 8 / 4, "chosen_share": 18 / 4,
            "counts": {**{name: 8.0 for name in METRICS}, "nll_loss": 18.0}}
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [want, want]
