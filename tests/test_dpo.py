"""DPO on CPU: the loss and every metric against an independent computation from the formula (fp32, 1e-5), pairs
never split by batching (many global batch / micro-batch / DP combinations, packed or not), the preference data's
masks on exactly the response tokens with a real (offline) tokenizer, truncation, bad lines, the stored reference
log-probs, and the rules. Nothing mocked; the training itself runs on the GPU machine (tests/test_gpu_dpo.py)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_models import WORDS, make_tokenizer
from mcorekit.errors import ConfigError
from mcorekit.train.data.preference import PreferenceDataset, fit_pair, pair_batches
from mcorekit.train.tasks.dpo import (METRICS, dpo_loss, micro_batch_loss, read_reference, sequence_logps,
                                      write_reference)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


# ---------------------------------------------------------------- the loss, from the formula


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def expected(pc: list[float], pr: list[float], rc: list[float], rr: list[float], beta: float, ls: float,
             sft: float, chosen_tokens: list[int]) -> dict[str, float]:
    """The DPO loss and TRL's metrics, written from the definitions with Python floats."""
    n = len(pc)
    margins = [(pc[i] - rc[i]) - (pr[i] - rr[i]) for i in range(n)]
    loss = sum(-(1 - ls) * logsigmoid(beta * m) - ls * logsigmoid(-beta * m) for m in margins) / n
    nll = -sum(pc) / sum(chosen_tokens)
    if sft:
        loss += sft * nll
    r_c = [beta * (pc[i] - rc[i]) for i in range(n)]
    r_r = [beta * (pr[i] - rr[i]) for i in range(n)]
    return {"loss": loss, "rewards/chosen": sum(r_c) / n, "rewards/rejected": sum(r_r) / n,
            "rewards/accuracies": sum(a > b for a, b in zip(r_c, r_r)) / n,
            "rewards/margins": sum(a - b for a, b in zip(r_c, r_r)) / n, "logps/chosen": sum(pc) / n,
            "logps/rejected": sum(pr) / n, "nll_loss": nll}


