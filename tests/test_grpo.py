"""GRPO on CPU: the advantages, the clipped loss and the KL term against computations written here from the
formulas (plain Python floats), the token-mean split over micro-batches and DP ranks, reward functions loaded from
module:function and from a file with their errors reported with the prompt, the grpo rules, the prompt data (order,
resume, limits), the example's data generator and scoring, and generation itself (tests/grpo_cpu_driver.py: Megatron-
Core's static engine and the plain loop on a real tiny GPTModel, greedy, against a loop written in the driver)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcorekit.config.experiment import Experiment
from mcorekit.config.rules import Nodes, problems
from mcorekit.errors import ConfigError
from mcorekit.train.rewards import RewardError, Rewards, exact_match, format_match, last_number, load_function, math_answer
from mcorekit.train.tasks.grpo import PromptDataset, group_advantages, grpo_loss, k3_kl, rollout_row
from single_rank import single_rank_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NODE = Nodes(transformer_engine=True, gpus=False)


# ---------------------------------------------------------------- the math, against the formulas


def advantages_by_hand(rewards: list[float], g: int, scale: bool = True, eps: float = 1e-4) -> list[float]:
    out = []
    for k in range(0, len(rewards), g):
        group = rewards[k:k + g]
        mean = sum(group) / g
        if all(r == group[0] for r in group):
            out += [0.0] * g
            continue
        std = statistics.stdev(group)  # unbiased, n - 1
        out += [(r - mean) / (std + eps) if scale else r - mean for r in group]
    return out


def test_group_advantages_equal_the_formula() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.25, 0.25, 0.0, 1.1, 1.1, 1.1, 1.1, 0.3, 0.3, 0.3, 0.9]
    got = group_advantages(torch.tensor(rewards), 4)
    want = advantages_by_hand(rewards, 4)
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert got[8:12].tolist() == [0.0, 0.0, 0.0, 0.0]  # all equal (1.1 is not exact in binary): exactly 0, no NaN
    assert abs(got[:4].sum()) < 1e-6 and got[0] > 0 > got[1]
    unscaled = group_advantages(torch.tensor(rewards), 4, scale=False)
    assert unscaled.tolist() == pytest.approx(advantages_by_hand(rewards, 4, scale=False), abs=1e-6)
    assert group_advantages(torch.tensor(rewards).reshape(2, 8), 8).shape == (2, 8)


def loss_by_hand(logp: list[list[float]], old: list[list[float]], ref: list[list[float]] | None, adv: list[float],
                 mask: list[list[int]], lo: float, hi: float, beta: float, aggregation: str) -> tuple[float, float, float]:
    """(loss, kl, clip fraction) from the definitions, one token at a time."""
    rows, tok_loss, kl_sum, clipped, count = [], [], 0.0, 0, 0
    for i in range(len(logp)):
        row = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            l = -min(ratio * adv[i], min(max(ratio, 1 - lo), 1 + hi) * adv[i])
            kl = 0.0
            if ref is not None:
                d = ref[i][t] - logp[i][t]
                kl = math.exp(d) - d - 1
            row.append(l + beta * kl)
            kl_sum += kl
            clipped += (ratio < 1 - lo and adv[i] < 0) or (ratio > 1 + hi and adv[i] > 0)
            count += 1
        rows.append(row)
        tok_loss += row
    if aggregation == "token":
        loss = sum(tok_loss) / count
    else:
        loss = sum(sum(r) / len(r) for r in rows) / len(rows)
    return loss, kl_sum / count, clipped / count


LOGP = [[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.7, -1.5, -0.1], [-2.2, -0.3, -0.9, -1.1]]
OLD = [[-1.3, -1.9, -0.2, -3.0], [-0.2, -1.2, -1.0, -0.4], [-2.0, -0.6, -0.9, -1.6]]
REF = [[-1.1, -2.5, -0.4, -2.0], [-0.3, -0.6, -1.4, -0.2], [-2.4, -0.1, -1.0, -1.0]]
MASK = [[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 0]]
ADV = [1.2, -0.8, 0.4]


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("beta,lo,hi", [(0.0, 0.2, 0.2), (0.05, 0.2, 0.28), (0.5, 0.1, 0.3)])
def test_clipped_loss_and_kl_equal_the_formulas(aggregation: str, beta: float, lo: float, hi: float) -> None:
    t = torch.tensor
    loss, m = grpo_loss(t(LOGP), t(OLD), t(ADV), t(MASK), lo, hi, t(REF) if beta else None, beta, aggregation)
    want, kl, clip = loss_by_hand(LOGP, OLD, REF if beta else None, ADV, MASK, lo, hi, beta, aggregation)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["kl"].item() == pytest.approx(kl, rel=1e-6, abs=1e-9)
    assert m["clip_fraction"].item() == pytest.approx(clip)
    assert 0 < clip < 1  # the fixture has tokens clipped on both sides and unclipped ones


def test_gradient_at_ratio_one_is_the_policy_gradient() -> None:
    """old = logp detached (one optimizer step per generation batch): d loss / d logp = -A / tokens on masked
    tokens (token mean), plus beta * (1 - exp(ref - logp)) / tokens from the k3 term."""
    logp = torch.tensor(LOGP, requires_grad=True)
    loss, m = grpo_loss(logp, logp.detach(), torch.tensor(ADV), torch.tensor(MASK), 0.2, 0.2, torch.tensor(REF), 0.1)
    loss.backward()
    n = sum(map(sum, MASK))
    for i in range(3):
        for j in range(4):
            want = MASK[i][j] * (-ADV[i] + 0.1 * (1 - math.exp(REF[i][j] - LOGP[i][j]))) / n
            assert logp.grad[i, j].item() == pytest.approx(want, abs=1e-6)
    assert m["clip_fraction"].item() == 0.0


def test_k3_is_nonnegative_and_zero_at_equality() -> None:
    a = torch.tensor([-1.0, -2.0, -0.1])
    assert k3_kl(a, a).tolist() == [0.0, 0.0, 0.0]
    b = torch.tensor([-1.5, -1.0, -3.0])
    assert all(v > 0 for v in k3_kl(a, b).tolist())
    assert k3_kl(a, b)[0].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


def test_token_mean_over_micro_batches_and_ranks_is_the_global_token_mean() -> None:
    """The task divides each micro-batch's masked sum by total/(micro-batches x DP): the schedule's mean over
    micro-batches and DDP's mean over ranks then give the mean over every completion token of the step."""
    t = torch.tensor
    whole, _ = grpo_loss(t(LOGP), t(OLD), t(ADV), t(MASK), 0.2, 0.2)
    total = sum(map(sum, MASK))
    parts = []  # 3 rows as 3 micro-batches of 1 over (pretend) 1 rank, then as 1 + 2 micro-batches on 2 ranks... 3 x 1
    for i in range(3):
        loss, _ = grpo_loss(t(LOGP[i:i + 1]), t(OLD[i:i + 1]), t(ADV[i:i + 1]), t(MASK[i:i + 1]), 0.2, 0.2,
                            token_total=total / 3)
        parts.append(loss.item())
    assert sum(parts) / 3 == pytest.approx(whole.item(), rel=1e-6)


