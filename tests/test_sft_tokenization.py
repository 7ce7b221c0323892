"""How SFT and DPO text becomes tokens, with real tokenizers built offline: a Llama-style one whose defaults put a
BOS before a text (a post-processor, as Llama 3's tokenizer.json has), one that also appends an EOS, and a
Qwen2-style one that adds nothing. Plain prompt/response data starts with exactly what the defaults put before a
text, once per example; chat data holds what its template puts. A chat template whose generation prompt is not
where its rendered assistant turn starts (DeepSeek-R1 distills: '<think>\\n' in the generation prompt only) is
refused for SFT and DPO alike, instead of a loss mask shifted into the response."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import transformers

from hf_models import WORDS
from mcorekit.errors import ConfigError
from mcorekit.train.data.preference import PreferenceDataset, fit_pair, tokenize_preference
from mcorekit.train.data.sft import SFTDataset, tokenize_record
from mcorekit.train.data.tokenizer import bos_ids

SPECIALS = ["<unk>", "<pad>", "<eos>", "<s>", "<|user|>", "<|assistant|>", "<|end|>", "<think>", "</think>"]
V = {w: i for i, w in enumerate(SPECIALS + sorted(set(WORDS)))}  # the tokenizers' vocabulary: expected ids
BOS, EOS = V["<s>"], V["<eos>"]
TEMPLATE = ("{{ bos_token or '' }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
# DeepSeek-R1-Distill's shape: the generation prompt opens a think block that the rendered assistant turn lacks
R1_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} "
               "{% else %}<|assistant|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|> <think> {% endif %}")
# the same generation prompt, kept at the start of every rendered assistant turn: the response is what follows it
THINK_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} "
                  "{% else %}<|assistant|> <think> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|> <think> {% endif %}")


def build_tokenizer(out: Path, post: str | None, template: str = TEMPLATE) -> Path:
    """A word-level fast tokenizer; `post` is its post-processor's template ("<s> $A": Llama's BOS), None for none
    (Qwen2: nothing added)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(V, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if post:
        tok.post_processor = processors.TemplateProcessing(single=post, special_tokens=[("<s>", BOS), ("<eos>", EOS)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="<eos>", bos_token="<s>" if post else None,
                                                additional_special_tokens=SPECIALS[4:])
    fast.chat_template = template
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("toks")
    return {"llama": build_tokenizer(root / "llama", "<s> $A"),
            "bos_eos": build_tokenizer(root / "bos_eos", "<s> $A <eos>"),
            "qwen": build_tokenizer(root / "qwen", None),
            "r1": build_tokenizer(root / "r1", None, R1_TEMPLATE),
            "r1_llama": build_tokenizer(root / "r1_llama", "<s> $A", R1_TEMPLATE),
            "think": build_tokenizer(root / "think", None, THINK_TEMPLATE)}


def load(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(path)


def ids(text: str) -> list[int]:
    return [V[w] for w in text.split()]


# ---------------------------------------------------------------- BOS: what the tokenizer's defaults put before a text


def test_the_tokenizers_add_what_their_kind_adds(toks: dict[str, Path]) -> None:
    assert load(toks["llama"])("hello there").input_ids == [BOS, *ids("hello there")]
    assert load(toks["bos_eos"])("hello there").input_ids == [BOS, *ids("hello there"), EOS]
    assert load(toks["qwen"])("hello there").input_ids == ids("hello there")
    # what goes before a text, never the eos after it; a bos_token the defaults do not add is not added either
    assert [bos_ids(load(toks[k])) for k in ("llama", "bos_eos", "qwen")] == [[BOS], [BOS], []]


@pytest.mark.parametrize("kind,lead", [("llama", [BOS]), ("bos_eos", [BOS]), ("qwen", [])])
def test_sft_prompt_response_starts_with_the_tokenizers_bos_once(toks: dict[str, Path], kind: str,
                                                                 lead: list[int]) -> None:
    t = load(toks[kind])
    ex = tokenize_record(t, {"prompt": "hello what is it", "response": "it is a question"}, "x:1", bos_ids(t))
    # the BOS once before the prompt, never before the response; one eos at the end (not the tokenizer's own too)
    assert ex.ids == lead + ids("hello what is it") + ids("it is a question") + [EOS]
    assert ex.mask == [0] * (len(lead) + 4) + [1] * 5
    ex = tokenize_record(t, {"instruction": "hello", "input": "what is it", "output": "yes"}, "x:2", bos_ids(t))
    assert ex.ids == lead + ids("hello what is it yes") + [EOS] and ex.mask == [0] * (len(lead) + 4) + [1, 1]


@pytest.mark.parametrize("kind,lead", [("llama", [BOS]), ("bos_eos", [BOS]), ("qwen", [])])
def test_dpo_plain_prompt_starts_with_the_tokenizers_bos_once(toks: dict[str, Path], kind: str,
                                                              lead: list[int]) -> None:
    t = load(toks[kind])
    record = {"prompt": "hello what is it", "chosen": "it is a question", "rejected": "no"}
    prompt, chosen, rejected = tokenize_preference(t, record, "x:1", bos_ids(t))
    assert prompt == lead + ids("hello what is it")
    assert chosen == ids("it is a question") + [EOS] and rejected == [V["no"], EOS]


@pytest.mark.parametrize("kind,lead", [("llama", [BOS]), ("bos_eos", [BOS]), ("qwen", [])])
def test_grpo_plain_prompt_starts_with_the_tokenizers_bos_once(tmp_path: Path, toks: dict[str, Path], kind: str,
                                                               lead: list[int]) -> None:
    """A model SFT'd with the BOS is prompted with it in GRPO's rollouts too; a chat prompt holds its template's."""
    from mcorekit.train.tasks.grpo import PromptDataset

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hello what is it", "answer": "1"}) + "\n"
                                      + json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    t = load(toks[kind])
    data = PromptDataset([str(tmp_path / "p.jsonl")], t, seq_length=32, max_new_tokens=4, seed=0)
    assert data.prompts[0].ids == lead + ids("hello what is it")
    chat = t.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert data.prompts[1].ids == t(chat, add_special_tokens=False).input_ids


def test_chat_data_holds_what_the_template_puts_and_no_second_bos(toks: dict[str, Path]) -> None:
    t = load(toks["llama"])
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]
    ex = tokenize_record(t, {"messages": messages}, "x:1", bos_ids(t))
    assert ex.ids == [BOS, *ids("<|user|> hello <|end|> <|assistant|> yes <|end|>")]
    assert ex.mask == [0, 0, 0, 0, 0, 1, 1]
    record = {"prompt": messages[:1], "chosen": "yes", "rejected": "no"}
    prompt, chosen, _ = tokenize_preference(t, record, "x:1", bos_ids(t))
    assert prompt == [BOS, *ids("<|user|> hello <|end|> <|assistant|>")] and chosen == ids("yes <|end|>")


def test_dpo_truncation_keeps_the_bos_and_cuts_the_prompt_after_it(tmp_path: Path, toks: dict[str, Path]) -> None:
    prompt, chosen, rejected = [BOS] + list(range(10, 30)), [5, 6, 7], [8, 9]
    c, r = fit_pair(prompt, chosen, rejected, seq_length=12, packing=False, keep_first=1)
    assert c.ids == [BOS] + prompt[-9:] + chosen and r.ids == [BOS] + prompt[-9:] + rejected
    assert c.mask == [0] * 10 + [1] * 3
    c, r = fit_pair(prompt, chosen, rejected, seq_length=12, packing=True, keep_first=1)
    assert c.ids == [BOS] + prompt[-3:] + chosen and c.positions + r.positions <= 12
    # room for the BOS alone is no room: the pair is left out rather than trained on a prompt of only the BOS
    assert fit_pair(prompt, list(range(12)), rejected, seq_length=12, packing=False, keep_first=1) is None
    assert fit_pair([BOS], chosen, rejected, seq_length=12, packing=False, keep_first=1)[0].ids == [BOS] + chosen

    long = " ".join(["the"] * 30)
    lines = [{"prompt": long, "chosen": "yes", "rejected": "no"},
             {"prompt": [{"role": "user", "content": long}], "chosen": "yes", "rejected": "no"}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ds = PreferenceDataset([str(tmp_path / "t.jsonl")], str(toks["llama"]), 16, seed=0, packing=False, vocab_size=256)
    # 17 tokens per sequence: the BOS, the last 14 prompt tokens, the response and its end; the BOS a chat template
    # puts is kept the same way
    assert ds.pairs[0][0].ids == [BOS] + [V["the"]] * 14 + [V["yes"], EOS] and ds.truncated == 2
    assert ds.pairs[1][0].ids == [BOS] + [V["the"]] * 12 + ids("<|end|> <|assistant|> yes <|end|>")


def test_sft_dataset_packs_each_example_with_its_bos(tmp_path: Path, toks: dict[str, Path]) -> None:
    lines = [{"prompt": "hello", "response": "yes"}, {"prompt": "what is it", "response": "a question"}]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ds = SFTDataset([str(tmp_path / "s.jsonl")], str(toks["llama"]), 16, seed=0, packing=True, vocab_size=256)
    assert sorted(e.ids for e in ds.examples) == sorted([[BOS, *ids("hello yes"), EOS],
                                                          [BOS, *ids("what is it a question"), EOS]])
    s = ds[0]
    starts = s["cu_seqlens"].tolist()[:2]  # both examples in one row, each starting with its BOS
    assert [s["tokens"][a].item() for a in starts] == [BOS, BOS]


# ---------------------------------------------------------------- the chat template's generation prompt


def test_sft_refuses_a_generation_prompt_that_does_not_start_the_assistant_turn(tmp_path: Path,
                                                                                toks: dict[str, Path]) -> None:
    line = {"messages": [{"role": "user", "content": "hello there"},
                         {"role": "assistant", "content": "the man is on the way"}]}
    lines = [{"prompt": "hello", "response": "yes"}, line]
    (tmp_path / "r1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for kind in ("r1", "r1_llama"):
        with pytest.raises(ConfigError) as e:
            SFTDataset([str(tmp_path / "r1.jsonl")], str(toks[kind]), 64, 0, False, 256)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{tmp_path / 'r1.jsonl'}:2: ")
        assert "generation prompt" in msg and "'<think>" in msg and "'the man" in msg, msg


def test_dpo_refuses_the_same_template_with_the_same_words(toks: dict[str, Path]) -> None:
    t = load(toks["r1"])
    record = {"prompt": [{"role": "user", "content": "hello there"}], "chosen": "the man", "rejected": "no"}
    with pytest.raises(ConfigError) as dpo:
        tokenize_preference(t, record, "p.jsonl:3", [])
    with pytest.raises(ConfigError) as sft:
        tokenize_record(t, {"messages": [*record["prompt"], {"role": "assistant", "content": "the man"}]}, "p.jsonl:3",
                        [])
    assert str(dpo.value) == str(sft.value) and "\n" not in str(dpo.value)


def test_a_generation_prompt_kept_in_the_assistant_turn_is_not_learned(toks: dict[str, Path]) -> None:
    t = load(toks["think"])
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "the man"},
                {"role": "user", "content": "what"}, {"role": "assistant", "content": "yes"}]
    ex = tokenize_record(t, {"messages": messages}, "x:1", [])
    learned = [i for i, m in zip(ex.ids, ex.mask) if m]
    assert learned == ids("the man <|end|> yes <|end|>")  # '<think>' came with the prompt: not a target
    record = {"prompt": messages[:1], "chosen": "the man", "rejected": "no"}
    prompt, chosen, _ = tokenize_preference(t, record, "x:1", [])
    assert prompt == ids("<|user|> hello there <|assistant|> <think>") and chosen == ids("the man <|end|>")
