"""SFT's and DPO's step loss is the mean over all of the step's response tokens (pairs), whatever their split into
micro-batches and data-parallel ranks (tasks/base.step_share), as TRL and NeMo take it: the micro-batch losses that
Megatron's schedule averages (and DDP over DP ranks) are checked against the formula over the whole step. On CPU
with real gloo ranks (one in-process, two as processes); the model's per-token losses are given. Validation
(loop.evaluate) takes the same means over all its batches' tokens (pairs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mcorekit.train.tasks.base import step_share
from mcorekit.train.tasks.dpo import chosen_tokens, micro_batch_loss, sequence_logps
from mcorekit.train.tasks.lm import masked_mean
from mcorekit.train.tasks.sft import SupervisedFineTuning
from test_checkpoint_writer import _finalize_on_cpu  # noqa: F401  # a fixture
from test_dpo import expected, fixed_batch, sums


def _sft_micro_batches() -> list[dict[str, torch.Tensor]]:
    """Two micro-batches of two rows: 2 response tokens in the first, 9 in the second."""
    g = torch.Generator().manual_seed(0)
    first, second = torch.zeros(2, 8), torch.zeros(2, 8)
    first[0, 6:] = 1
    second[0, 2:7], second[1, 4:8] = 1, 1
    return [{"loss_mask": m, "per_token": torch.rand(2, 8, generator=g) * 5} for m in (first, second)]


def test_sft_step_loss_is_the_mean_over_the_steps_response_tokens(model_parallel: None) -> None:
    batches = _sft_micro_batches()
    chunks = [iter(batches), iter(batches)]  # two virtual pipeline stages read the same micro-batches
    task = SupervisedFineTuning.__new__(SupervisedFineTuning)  # the step alone: no experiment needed
    task.packed = None
    step = task.prepare_step(None, chunks, 2)  # type: ignore[arg-type]
    assert [list(c) for c in step] == [batches, batches] and next(chunks[1], None) is None
    assert float(batches[0]["token_share"]) == 11 / 2
    losses = [masked_mean(b["per_token"], b["loss_mask"], None, b["token_share"]) for b in batches]
    every = torch.cat([b["per_token"][b["loss_mask"] == 1] for b in batches])
    assert abs(float(sum(losses) / 2) - float(every.mean())) < 1e-6  # the schedule's mean over micro-batches
    per_micro_batch = sum(masked_mean(b["per_token"], b["loss_mask"]) for b in batches) / 2
    assert abs(float(per_micro_batch) - float(every.mean())) > 0.1  # what a mean per micro-batch gave


@pytest.mark.parametrize("sft", [0.0, 0.5])
def test_dpo_step_loss_and_metrics_are_means_over_the_steps_pairs(model_parallel: None, sft: float) -> None:
    """Packed rows hold different numbers of pairs: micro-batches of 1 and 5 pairs here; sft_weight's NLL is the mean
    over every chosen response token of the step."""
    pairs, beta, ls = 6, 0.3, 0.1
    policy, reference, mask = fixed_batch(pairs, 20, seed=7)
    ref, _ = sequence_logps(-reference, mask, None, 2 * pairs)
    batches = []
    for ids in ([0], [1, 2, 3, 4, 5]):
        rows = ids + [pairs + i for i in ids]
        batches.append((rows, {"pair_ids": torch.tensor(ids), "ref_logps": ref[rows], "loss_mask": mask[rows]}))
    share = step_share([1, 5], "cpu")
    token_share = step_share([chosen_tokens(b) for _, b in batches], "cpu")
    results = [micro_batch_loss(-policy[rows], b, mask[rows], beta, ls, sft, None, share, token_share)
               for rows, b in batches]
    p, r = sums(policy, mask), sums(reference, mask)
    want = expected(p[:pairs], p[pairs:], r[:pairs], r[pairs:], beta, ls, sft,
                    [int(mask[i].sum()) for i in range(pairs)])
    assert abs(float(sum(loss for loss, _ in results) / 2) - want["loss"]) < 1e-5
    for name in results[0][1]:
        assert abs(float(sum(m[name] for _, m in results) / 2) - want[name]) < 1e-5, name


def _rank(rank: int, tmp: Path) -> None:
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2)
    ps.initialize_model_parallel()
    try:
        share = step_share([[2.0, 6.0], [4.0, 0.0]][rank], "cpu")
        (tmp / f"rank{rank}.txt").write_text(repr(float(share)))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_the_share_counts_every_data_parallel_rank(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(tmp_path,), nprocs=2)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["3.0", "3.0"]  # 12 over 2 x 2


@pytest.mark.parametrize("counts", [[0, 0], [0.0]])
def test_a_step_without_response_tokens_is_no_nan(model_parallel: None, counts: list) -> None:
    assert float(step_share(counts, "cpu")) == 1 / len(counts)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_grpo_log_probs_are_those_of_the_tempered_distribution(model_parallel: None, temperature: float,
                                                               _finalize_on_cpu: None) -> None:
    """lm.next_token_losses at a temperature against log_softmax(logits / T) of the same model's logits."""
    from mcorekit.train.tasks.lm import next_token_losses
    from test_checkpoint_reader import _gpt

    torch.manual_seed(0)
    model = _gpt().eval()
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 256, (2, 12), generator=g), torch.randint(0, 256, (2, 12), generator=g)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(2, 12),
             "position_ids": torch.arange(12).expand(2, 12)}
    with torch.no_grad():
        per_token, _, _ = next_token_losses(batch, model, temperature)
        logits = model(tokens, batch["position_ids"], attention_mask=None)
    want = -torch.log_softmax(logits.float() / temperature, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert per_token.shape == (2, 12) and torch.allclose(per_token, want, atol=1e-5)


def test_chosen_tokens_of_a_packed_row_are_those_of_its_chosen_sequences() -> None:
    """A packed row holds c0, r0, c1, r1 (seq_ids 0, 2, 1, 3 for 2 pairs): the chosen ones are seq_ids < pairs."""
    seq_ids = torch.tensor([[0, 0, 0, 2, 2, 1, 1, 3, 3, 3]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 1, 1, 1, 1]], dtype=torch.float32)
    packed = {"pair_ids": torch.tensor([4, 9]), "seq_ids": seq_ids, "loss_mask": mask}
    assert float(chosen_tokens(packed)) == 3.0
    rows = {"pair_ids": torch.tensor([4, 9]), "loss_mask": torch.tensor([[1.0, 1], [0, 1], [1, 1], [1, 1]])}
    assert float(chosen_tokens(rows)) == 3.0