def test_rollout_row_masks_exactly_the_completion() -> None:
    row = rollout_row([5, 6, 7], [8, 9, 2], seq_length=8, pad_id=1)
    assert row["tokens"].tolist() == [5, 6, 7, 8, 9, 1, 1, 1]
    assert row["labels"].tolist() == [6, 7, 8, 9, 2, 1, 1, 1]
    assert row["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]  # the labels 8, 9 and eos
    assert row["position_ids"].tolist()[:5] == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------- rewards


def test_provided_rewards() -> None:
    assert last_number("so 12 + 30 = 1,234.") == 1234.0 and last_number("none") is None
    assert math_answer("1+2=", "3", answer=3) == 1.0
    assert math_answer("1+2=", "the answer is 1,234", answer="1234") == 1.0
    assert math_answer("1+2=", "4 then 3.0", answer=3) == 1.0 and math_answer("1+2=", "3 then 4", answer=3) == 0.0
    assert math_answer("1+2=", "", answer=3) == 0.0
    assert format_match("p", " 123 ", pattern=r"\d+") == 1.0 and format_match("p", "12a", pattern=r"\d+") == 0.0
    assert exact_match("p", " yes\n", answer="yes") == 1.0 and exact_match("p", "yes.", answer="yes") == 0.0


def test_rewards_load_from_a_module_and_a_file_and_add_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine.py").write_text("def longer(prompt, completion, bonus=0.0, **fields):\n"
                                      "    return len(completion) / 10 + bonus\n")
    monkeypatch.chdir(tmp_path)
    r = Rewards([("mcorekit.train.rewards:math_answer", 1.0, {}), ("mine.py:longer", 0.5, {"bonus": 1.0})])
    total, parts = r.score("1+2=", "3", {"answer": 3})
    assert parts == [1.0, 1.1] and total == pytest.approx(1.0 + 0.5 * 1.1)
    assert r.names == ["math_answer", "longer"]
    assert load_function(str(tmp_path / "mine.py") + ":longer") is load_function("mine.py:longer")  # one module