def fixed_batch(pairs: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token log-probs of policy and reference for 2 x pairs rows (chosen rows, then rejected rows) and a loss
    mask covering each row's response: a prompt of 2-5 tokens, then a response of 3 or more."""
    g = torch.Generator().manual_seed(seed)
    policy = -torch.rand(2 * pairs, length, generator=g) * 4
    reference = policy + 0.3 * torch.randn(2 * pairs, length, generator=g)  # near the policy, as in training
    mask = torch.zeros(2 * pairs, length)
    for row in range(2 * pairs):
        start = int(torch.randint(2, 6, (1,), generator=g))
        end = int(torch.randint(start + 3, length + 1, (1,), generator=g))
        mask[row, start:end] = 1
    return policy, reference, mask


def sums(per_token: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [sum(float(per_token[r, c]) for c in range(mask.shape[1]) if mask[r, c]) for r in range(mask.shape[0])]


@pytest.mark.parametrize("beta,ls,sft", [(0.1, 0.0, 0.0), (0.5, 0.2, 0.0), (0.05, 0.0, 1.0), (1.0, 0.1, 0.3)])
def test_loss_and_every_metric_equal_the_formula(beta: float, ls: float, sft: float) -> None:
    pairs = 6
    policy, reference, mask = fixed_batch(pairs, 24, seed=int(beta * 100 + ls * 10 + sft))
    # the reference's sequence log-probs come from the same function the reference pass uses
    ref, _ = sequence_logps(-reference, mask, None, 2 * pairs)
    batch = {"pair_ids": torch.arange(pairs), "ref_logps": ref}
    loss, metrics = micro_batch_loss(-policy, batch, mask, beta, ls, sft)  # the model gives losses: -logp

    p, r = sums(policy, mask), sums(reference, mask)
    want = expected(p[:pairs], p[pairs:], r[:pairs], r[pairs:], beta, ls, sft,
                    [int(mask[i].sum()) for i in range(pairs)])
    assert list(metrics)[: len(METRICS)] == list(METRICS) and ("nll_loss" in metrics) == bool(sft)
    assert abs(float(loss) - want["loss"]) < 1e-5
    for name, value in metrics.items():
        assert value.dtype == torch.float32 and value.shape == ()
        assert abs(float(value) - want[name]) < 1e-5, (name, float(value), want[name])
    assert 0 < float(metrics["rewards/accuracies"]) < 1  # the fixed batch has pairs of both kinds


def test_packed_rows_give_the_same_values_as_separate_rows() -> None:
    """Sequences packed into one row and told apart by seq_ids: the same per-sequence sums, loss and metrics."""
    pairs, length = 3, 10
    policy, reference, mask = fixed_batch(pairs, length, seed=3)
    order = [k for j in range(pairs) for k in (j, pairs + j)]  # c0, r0, c1, r1, ...: how a packed row holds them
    row = lambda x: torch.cat([x[k] for k in order]).unsqueeze(0)  # noqa: E731
    seq_ids = torch.tensor([k for k in order for _ in range(length)]).unsqueeze(0)
    ref_sep, _ = sequence_logps(-reference, mask, None, 2 * pairs)
    ref_packed, _ = sequence_logps(row(-reference), row(mask), seq_ids, 2 * pairs)
    assert torch.allclose(ref_sep, ref_packed, atol=1e-5)
    batch = {"pair_ids": torch.arange(pairs), "ref_logps": ref_sep}
    _, separate = micro_batch_loss(-policy, batch, mask, 0.2, 0.1, 0.5)
    _, packed = micro_batch_loss(row(-policy), {**batch, "seq_ids": seq_ids}, row(mask), 0.2, 0.1, 0.5)
    for name in separate:
        assert abs(float(separate[name]) - float(packed[name])) < 1e-5, name


def test_policy_equal_to_reference_gives_ln2_and_the_dpo_gradient() -> None:
    pairs = 4
    policy, _, mask = fixed_batch(pairs, 16, seed=5)
    lp = policy.clone().requires_grad_(True)
    ref, _ = sequence_logps(-policy, mask, None, 2 * pairs)
    loss, m = micro_batch_loss(-lp, {"pair_ids": torch.arange(pairs), "ref_logps": ref}, mask, beta=0.1)
    assert abs(float(loss.detach()) - math.log(2)) < 1e-6 and float(m["rewards/margins"]) == 0.0
    assert float(m["rewards/accuracies"]) == 0.0  # TRL counts chosen > rejected strictly
    loss.backward()
    # d loss / d logp(token) = -beta * sigmoid(-beta * m) / pairs on a chosen response token (+ on a rejected one)
    want = 0.1 * 0.5 / pairs
    assert torch.allclose(lp.grad[:pairs][mask[:pairs] == 1], torch.full((), -want))
    assert torch.allclose(lp.grad[pairs:][mask[pairs:] == 1], torch.full((), want))
    assert float(lp.grad[mask == 0].abs().sum()) == 0.0  # prompt and padding get no gradient


def test_dpo_loss_takes_per_pair_tensors() -> None:
    pc, pr = torch.tensor([-3.0, -7.0]), torch.tensor([-5.0, -6.0])
    rc, rr = torch.tensor([-4.0, -6.5]), torch.tensor([-4.5, -6.5])
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    want = expected([-3, -7], [-5, -6], [-4, -6.5], [-4.5, -6.5], 0.5, 0.0, 0.0, [1, 1])
    assert abs(float(loss) - want["loss"]) < 1e-6 and float(m["rewards/accuracies"]) == 0.5


# ---------------------------------------------------------------- preference data


def pref_file(path: Path, n: int, seed: int, chat_every: int = 2) -> Path:
    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    lines = []
    for i in range(n):
        if i % chat_every:
            lines.append({"prompt": [{"role": "user", "content": words(rng.randint(1, 12))}],
                          "chosen": [{"role": "assistant", "content": words(rng.randint(1, 10))}],
                          "rejected": {"role": "assistant", "content": words(rng.randint(1, 10))}})
        else:
            lines.append({"prompt": words(rng.randint(1, 12)), "chosen": words(rng.randint(1, 10)),
                          "rejected": words(rng.randint(1, 10))})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pref_file(tmp_path_factory.mktemp("pref") / "pairs.jsonl", 60, seed=1)


def learned(tokenizer, sample: dict) -> list[str]:  # noqa: ANN001
    """The target tokens under the loss mask (labels at mask 1)."""
    return tokenizer.convert_ids_to_tokens([int(t) for t, m in zip(sample["labels"], sample["loss_mask"]) if m])


def test_masks_cover_exactly_the_response_tokens(tmp_path: Path, tok: Path) -> None:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    lines = [{"prompt": "hello what is it", "chosen": "it is a question", "rejected": "no"},
             {"prompt": [{"role": "system", "content": "you are good"}, {"role": "user", "content": "hello"},
                         {"role": "assistant", "content": "yes"}, {"role": "user", "content": "what is it"}],
              "chosen": {"role": "assistant", "content": "it is a question"},
              "rejected": [{"role": "assistant", "content": "no"}]},
             {"prompt": [{"role": "user", "content": "what is it"}], "chosen": "a question", "rejected": "no no"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ds = PreferenceDataset([str(tmp_path / "p.jsonl")], str(tok), 48, seed=0, packing=False, vocab_size=256)
    want = [(["it", "is", "a", "question", "<eos>"], ["no", "<eos>"]),
            (["it", "is", "a", "question", "<|end|>"], ["no", "<|end|>"]),  # not the earlier assistant turn "yes"
            (["a", "question", "<|end|>"], ["no", "no", "<|end|>"])]
    prompts = [t("hello what is it", add_special_tokens=False)["input_ids"],
               t(t.apply_chat_template(lines[1]["prompt"], tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"],
               t("<|user|> what is it <|end|> <|assistant|>", add_special_tokens=False)["input_ids"]]
    for b, (chosen, rejected) in enumerate(want):
        s = ds.sample(b)
        assert learned(t, s["chosen"]) == chosen and learned(t, s["rejected"]) == rejected
        for side in ("chosen", "rejected"):  # both sequences start with the same prompt, which is not learned
            n = len(prompts[b])
            assert s[side]["tokens"][:n].tolist() == prompts[b]
            assert s[side]["loss_mask"][: n - 1].sum() == 0 and s[side]["loss_mask"][n - 1] == 1
            assert s[side]["loss_mask"].sum() == len(chosen if side == "chosen" else rejected)


def test_pairs_with_the_same_response_twice_are_counted_in_a_warning(tmp_path: Path, tok: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """chosen == rejected (as text, or as a chat rendering) gives log 2 and no gradient: kept, named in a warning."""
    lines = [{"prompt": "hello", "chosen": "yes", "rejected": "yes"},
             {"prompt": "hello", "chosen": "yes", "rejected": "no"},
             {"prompt": [{"role": "user", "content": "hello"}], "chosen": "no",
              "rejected": [{"role": "assistant", "content": "no"}]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with caplog.at_level("WARNING", logger="mcorekit.train"):
        ds = PreferenceDataset([str(tmp_path / "p.jsonl")], str(tok), 32, seed=0, packing=False, vocab_size=256)
    assert len(ds.pairs) == 3
    assert (f"2 of 3 pairs have the same chosen and rejected response ({tmp_path / 'p.jsonl'}:1, "
            f"{tmp_path / 'p.jsonl'}:3)") in caplog.text


def test_truncation_cuts_the_prompt_from_the_left_and_leaves_out_what_cannot_fit(tmp_path: Path, tok: Path) -> None:
    prompt, chosen, rejected = list(range(10, 30)), [5, 6, 7], [8, 9]  # 20 prompt tokens
    c, r = fit_pair(prompt, chosen, rejected, seq_length=12, packing=False)
    # each sequence: at most 13 tokens (12 positions); the longer response (3) leaves 10 prompt tokens, the LAST 10
    assert c.ids == prompt[-10:] + chosen and r.ids == prompt[-10:] + rejected
    assert c.mask == [0] * 10 + [1] * 3 and r.mask == [0] * 10 + [1] * 2
    c, r = fit_pair(prompt, chosen, rejected, seq_length=12, packing=True)
    assert c.positions + r.positions <= 12 and c.ids == prompt[-4:] + chosen and r.ids == prompt[-4:] + rejected
    assert fit_pair(prompt, chosen, rejected, seq_length=40, packing=False)[0].ids == prompt + chosen  # fits: whole
    assert fit_pair(prompt, list(range(13)), rejected, seq_length=12, packing=False) is None  # needs 1 prompt token

    long = " ".join(["the"] * 30)
    lines = [{"prompt": long, "chosen": "yes", "rejected": "no"},  # prompt cut
             {"prompt": "hello", "chosen": long, "rejected": "no"},  # response too long: left out
             {"prompt": "hello", "chosen": "yes", "rejected": "no"}]  # fits
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ds = PreferenceDataset([str(tmp_path / "t.jsonl")], str(tok), 16, seed=0, packing=False, vocab_size=256)
    assert (len(ds.pairs), ds.truncated, ds.dropped) == (2, 1, 1)
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    the, yes, no = t.convert_tokens_to_ids(["the", "yes", "no"])
    # 17 tokens (16 positions) per sequence: the last 15 of the 30 prompt tokens, then the response and eos
    assert ds.pairs[0][0].ids == [the] * 15 + [yes, t.eos_token_id] and ds.pairs[0][1].ids == [the] * 15 + [no, 2]
    (tmp_path / "none.jsonl").write_text(json.dumps(lines[1]) + "\n")
    with pytest.raises(ConfigError, match=r"no preference pair fits data.seq_length=16 .*1 lines read"):
        PreferenceDataset([str(tmp_path / "none.jsonl")], str(tok), 16, seed=0, packing=False, vocab_size=256)


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "hello", "chosen": "yes"}', r"bad.jsonl:2: a preference pair needs 'prompt', 'chosen' and "
                                             r"'rejected' \(missing 'rejected'"),
    ('{"prompt": "hello", "chosen": "yes", "rejected": ', r"bad.jsonl:2: not valid JSON"),
    ('["prompt"]', r"bad.jsonl:2: expected a JSON object, got a JSON array"),
    ('{"prompt": "hello", "chosen": ["yes"], "rejected": "no"}', r"bad.jsonl:2: with a plain-text 'prompt', "
                                                                  r"'chosen' must be a string too"),
    ('{"prompt": [{"role": "user", "content": "hello"}], "chosen": [{"role": "user", "content": "yes"}], '
     '"rejected": "no"}', r"bad.jsonl:2: 'chosen' must hold assistant message\(s\) only"),
    ('{"prompt": [{"role": "user"}], "chosen": "yes", "rejected": "no"}', r"bad.jsonl:2: 'prompt' must be a non-empty "
                                                                        r"list of"),
    ('{"prompt": "hello", "chosen": "yes \\udc00", "rejected": "no"}', r"bad.jsonl:2: holds a lone UTF-16 surrogate"),
    ('{"prompt": "", "chosen": "yes", "rejected": "no"}', r"bad.jsonl:2: the prompt is empty \(no tokens, and this "
                                                        r"tokenizer puts no BOS before a text\)"),
])
def test_bad_lines_are_one_line_errors_naming_file_and_line(tmp_path: Path, tok: Path, line: str,
                                                            message: str) -> None:
    good = json.dumps({"prompt": "hello", "chosen": "yes", "rejected": "no"})
    (tmp_path / "bad.jsonl").write_text(good + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=message) as e:
        PreferenceDataset([str(tmp_path / "bad.jsonl")], str(tok), 32, seed=0, packing=False, vocab_size=256)
    assert "\n" not in str(e.value)


def test_missing_file_and_small_vocabulary_are_refused(tmp_path: Path, tok: Path, pairs_file: Path) -> None:
    with pytest.raises(ConfigError, match="preference data not found: .*nope.jsonl"):
        PreferenceDataset([str(tmp_path / "nope.jsonl")], str(tok), 32, 0, False, 256)
    with pytest.raises(ConfigError, match="vocabulary is 100"):
        PreferenceDataset([str(pairs_file)], str(tok), 32, 0, False, 100)


# ---------------------------------------------------------------- batching: a pair is never split


@pytest.fixture(scope="module")
def datasets(pairs_file: Path, tok: Path) -> dict[bool, PreferenceDataset]:
    return {packing: PreferenceDataset([str(pairs_file)], str(tok), 64, seed=3, packing=packing, vocab_size=256)
            for packing in (False, True)}


def check_micro_batch(ds: PreferenceDataset, batch: dict) -> list[int]:
    """Every pair of the micro-batch is whole in it: its chosen and its rejected sequence, in the places the loss
    reads them. Returns its pair ids."""
    ids = batch["pair_ids"].tolist()
    n = len(ids)
    if "seq_ids" not in batch:
        assert batch["tokens"].shape == (2 * n, ds.seq_length)
        rows = [batch["tokens"][k].tolist() for k in range(2 * n)]
        for j, p in enumerate(ids):
            chosen, rejected = ds.pairs[p]
            assert rows[j][: chosen.positions] == chosen.ids[:-1]  # row j: pair j's chosen sequence
            assert rows[n + j][: rejected.positions] == rejected.ids[:-1]  # row n + j: its rejected one
    else:
        assert batch["tokens"].shape == (1, ds.seq_length)
        tokens, labels, seq = batch["tokens"][0], batch["labels"][0], batch["seq_ids"][0]
        for j, p in enumerate(ids):
            for k, ex in ((j, ds.pairs[p][0]), (n + j, ds.pairs[p][1])):
                where = (seq == k) & (batch["loss_mask"][0] == 1)
                assert labels[where].tolist() == [t for t, m in zip(ex.ids[1:], ex.mask[1:]) if m]
                first = int((seq == k).nonzero()[0])  # the sequence starts at its segment boundary, whole
                assert first in batch["cu_seqlens"].tolist()
                assert tokens[first: first + ex.positions].tolist() == ex.ids[:-1]
    return ids


@pytest.mark.parametrize("packing", [False, True])
def test_pair_batching_never_splits_a_pair(datasets: dict[bool, PreferenceDataset], packing: bool) -> None:
    ds = datasets[packing]
    combos = [(g, m, d) for g in (1, 2, 4, 6, 8, 12, 16) for m in ((1,) if packing else (1, 2, 3, 4))
              for d in (1, 2, 3, 4) if g % (m * d) == 0]
    assert len(combos) >= (19 if packing else 40)
    for gbs, mbs, dp in combos:
        steps = 3
        its = [pair_batches(ds, mbs, 0, r, dp, device="cpu") for r in range(dp)]
        for step in range(steps):
            seen = []
            for r in range(dp):
                for _ in range(gbs // (mbs * dp)):
                    seen += check_micro_batch(ds, next(its[r]))
            # the global batch holds exactly the pairs of its samples, each once
            want = [p for g in range(step * gbs, (step + 1) * gbs) for p in ds[g]["pair_ids"].tolist()]
            assert sorted(seen) == sorted(want), (gbs, mbs, dp, step)
        # a resumed run continues the exact order
        resumed = pair_batches(ds, mbs, steps * gbs, 0, dp, device="cpu")
        assert torch.equal(next(resumed)["tokens"], next(its[0])["tokens"])


def test_packing_puts_both_sequences_of_a_pair_in_one_row(datasets: dict[bool, PreferenceDataset]) -> None:
    packed, plain = datasets[True], datasets[False]
    assert len(packed) < len(plain) / 2 and sorted(p for b in packed.bins for p in b) == list(range(len(plain.pairs)))
    for b in range(len(packed)):
        s = packed.sample(b)
        n = s["pair_ids"].numel()
        assert sorted(set(s["seq_ids"][s["loss_mask"] == 1].tolist())) == list(range(2 * n))
        assert len(s["cu_seqlens"]) - 1 in (2 * n, 2 * n + 1)  # the sequences, then padding if any


# ---------------------------------------------------------------- precomputed reference log-probs


def test_stored_reference_logps_are_read_back_by_pair(tmp_path: Path, datasets: dict[bool, PreferenceDataset]) -> None:
    ds = datasets[False]
    values = np.random.default_rng(0).normal(-20, 5, (len(ds.pairs), 2)).astype(np.float32)
    path = tmp_path / "reference_logps" / "train.safetensors"
    write_reference(path, values, "key-1")
    assert path.read_bytes()[8:9] == b"{"  # safetensors: a length, then a JSON header (no pickle)
    assert np.array_equal(read_reference(path, "key-1", len(ds.pairs)), values)
    assert read_reference(path, "key-2", len(ds.pairs)) is None  # another data/model/start: recomputed
    assert read_reference(path, "key-1", len(ds.pairs) + 1) is None
    assert read_reference(tmp_path / "none.safetensors", "key-1", 3) is None
    (tmp_path / "damaged.safetensors").write_bytes(path.read_bytes()[:40])  # a start killed mid-write elsewhere
    assert read_reference(tmp_path / "damaged.safetensors", "key-1", len(ds.pairs)) is None  # was a SafetensorError
    try:
        ds.reference = values
        batch = next(pair_batches(ds, 3, 5, 0, 1, device="cpu"))
        ids = batch["pair_ids"]
        assert torch.equal(batch["ref_logps"], torch.cat([torch.from_numpy(values[ids, 0]),
                                                          torch.from_numpy(values[ids, 1])]))
        packed = datasets[True]
        packed.reference = values
        batch = next(pair_batches(packed, 1, 2, 0, 1, device="cpu"))
        ids = batch["pair_ids"]
        assert torch.equal(batch["ref_logps"], torch.cat([torch.from_numpy(values[ids, 0]),
                                                          torch.from_numpy(values[ids, 1])]))
    finally:
        ds.reference = datasets[True].reference = None


# ---------------------------------------------------------------- rules and task


def dpo_exp(*overrides: str):  # noqa: ANN201
    from mcorekit.config.experiment import load_experiment

    return load_experiment("examples/llama-tiny.yaml", ["data.kind=dpo", "data.paths=[/data/pairs.jsonl]",
                                                        "data.tokenizer=/models/tok", *overrides])


def test_rules_accept_dpo_and_refuse_what_it_does_not_do() -> None:
    from mcorekit.config.rules import Nodes, problems

    node = Nodes(transformer_engine=True, gpus=False)
    assert problems(dpo_exp(), 1, node) == []
    assert problems(dpo_exp("data.packing=true", "schedule.micro_batch_size=1"), 1, node) == []
    assert problems(dpo_exp("dpo.reference=precomputed", "dpo.beta=0.5", "dpo.sft_weight=1.0"), 1, node) == []
    assert problems(dpo_exp("data.tokenizer=null"), 1, node) == [
        "data.kind=dpo needs data.tokenizer (an HF tokenizer directory; with a chat template for chat pairs)"]
    assert "data.kind=dpo needs data.paths" in problems(dpo_exp("data.paths=[]"), 1, node)
    assert problems(dpo_exp("data.packing=true", "schedule.micro_batch_size=2"), 1, node) == [
        "data.packing puts several examples into one sequence: set schedule.micro_batch_size=1 (raise "
        "data.seq_length to put more tokens in a micro-batch)"]
    assert any("global_batch_size=8 is not divisible by micro_batch_size*DP = 3*1" in p
               for p in problems(dpo_exp("schedule.micro_batch_size=3"), 1, node))
    over = problems(dpo_exp("parallel.tp=2", "parallel.sequence_parallel=true", "optimizer.tp_comm_overlap=true"),
                    2, node)
    assert any(p.startswith("optimizer.tp_comm_overlap with data.kind=dpo") for p in over), over
    assert problems(dpo_exp("parallel.fsdp=optim"), 1, node) == [
        "data.kind=dpo with parallel.fsdp=optim is not built (the reference model would be an unsharded copy beside "
        "the sharded policy); drop parallel.fsdp"]
    from mcorekit.config.experiment import load_experiment

    assert problems(load_experiment("examples/llama-tiny.yaml", ["dpo.beta=0.2"]), 1, node) == [
        "the dpo section applies to data.kind=dpo, not data.kind=mock; remove it or set data.kind=dpo"]


def test_task_for_dpo_counts_pairs() -> None:
    from types import SimpleNamespace

    from mcorekit.train.tasks import task_for

    task = task_for(dpo_exp(), SimpleNamespace(vocab_size=256), Path("/tmp"))
    assert task.name == "dpo" and task.rows_per_sample == 2 and task.metrics == METRICS
    task = task_for(dpo_exp("data.packing=true", "schedule.micro_batch_size=1", "dpo.sft_weight=0.5"),
                    SimpleNamespace(vocab_size=256), Path("/tmp"))
    assert task.rows_per_sample == 1 and task.metrics == (*METRICS, "nll_loss")


def test_metric_names_with_a_slash_reach_jsonl_and_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mcorekit.train.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, tensorboard=True, enabled=True)
    w.write(1, 2, {"step": 1, "loss": 0.69, "rewards/accuracies": 0.75, "logps/chosen": -12.5})
    w.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["rewards/accuracies"] == 0.75
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"loss", "rewards/accuracies", "logps/chosen"} <= set(acc.Tags()["scalars"])
    assert acc.Scalars("logps/chosen")[0].value == -12.5


def test_stored_log_probs_follow_the_checkpoint_and_the_tokens(tmp_path: Path, tok: Path,
                                                                          pairs_file: Path,
                                                                          datasets: dict[bool, PreferenceDataset]
                                                                          ) -> None:
    """A checkpoint.load folder that gains a newer iteration gives another reference: its stored log-probs are
    computed again, not read back. checkpoint.load pinned to that iteration (train() pins it before making the
    task) names the same reference; the task resolves it once, whatever reads it (every dataset's fingerprint)."""
    from types import SimpleNamespace

    from mcorekit.train import checkpoint
    from mcorekit.train.tasks import task_for

    def task_loading(load: Path):  # noqa: ANN202
        return task_for(dpo_exp(f"data.paths=[{pairs_file}]", f"data.tokenizer={tok}", f"checkpoint.load={load}",
                                "checkpoint.finetune=true"), SimpleNamespace(vocab_size=256), tmp_path)

    base, keys = tmp_path / "base", []
    for step in (10, 20):
        checkpoint.iter_dir(base, step).mkdir(parents=True)
        (checkpoint.iter_dir(base, step) / "metadata.json").write_text("{}")
        (base / checkpoint.TRACKER).write_text(str(step))
        task = task_loading(base)
        keys.append(task._fingerprint("train", datasets[False]))
        assert task.start == checkpoint.iter_dir(base, step)
        pinned = task_loading(checkpoint.iter_dir(base, step))
        assert pinned.start == checkpoint.iter_dir(base, step)
        assert pinned._fingerprint("train", datasets[False]) == keys[-1]
    assert keys[0] != keys[1]
    shifted = PreferenceDataset([str(pairs_file)], str(tok), 64, seed=3, packing=False, vocab_size=256)
    shifted.pairs[0] = (shifted.pairs[0][1], shifted.pairs[0][0])  # other tokens from the same files and tokenizer
    assert task._fingerprint("train", shifted) != keys[1]

    calls = []
    on_disk = checkpoint._start_on_disk  # what start_of asks rank 0 (collective: every rank at the same point)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "_start_on_disk", lambda root: calls.append(root) or on_disk(root))
        task = task_loading(base)
        for _ in range(2):
            task._fingerprint("train", datasets[False])
        assert task.start == checkpoint.iter_dir(base, 20) and calls == [base]
    assert task_for(dpo_exp(), SimpleNamespace(vocab_size=256), tmp_path).start is None


def test_building_the_reference_leaves_the_policys_random_streams_as_they_were() -> None:
    """torch's generators and (tracker=True, as frozen_copy asks) Megatron-Core's CUDA RNG tracker, dropout's."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from mcorekit.train.generate import random_states_kept

    tracker = get_cuda_rng_tracker()
    before = tracker.get_states()
    policys = {"model-parallel-rng": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    tracker.set_states(dict(policys))
    try:
        torch.manual_seed(5)
        expected = torch.rand(4)
        torch.manual_seed(5)
        with random_states_kept(tracker=True):
            torch.manual_seed(123)  # frozen_copy seeds the copy as the policy was seeded
            torch.rand(100)
            tracker.set_states({"model-parallel-rng": torch.tensor([9], dtype=torch.uint8)})  # as its reseed does
        assert torch.equal(torch.rand(4), expected)
        assert {k: v.tolist() for k, v in tracker.get_states().items()} == {"model-parallel-rng": [1, 2, 3]}
    finally:
        tracker.set_states(before)