# ---------------------------------------------------------------- validation: the mean over all its tokens (pairs)


class _CpuCounter:
    """torch, as Megatron's no-pipelining schedule sees it, except that its token counter (made on "cuda") is made on
    the CPU: the schedule runs as it is on the GPU, on one gloo rank here."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def zeros(*shape: object, device: object = None, **kw: object) -> torch.Tensor:
        return torch.zeros(*shape, **kw)  # type: ignore[call-overload]


def _validation_run(task: object, batches: list[dict[str, torch.Tensor]], micro_batches: int,
                    rows: int) -> tuple[object, dict[str, float]]:
    """loop.evaluate on one gloo rank through Megatron's forward-only schedule, a tiny GPTModel as the model:
    len(batches) / micro_batches validation batches."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel import schedules

    from mcorekit.train.loop import evaluate
    from test_checkpoint_reader import _gpt

    mp = pytest.MonkeyPatch()
    mp.setattr(schedules, "torch", _CpuCounter())

    torch.manual_seed(0)
    model = _gpt()
    with torch.no_grad():  # sharper logits than a fresh model's: per-token losses that differ between tokens
        model.output_layer.weight.mul_(40.0)
    schedule = SimpleNamespace(eval_iters=len(batches) // micro_batches, micro_batch_size=rows,
                               global_batch_size=micro_batches * rows)
    exp = SimpleNamespace(schedule=schedule, data=SimpleNamespace(seq_length=batches[0]["tokens"].shape[1]))
    t = SimpleNamespace(exp=exp, model=[model], dp_rank=0, dp_size=1)
    task.batches = lambda dataset, first, rank, size: iter(dataset)  # type: ignore[attr-defined]  # on the CPU
    try:
        return model, evaluate(t, task, batches)  # type: ignore[arg-type]
    finally:
        mp.undo()