@pytest.mark.parametrize("spec,needle", [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
    ("mcorekit.train.rewards:nope", "has no attribute 'nope'"),
    ("mcorekit.train.rewards:NUMBER", "is a Pattern, not a function"),
    ("missing/file.py:f", "file not found: missing/file.py"),
])
def test_reward_loading_errors_are_one_line(spec: str, needle: str) -> None:
    with pytest.raises(RewardError) as e:
        load_function(spec)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_failing_reward_is_reported_with_its_function_and_prompt(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("def boom(prompt, completion, **f):\n    return 1 / 0\n"
                                     "def nan(prompt, completion, **f):\n    return float('nan')\n"
                                     "def text(prompt, completion, **f):\n    return 'yes'\n"
                                     "def huge(prompt, completion, **f):\n    return 10**400\n"
                                     "def leave(prompt, completion, **f):\n    raise SystemExit(3)\n")
    for name, needle in (("boom", "raised ZeroDivisionError on prompt '12+30=': division by zero"),
                         ("leave", "raised SystemExit on prompt '12+30=': 3"),  # not the process's exit
                         ("nan", "returned nan on prompt '12+30='; a reward must return a finite float"),
                         ("text", "returned 'yes' on prompt '12+30='"),
                         ("huge", "returned 100000000000000000000000000000000000000000000000000000000... on prompt")):
        r = Rewards([(f"{tmp_path}/bad.py:{name}", 1.0, {})])
        with pytest.raises(RewardError) as e:
            r.score("12+30=", "42", {})
        assert f"reward {tmp_path}/bad.py:{name} " in str(e.value) and needle in str(e.value)
    with pytest.raises(RewardError, match=r"reward mcorekit.train.rewards:math_answer raised ValueError on prompt "
                                          r"'1\+1=': math_answer needs an 'answer' field"):
        Rewards([("mcorekit.train.rewards:math_answer", 1.0, {})]).score("1+1=", "2", {})


def test_a_reward_file_that_fails_to_import_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import no_such_dependency_abc\n")
    with pytest.raises(RewardError, match="broken.py failed to import: ModuleNotFoundError"):
        load_function(f"{tmp_path}/broken.py:f")


# ---------------------------------------------------------------- the experiment and its rules


def grpo_exp(**over: object) -> Experiment:
    cfg = {"name": "g", "model": {"preset": "llama-tiny"},
           "data": {"kind": "grpo", "paths": ["p.jsonl"], "tokenizer": "tok", "seq_length": 64},
           "grpo": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 16,
                    "rewards": [{"function": "mcorekit.train.rewards:math_answer"}]},
           "schedule": {"global_batch_size": 16, "micro_batch_size": 4, "train_iters": 10, "warmup_iters": 0}}
    for key, value in over.items():
        section, field = key.split("__")
        cfg.setdefault(section, {})[field] = value
    return Experiment.model_validate(cfg)


def test_a_sound_grpo_experiment_has_no_problems() -> None:
    assert problems(grpo_exp(), 1, NODE) == []
    assert problems(grpo_exp(), 2, NODE) == []  # 2 prompts per DP rank, 8 rollouts = 2 micro-batches of 4


