"""SFT's and DPO's step loss is the mean over all of the step's response tokens (pairs), whatever their split into
micro-batches and data-parallel ranks (tasks/base.step_share), as TRL and NeMo take it: the micro-batch losses that
Megatron's schedule averages (and DDP over DP ranks) are checked against the formula over the whole step. On CPU
with real gloo ranks (one in-process, two as processes); the model's per-token losses are given."""

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