def _rows(masks: list[list[int]], seq: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Rows of random tokens, each with a loss mask on positions [start, end)."""
    mask = torch.zeros(len(masks), seq)
    for r, (start, end) in enumerate(masks):
        mask[r, start:end] = 1
    return {"tokens": torch.randint(0, 256, (len(masks), seq), generator=g),
            "labels": torch.randint(0, 256, (len(masks), seq), generator=g), "loss_mask": mask,
            "position_ids": torch.arange(seq).expand(len(masks), seq)}


def _per_token(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"]).float()


@pytest.mark.parametrize("kind", ["sft", "lm"])
def test_validation_loss_is_the_mean_over_every_validation_token(model_parallel: None, kind: str) -> None:
    """SFT: two validation batches of two micro-batches, 3 response tokens in the first, 40 in the second: val loss is
    the mean over the 43 (a mean of the batches' means weighed each of the 3 like 13 of the 40). lm (pretraining):
    every batch holds the same tokens, the mean of the batches' means as before."""
    from mcorekit.train.tasks.lm import LanguageModelling

    seq, g = 12, torch.Generator().manual_seed(3)
    if kind == "sft":
        task = SupervisedFineTuning.__new__(SupervisedFineTuning)
        spans = [[(10, 12), (0, 0)], [(11, 12), (0, 0)], [(0, 12), (2, 12)], [(0, 12), (0, 6)]]
    else:
        task = LanguageModelling.__new__(LanguageModelling)
        spans = [[(0, seq), (0, seq)]] * 4
    task.packed = None
    batches = [_rows(s, seq, g) for s in spans]
    model, val = _validation_run(task, batches, 2, 2)
    losses = [_per_token(model, b)[b["loss_mask"] == 1] for b in batches]
    every = torch.cat(losses)
    assert every.numel() == (43 if kind == "sft" else 96)
    assert abs(val["loss"] - float(every.mean())) < 1e-5
    batch_means = [float(torch.cat(losses[i:i + 2]).mean()) for i in (0, 2)]
    if kind == "sft":
        assert abs(val["loss"] - sum(batch_means) / 2) > 0.05  # what averaging the batches' means gave
    else:
        assert abs(val["loss"] - sum(batch_means) / 2) < 1e-5


@pytest.mark.parametrize("sft", [0.0, 0.5])
def test_dpo_validation_metrics_are_means_over_every_validation_pair(model_parallel: None, sft: float) -> None:
    """Validation batches holding 2 and 6 pairs (micro-batches of 1 and 3 pairs, as packed rows hold different
    numbers): the loss and every metric are the means over the 8 pairs, sft_weight's NLL the mean over every chosen
    response token, against the formula (test_dpo.expected) on the model's own log-probs."""
    from types import SimpleNamespace

    from mcorekit.train.tasks.dpo import METRICS, DirectPreferenceOptimization

    beta, ls, seq, g = 0.3, 0.1, 12, torch.Generator().manual_seed(5)
    task = DirectPreferenceOptimization.__new__(DirectPreferenceOptimization)
    task.exp = SimpleNamespace(dpo=SimpleNamespace(reference="live", beta=beta, label_smoothing=ls, sft_weight=sft))
    task.packed, task.rows_per_sample, task.datasets = None, 2, {}
    task.metrics = METRICS + (("nll_loss",) if sft else ())
    task.reference = SimpleNamespace(logps=lambda step: [b["given_ref"] for b in step])
    batches = []
    for pairs in (1, 1, 3, 3):
        spans = [(int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(6, seq + 1, (1,), generator=g)))
                 for _ in range(2 * pairs)]  # chosen rows, then rejected rows
        batch = _rows(spans, seq, g)
        batch["pair_ids"] = torch.arange(pairs)
        batch["given_ref"] = -torch.rand(2 * pairs, generator=g) * 20
        batches.append(batch)
    model, val = _validation_run(task, batches, 2, 2)
    pc, pr, rc, rr, chosen = [], [], [], [], []
    for b in batches:
        n = b["pair_ids"].numel()
        logps = (-_per_token(model, b) * b["loss_mask"]).sum(1).tolist()
        pc += logps[:n]
        pr += logps[n:]
        rc += b["given_ref"][:n].tolist()
        rr += b["given_ref"][n:].tolist()
        chosen += b["loss_mask"][:n].sum(1).int().tolist()
    want = expected(pc, pr, rc, rr, beta, ls, sft, chosen)
    assert set(val) == set(task.metrics)
    for name in task.metrics:
        assert abs(val[name] - want[name]) < 1e-4 * max(1.0, abs(want[name])), (name, val[name], want[name])