def test_grpo_rules() -> None:
    assert problems(grpo_exp(schedule__global_batch_size=8), 1, NODE) == [
        "schedule.global_batch_size=8 must equal grpo.prompts_per_step x grpo.group_size = 4 x 4 = 16 (one "
        "optimizer step per generation batch); set schedule.global_batch_size=16"]
    assert problems(grpo_exp(grpo__prompts_per_step=3, schedule__global_batch_size=12, schedule__micro_batch_size=2),
                    2, NODE) == [
        "grpo.prompts_per_step=3 is not divisible by the data-parallel size 2: each data-parallel rank generates "
        "whole groups; use a multiple of 2"]
    assert problems(grpo_exp(grpo__max_new_tokens=64), 1, NODE) == [
        "grpo.max_new_tokens=64 leaves no room for the prompt in data.seq_length=64 (a rollout, prompt and "
        "completion, is one training sequence)"]
    assert "at least one grpo.rewards entry" in " ".join(problems(grpo_exp(grpo__rewards=[]), 1, NODE))
    assert "data.kind=grpo needs data.tokenizer" in " ".join(problems(grpo_exp(data__tokenizer=None), 1, NODE))
    assert any("parallel.cp > 1 is not built" in p for p in problems(grpo_exp(parallel__cp=2), 2, NODE))
    assert any("parallel.vpp is not built" in p for p in problems(grpo_exp(parallel__pp=2, parallel__vpp=2), 2, NODE))
    assert any("no validation loss" in p for p in problems(grpo_exp(schedule__eval_interval=5), 1, NODE))
    assert any("data.packing applies to" in p for p in problems(grpo_exp(data__packing=True, schedule__micro_batch_size=1,
                                                                           ), 1, NODE))
    other = Experiment.model_validate({"name": "x", "model": {"preset": "llama-tiny"}, "grpo": {"group_size": 4}})
    assert problems(other, 1, NODE) == [
        "the grpo section applies to data.kind=grpo, not data.kind=mock; remove it or set data.kind=grpo"]


@pytest.mark.parametrize("bad,needle", [
    ({"group_size": 1}, "grpo.group_size: Input should be greater than or equal to 2"),
    ({"top_p": 1.5}, "grpo.top_p: Input should be less than or equal to 1"),
    ({"clip_low": 1.0}, "grpo.clip_low: Input should be less than 1"),
    ({"rewards": [{"function": "no_colon"}]}, "must be 'module:function' or 'path/to/file.py:function'"),
    ({"generation": "vllm"}, "grpo.generation: Input should be 'auto', 'dynamic', 'static' or 'plain'"),
    ({"gruop_size": 4}, "unknown key 'grpo.gruop_size'; did you mean 'group_size'?"),
])
def test_bad_grpo_values_are_one_line(tmp_path: Path, bad: dict, needle: str) -> None:
    import yaml

    from mcorekit.config.experiment import load_experiment

    (tmp_path / "e.yaml").write_text(yaml.safe_dump({"name": "e", "data": {"kind": "grpo"}, "grpo": bad}))
    with pytest.raises(ConfigError) as e:
        load_experiment(tmp_path / "e.yaml")
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- the example: data, tokenizer, prompts, scoring


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("grpo") / "data"
    r = subprocess.run([sys.executable, str(REPO / "examples/grpo/make_data.py"), "--out", str(out), "--sft", "300",
                        "--train", "200", "--heldout", "100"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_example_data_is_correct_and_held_out_is_disjoint(example: Path) -> None:
    sys.path.insert(0, str(REPO / "examples/grpo"))
    try:
        from make_data import score
    finally:
        sys.path.pop(0)
    sft, train, held = read(example / "sft.jsonl"), read(example / "train.jsonl"), read(example / "heldout.jsonl")
    assert (len(sft), len(train), len(held)) == (300, 200, 100)
    def written(n: int, width: int = 4) -> str:  # units first, fixed width: 168 -> "8610", 45 -> "540"
        return str(n).zfill(width)[::-1]

    def operands(prompt: str) -> tuple[int, int]:
        a, b = prompt.rstrip("=").split("+")
        assert len(a) == len(b) == 3
        return int(a[::-1]), int(b[::-1])

    for row in train + held:
        a, b = operands(row["prompt"])
        assert row["prompt"] == f"{written(a, 3)}+{written(b, 3)}=" and row["answer"] == written(a + b)
        assert exact_match(row["prompt"], row["answer"], answer=row["answer"]) == 1.0
        assert score(row["prompt"], row["answer"]) == 1.0 and score(row["prompt"], written(a + b + 1)) == 0.0
        assert score(row["prompt"], str(a + b)) == float(written(a + b) == str(a + b))
    carries, dropped = 0, 0  # the sloppy teacher (--sloppy 0.8): 80% of hundreds carries left out, nothing else wrong
    for r in sft:
        a, b = operands(r["prompt"])
        if a % 100 + b % 100 >= 100:
            carries += 1
            dropped += r["response"] == written(a + b - 100)
            assert r["response"] in (written(a + b), written(a + b - 100))
        else:
            assert score(r["prompt"], r["response"]) == 1.0
    assert 0.65 < dropped / carries < 0.95
    prompts = [{r["prompt"] for r in rows} for rows in (sft, train, held)]
    assert not (prompts[0] & prompts[2]) and not (prompts[1] & prompts[2]) and not (prompts[0] & prompts[1])
    assert len({len(str(operands(r["prompt"])[0])) for r in train}) == 3  # 1-, 2- and 3-digit operands


def test_example_tokenizer_is_one_token_per_character(example: Path) -> None:
    from transformers import AutoTokenizer

    from mcorekit.models.spec import from_hf_config, load_hf_config

    tok = AutoTokenizer.from_pretrained(example / "model")
    ids = tok("907+15=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 7 and tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "907+15="
    spec = from_hf_config(load_hf_config(str(example / "model")))
    assert spec.vocab_size == len(tok) == 15 and spec.num_layers == 4


def test_prompt_dataset_order_resumes_and_splits_over_ranks(example: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(example / "model")
    data = PromptDataset([str(example / "train.jsonl")], tok, seq_length=16, max_new_tokens=6, seed=3)
    assert len(data) == 200 and data.prompts[0].fields == {"answer": read(example / "train.jsonl")[0]["answer"]}
    one = [data.step_prompts(s, 8, 0, 1) for s in range(60)]  # 480 samples: over two epochs
    assert sorted(i for s in one[:25] for i in s) == list(range(200))  # epoch 0 is a permutation
    again = PromptDataset([str(example / "train.jsonl")], tok, 16, 6, seed=3)
    assert [again.step_prompts(s, 8, 0, 1) for s in (40, 41)] == one[40:42]  # a resumed run continues the order
    two = [data.step_prompts(7, 8, r, 2) for r in (0, 1)]
    assert two[0] + two[1] == one[7] and len(two[0]) == 4  # DP ranks split a step's prompts
    with pytest.raises(ConfigError, match=r"train.jsonl:1: a prompt of \d tokens plus grpo.max_new_tokens=12 does "
                                          r"not fit data.seq_length=16"):
        PromptDataset([str(example / "train.jsonl")], tok, 16, 12, 3)
    (example / "bad.jsonl").write_text('{"question": "1+1="}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: expected a 'prompt' string or 'messages'"):
        PromptDataset([str(example / "bad.jsonl")], tok, 16, 6, 3)
    (example / "bad.jsonl").write_text('{"prompt": "1+1=\\ud800"}\n')  # the tokenizer's TypeError before
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: holds a lone UTF-16 surrogate"):
        PromptDataset([str(example / "bad.jsonl")], tok, 16, 6, 3)


def test_example_experiments_pass_the_rules(example: Path) -> None:
    from mcorekit.config.experiment import load_experiment

    data = str(example)
    sft = load_experiment(REPO / "examples/grpo/sft.yaml", [f"model.hf_config={data}/model", f"data.tokenizer={data}/model",
                                                            f"data.paths=[{data}/sft.jsonl]"])
    grpo = load_experiment(REPO / "examples/grpo/grpo.yaml", [f"model.hf_config={data}/model",
                                                              f"data.tokenizer={data}/model", f"data.paths=[{data}/train.jsonl]"])
    assert problems(sft, 1, NODE) == [] and problems(grpo, 1, NODE) == []
    from test_gpu_grpo import LAYOUT_RUN, RESUME_RUN  # the GPU test's short runs of the same experiment

    for short in (RESUME_RUN, LAYOUT_RUN):
        base = [f"model.hf_config={data}/model", f"data.tokenizer={data}/model", f"data.paths=[{data}/train.jsonl]"]
        assert problems(load_experiment(REPO / "examples/grpo/grpo.yaml", [*base, *short]), 1, NODE) == [], short
    assert grpo.schedule.global_batch_size == grpo.grpo.prompts_per_step * grpo.grpo.group_size
    assert load_function("examples/grpo/rewards.py:digits_only") if Path.cwd() == REPO else True
    assert load_function(f"{REPO}/examples/grpo/rewards.py:digits_only")("1+2=", " 3 ") == 1.0
    partial = load_function(f"{REPO}/examples/grpo/rewards.py:digits_correct")
    # position by position from the first character (units first): "4321" is 1234 written as the example writes it
    assert [partial("", c, answer="4321") for c in ("4321", "5321", "432", "43219", "43x1", "")] == [1.0, 0.75, 0.75,
                                                                                                    0.8, 0.0, 0.0]


# ---------------------------------------------------------------- generation on a real (tiny, CPU) Megatron model


@pytest.fixture(scope="module")
def driver(example: Path) -> dict:
    port = single_rank_env()["MASTER_PORT"]  # a free one: test_fsdp's driver may hold another at the same time
    r = subprocess.run([sys.executable, str(HERE / "grpo_cpu_driver.py"), str(example)], capture_output=True,
                       text=True, cwd=HERE, timeout=600, env={**os.environ, "GRPO_PORT": port})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("GEN "))[4:])


def test_generation_backends_give_the_greedy_completions(driver: dict) -> None:
    """Megatron-Core's static engine (KV cache) and the plain loop (no cache) both reproduce a greedy loop written
    in the driver, eos included where the model stopped; a seed fixes sampled completions; train mode comes back."""
    out = driver
    assert out["plain"] == out["manual"] and out["static"] == out["manual"]
    assert any(c[-1] == 27 for c in out["manual"]) and any(len(c) == 8 and c[-1] != 27 for c in out["manual"])
    assert out["plain_finished"] == out["static_finished"] == [c[-1] == 27 for c in out["manual"]]
    a, b, c = out["sampled"]
    assert a == b and a != c and all(t < out["vocab"] for row in a + c for t in row)
    assert out["training_after"] is True
    assert out["rope_cached_after_generate"] == 0  # no inference-mode RoPE table left for a training forward


def test_engine_samples_follow_the_training_distribution(driver: dict) -> None:
    """GRPO's log-probs come from the training forward at temperature 1: the static engine's samples must follow
    that distribution (20000 draws of one next token over 37: a total variation distance of ~0.02 is sampling
    noise), and not, say, the distribution at temperature 0.7 (what a misapplied temperature would give)."""
    got = driver["on_policy"]
    assert got["outside_vocab"] == 0.0 and got["max_p"] < 0.95  # a distribution with some spread to compare
    assert got["tv_distance"] < 0.035 and got["tv_to_tempered"] > 0.07, got


def test_one_grpo_step_builds_what_the_formulas_say(driver: dict, example: Path) -> None:
    """train/tasks/grpo.py's prepare_step and forward_step on the example's model: step 2's prompts in the dataset's
    order, rollouts as rows with the loss mask on exactly the completion, rewards and advantages recomputed here from
    the decoded completions, step metrics, a finite loss with a gradient."""
    from transformers import AutoTokenizer

    task, g = driver["task"], 4
    tok = AutoTokenizer.from_pretrained(example / "model")
    data = PromptDataset([str(example / "train.jsonl")], tok, 16, 6, seed=1234)  # data.seed's default
    assert task["step"] == 2 and task["prompts"] == [data.prompts[i].text for i in data.step_prompts(2, 3, 0, 1)]
    rows = task["rows"]
    assert len(rows) == 12
    rewards = []
    for i, row in enumerate(rows):
        prompt = tok(task["prompts"][i // g], add_special_tokens=False)["input_ids"]
        completion = row["completion"]
        assert row["tokens"][:len(prompt)] == prompt
        assert row["tokens"][len(prompt):len(prompt) + len(completion) - 1] == completion[:-1]
        assert 1 <= len(completion) <= 6 and (completion[-1] == tok.eos_token_id or len(completion) == 6)
        text = tok.decode([t for t in completion if t != tok.eos_token_id], skip_special_tokens=True)
        digits = float(bool(text.strip()) and text.strip().isdigit())
        rewards.append(math_answer("", text, answer=task["answers"][i // g]) + 0.5 * digits)
    want = advantages_by_hand(rewards, g)
    assert [r["advantage"] for r in rows] == pytest.approx(want, abs=1e-5)
    lengths = [len(r["completion"]) for r in rows]
    assert task["token_total"] == pytest.approx(sum(lengths) / 3)  # 3 micro-batches on 1 rank
    for m in task["metrics"]:
        assert m["reward_mean"] == pytest.approx(sum(rewards) / 12, abs=1e-6)
        assert m["reward_std"] == pytest.approx(statistics.stdev(rewards), abs=1e-5)
        assert m["response_length"] == pytest.approx(sum(lengths) / 12)
        assert m["groups_all_equal"] == pytest.approx(sum(len(set(rewards[k:k + g])) == 1 for k in (0, 4, 8)) / 3)
        assert m["clip_fraction"] == 0.0 and m["kl"] == 0.0 and math.isfinite(m["loss"])
        assert m["gen_seconds"] > 0 and m["gen_tokens_per_s"] > 0 and m["prev_train_seconds"] == 0.0
        assert set(m) == set(task["metric_names"])
    # the micro-batch losses: -(sum of A over each row's tokens) / token_total, ratio 1
    for k, m in enumerate(task["metrics"]):
        mb = range(4 * k, 4 * k + 4)
        assert m["loss"] == pytest.approx(-sum(want[i] * lengths[i] for i in mb) / task["token_total"], abs=1e-5)
    assert any(x > 0 for x in task["grads"]) or all(a == 0 for a in want)


def test_generation_recasts_fp8_weights_after_the_update() -> None:
    """Generation calls the model outside Megatron's schedule, which is what tells FP8 layers (TE's, and the FP8
    experts) that a new step began and their cached FP8 weights are stale: generation_mode tells them itself, through
    every wrapper, and leaves the train/eval mode as it was."""
    from mcorekit.train.generate import generation_mode

    class Model(torch.nn.Module):
        told = 0

        def set_is_first_microbatch(self) -> None:
            self.told += 1

    class Wrapper(torch.nn.Module):  # DDP / Float16Module hold the model as .module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    inner = Model()
    chunk = Wrapper(Wrapper(inner))
    with generation_mode([chunk], inference=False):
        assert inner.told == 1 and not chunk.training
    assert chunk.training and inner.told == 1


def test_generation_refuses_virtual_pipeline_stages() -> None:
    """Two model chunks (VPP): every backend refuses in one line instead of failing inside Megatron's schedule."""
    from mcorekit.train.generate import choose_backend

    for asked in ("auto", "plain", "static", "dynamic"):
        with pytest.raises(ConfigError, match="generation with virtual pipeline stages is not built"):
            choose_backend([object(), object()], asked)


def test_grpos_kl_reference_is_built_from_the_trainer_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """GRPO's KL term uses DPO's Reference with a GRPO task: nothing DPO-only may be asked of the task on the way to
    the frozen copy (a `task.start` did, and every full-weight GRPO run with kl_coeff > 0 stopped at step 1)."""
    from types import SimpleNamespace

    from mcorekit.train.tasks import dpo
    from mcorekit.train.tasks.grpo import GroupRelativePolicyOptimization

    class Built(Exception):
        pass

    def frozen_copy(t: object) -> None:
        raise Built(t)

    monkeypatch.setattr(dpo, "frozen_copy", frozen_copy)
    task = object.__new__(GroupRelativePolicyOptimization)  # no tokenizer here: only what Reference reads
    task.exp = grpo_exp(grpo__kl_coeff=0.01)
    t = SimpleNamespace(exp=task.exp)
    with pytest.raises(Built) as built:
        dpo.Reference(t, task).logps([])  # type: ignore[arg-type]
    assert built.value.args == (t,)
