"""train/data on CPU: preprocessing jsonl -> .bin/.idx (both cores), Megatron's GPTDataset and blending over it,
SFT loss masks, and packing (no token crosses an example boundary). Real tokenizers (built offline) and
Megatron-Core's own dataset classes; nothing mocked."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hf_models import WORDS, make_tokenizer
from mcorekit.errors import ConfigError
from mcorekit.train.data import batches
from mcorekit.train.data.indexed import build_gpt_dataset, read_documents
from mcorekit.train.data.packing import Example, first_fit_decreasing, pack
from mcorekit.train.data.preprocess import preprocess
from mcorekit.train.data.sft import SFTDataset, tokenize_chat


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def write_corpus(path: Path, docs: int, seed: int, key: str = "text") -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(docs)]
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return texts


def test_preprocess_writes_every_document_with_eod(tmp_path: Path, tok: Path) -> None:
    from transformers import AutoTokenizer

    texts = write_corpus(tmp_path / "a.jsonl", 1300, seed=1)  # more than two worker batches
    s = preprocess([str(tmp_path / "a.jsonl")], str(tok), str(tmp_path / "out" / "a"), workers=2, quiet=True)
    t = AutoTokenizer.from_pretrained(tok)
    docs = read_documents(str(tmp_path / "out" / "a"))
    assert s.documents == len(docs) == 1300
    for text, doc in zip(texts, docs):  # input order kept across workers
        assert doc.tolist() == t(text, add_special_tokens=False)["input_ids"] + [t.eos_token_id]
    meta = json.loads((tmp_path / "out" / "a.json").read_text())
    assert meta["eod"] == t.eos_token_id and meta["vocab_size"] == len(t) and meta["tokens"] == s.tokens
    assert not list((tmp_path / "out").glob("*.tmp*"))
    # same bytes with one worker: the output does not depend on the worker count
    preprocess([str(tmp_path / "a.jsonl")], str(tok), str(tmp_path / "one"), workers=1, quiet=True)
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "out" / "a.bin").read_bytes()
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "out" / "a.idx").read_bytes()


def test_preprocess_encodes_as_transformers_with_added_tokens(tmp_path: Path, tok: Path) -> None:
    """A token added in tokenizer_config.json (added_tokens_decoder) only, not in tokenizer.json: the workers' pipeline
    is the one transformers assembled, so the data holds its id, not three <unk> pieces of '<tool>'."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(tok, tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    new_id = len(AutoTokenizer.from_pretrained(tok))
    config.setdefault("added_tokens_decoder", {})[str(new_id)] = {
        "content": "<tool>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": True}
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    text = f"{WORDS[0]} <tool> {WORDS[1]}"
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": text}) + "\n")
    for workers in (1, 2):
        out = str(tmp_path / f"out{workers}")
        preprocess([str(tmp_path / "a.jsonl")], str(tmp_path / "tok"), out, workers=workers, quiet=True)
        t = AutoTokenizer.from_pretrained(tmp_path / "tok")
        [doc] = read_documents(out)
        assert new_id in doc.tolist()
        assert doc.tolist() == t(text, add_special_tokens=False)["input_ids"] + [t.eos_token_id]
        assert json.loads(Path(out + ".json").read_text())["vocab_size"] == new_id + 1


def test_preprocess_refuses_bad_input_and_overwrite(tmp_path: Path, tok: Path) -> None:
    write_corpus(tmp_path / "a.jsonl", 5, seed=2)
    preprocess([str(tmp_path / "a.jsonl")], str(tok), str(tmp_path / "a"), workers=1, quiet=True)
    before = (tmp_path / "a.bin").read_bytes()
    with pytest.raises(ConfigError, match="output exists.*--force"):
        preprocess([str(tmp_path / "a.jsonl")], str(tok), str(tmp_path / "a"), workers=1, quiet=True)
    assert (tmp_path / "a.bin").read_bytes() == before
    (tmp_path / "bad.jsonl").write_text('{"text": "hello"}\n{"body": "no text key"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not a JSON object with a 'text' string"):
        preprocess([str(tmp_path / "bad.jsonl")], str(tok), str(tmp_path / "bad"), workers=1, quiet=True)
    assert not list(tmp_path.glob("bad.*.tmp*")) and not (tmp_path / "bad.idx").exists()
    with pytest.raises(ConfigError, match="input not found"):
        preprocess([str(tmp_path / "missing.jsonl")], str(tok), str(tmp_path / "m"), quiet=True)


def test_cli_preprocess(tmp_path: Path, tok: Path) -> None:
    import subprocess
    import sys

    write_corpus(tmp_path / "a.jsonl", 20, seed=3, key="body")
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write(json.dumps({"body": ""}) + "\n")  # a document of the eod token alone: counted, not hidden
    cmd = [sys.executable, "-m", "mcorekit.cli", "data", "preprocess", str(tmp_path / "a.jsonl"), "--tokenizer", str(tok),
           "--output-prefix", str(tmp_path / "a"), "--key", "body", "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0 and "21 documents" in r.stdout, r.stderr
    assert "; 1 of the documents empty (an eod token alone)" in r.stdout
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith("mcorekit: error: output exists"), r.stderr


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory: pytest.TempPathFactory, tok: Path) -> list[str]:
    d = tmp_path_factory.mktemp("corpora")
    prefixes = []
    for name, seed in (("web", 4), ("code", 5)):
        write_corpus(d / f"{name}.jsonl", 400, seed=seed)
        preprocess([str(d / f"{name}.jsonl")], str(tok), str(d / name), workers=2, quiet=True)
        prefixes.append(str(d / name))
    return prefixes


def pieces(window: list[int], eod: int = 2) -> list[list[int]]:
    """A sample split after each end-of-document token."""
    out, cur = [], []
    for t in window:
        cur.append(t)
        if t == eod:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def contains(docs: list[np.ndarray], piece: list[int]) -> bool:
    key = " " + " ".join(map(str, piece)) + " "
    return any(key in " " + " ".join(map(str, d.tolist())) + " " for d in docs)


def test_gpt_dataset_samples_are_windows_of_documents(two_corpora: list[str], tmp_path: Path) -> None:
    ds = build_gpt_dataset(two_corpora[:1], None, 64, 200, seed=9, cache_dir=tmp_path / "cache", tokenizer_dir=None,
                           model_vocab=256)
    docs = read_documents(two_corpora[0])
    whole = {tuple(d.tolist()) for d in docs}
    for i in (0, 1, 57, 199):
        s = ds[i]
        assert s["tokens"].shape == (64,) and torch.equal(s["tokens"][1:], s["labels"][:-1])
        assert s["loss_mask"].sum() == 64
        # 65 consecutive tokens of the (shuffled) document stream: a document's tail, whole documents, a head
        parts = pieces(s["tokens"].tolist() + [int(s["labels"][-1])])
        assert all(contains(docs, p) for p in parts)
        assert all(tuple(p) in whole for p in parts[1:-1])
    again = build_gpt_dataset(two_corpora[:1], None, 64, 200, seed=9, cache_dir=tmp_path / "cache", tokenizer_dir=None,
                              model_vocab=256)
    assert all(torch.equal(ds[i]["tokens"], again[i]["tokens"]) for i in range(20))  # same seed, same order
    other = build_gpt_dataset(two_corpora[:1], None, 64, 200, seed=10, cache_dir=tmp_path / "cache", tokenizer_dir=None,
                              model_vocab=256)
    assert not all(torch.equal(ds[i]["tokens"], other[i]["tokens"]) for i in range(20))


def test_blend_follows_weights(two_corpora: list[str], tmp_path: Path) -> None:
    ds = build_gpt_dataset(two_corpora, [3.0, 1.0], 32, 400, seed=1, cache_dir=tmp_path / "cache", tokenizer_dir=None,
                           model_vocab=256)
    web, code = read_documents(two_corpora[0]), read_documents(two_corpora[1])
    from_web = 0
    for i in range(400):
        longest = max(pieces(ds[i]["tokens"].tolist()), key=len)
        in_web, in_code = contains(web, longest), contains(code, longest)
        assert in_web or in_code
        from_web += in_web and not in_code
    assert 285 <= from_web <= 305, from_web  # 3:1 -> 300 of 400 (Megatron's blend is exact up to rounding)


def test_loader_resumes_the_exact_order(two_corpora: list[str], tmp_path: Path) -> None:
    ds = build_gpt_dataset(two_corpora, None, 32, 256, seed=1, cache_dir=tmp_path / "cache", tokenizer_dir=None,
                           model_vocab=256)
    gbs, mbs, dp = 8, 2, 2
    full = [[next(it)["tokens"] for _ in range(2 * 8 // (mbs * dp))] for it in
            (batches(ds, mbs, 0, r, dp, device="cpu") for r in range(dp))]
    resumed = [[next(it)["tokens"] for _ in range(8 // (mbs * dp))] for it in
               (batches(ds, mbs, 1 * gbs, r, dp, device="cpu") for r in range(dp))]  # resume after step 1
    for r in range(dp):
        assert all(torch.equal(a, b) for a, b in zip(full[r][2:], resumed[r]))
    seen = torch.cat([t for rank in full for t in rank[:2]])  # step 1 over both ranks: samples 0..7, once each
    assert sorted(tuple(x.tolist()) for x in seen) == sorted(tuple(ds[i]["tokens"].tolist()) for i in range(8))


def test_validation_data_is_the_held_out_corpus(two_corpora: list[str], tmp_path: Path) -> None:
    """schedule.eval_interval with data.valid_paths: the validation dataset reads only the held-out corpus, holds
    eval_iters global batches, and is the same at every validation; mock data validates on another stream."""
    from types import SimpleNamespace

    from mcorekit.config.experiment import load_experiment
    from mcorekit.train.data import build_dataset

    web, code = two_corpora
    exp = load_experiment("examples/llama-tiny.yaml", [
        "data.kind=indexed", f"data.paths=[{web}]", f"data.valid_paths=[{code}]", "data.seq_length=32",
        "schedule.eval_interval=5", "schedule.eval_iters=3", "schedule.global_batch_size=8",
        f"data.cache_dir={tmp_path / 'cache'}"])
    spec = SimpleNamespace(vocab_size=256)
    valid = build_dataset(exp, spec, tmp_path, validation=True)
    train = build_dataset(exp, spec, tmp_path)
    web_docs, code_docs = read_documents(web), read_documents(code)
    assert len(valid) >= 3 * 8
    for i in range(24):
        longest = max(pieces(valid[i]["tokens"].tolist()), key=len)
        assert contains(code_docs, longest) and not contains(web_docs, longest)
        longest = max(pieces(train[i]["tokens"].tolist()), key=len)
        assert contains(web_docs, longest) and not contains(code_docs, longest)
    again = build_dataset(exp, spec, tmp_path, validation=True)
    assert all(torch.equal(valid[i]["tokens"], again[i]["tokens"]) for i in range(24))

    mock = load_experiment("examples/llama-tiny.yaml", ["schedule.eval_interval=5"])
    a, b = build_dataset(mock, spec, tmp_path), build_dataset(mock, spec, tmp_path, validation=True)
    assert not torch.equal(a[0]["tokens"], b[0]["tokens"])


def test_indexed_errors(two_corpora: list[str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"indexed data not found: .*nope.bin"):
        build_gpt_dataset([str(tmp_path / "nope")], None, 32, 10, 1, tmp_path, None, 256)
    with pytest.raises(ConfigError, match="one positive weight per path"):
        build_gpt_dataset(two_corpora, [1.0], 32, 10, 1, tmp_path, None, 256)
    with pytest.raises(ConfigError, match="vocabulary is 100"):
        build_gpt_dataset(two_corpora, None, 32, 10, 1, tmp_path, None, 100)


def test_data_preprocessed_again_gets_new_indices(tok: Path, tmp_path: Path) -> None:
    """Megatron-Core keys its index cache on the path: the same prefix preprocessed again (20 documents, then 200)
    read through the cached indices of the first cut the new documents (an IndexError, or windows padded). The
    cache key now holds the .idx's digest: the second build samples the new data as a fresh cache would."""
    prefix, cache = str(tmp_path / "p"), tmp_path / "cache"
    for docs, seed in ((20, 1), (200, 2)):
        write_corpus(tmp_path / "c.jsonl", docs, seed=seed)
        preprocess([str(tmp_path / "c.jsonl")], str(tok), prefix, workers=1, quiet=True, force=True)
        ds = build_gpt_dataset([prefix], None, 32, 100, 1, cache, None, 256)
    fresh = build_gpt_dataset([prefix], None, 32, 100, 1, tmp_path / "fresh", None, 256)
    assert all(torch.equal(ds[i]["tokens"], fresh[i]["tokens"]) for i in range(100))
    assert len(list(cache.glob("*-description.txt"))) == 2  # one index set per content


def test_a_damaged_index_cache_is_built_again(two_corpora: list[str], tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A start killed while Megatron-Core wrote the cache leaves a file cut short, which it would find and fail on
    at every later start; one that needs unpickling is not one it wrote. Both are removed and built again."""
    cache = tmp_path / "cache"
    first = build_gpt_dataset(two_corpora[:1], None, 32, 100, 1, cache, None, 256)
    expected = [first[i]["tokens"] for i in range(100)]
    shuffle = next(cache.glob("*shuffle_index.npy"))
    shuffle.write_bytes(shuffle.read_bytes()[:100])
    document = next(cache.glob("*document_index.npy"))
    np.save(document, np.array([{"not": "an index"}], dtype=object), allow_pickle=True)
    with caplog.at_level("WARNING", logger="mcorekit.train"):
        again = build_gpt_dataset(two_corpora[:1], None, 32, 100, 1, cache, None, 256)
    assert all(torch.equal(again[i]["tokens"], expected[i]) for i in range(100))
    assert f"{shuffle}: removed from the dataset index cache" in caplog.text
    assert f"{document}: removed from the dataset index cache" in caplog.text


def test_the_index_cache_is_built_by_one_run_at_a_time(two_corpora: list[str], tmp_path: Path) -> None:
    """A shared data.cache_dir: while another run's rank 0 holds the folder (checking and building there), a start
    waits instead of taking that run's half-written files for damaged ones and removing them."""
    import fcntl
    import threading

    cache = tmp_path / "cache"
    cache.mkdir()
    built: list[Any] = []
    with open(cache / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (cache / "other-run-shuffle_index.npy").write_bytes(b"\x93NUMPY")  # being written by the holder
        waiting = threading.Thread(target=lambda: built.append(
            build_gpt_dataset(two_corpora[:1], None, 32, 100, 1, cache, None, 256)))
        waiting.start()
        waiting.join(timeout=3)
        assert waiting.is_alive() and not built  # blocked on the lock, the other run's file untouched
        assert (cache / "other-run-shuffle_index.npy").exists()
        (cache / "other-run-shuffle_index.npy").unlink()  # the holder's build ends
    waiting.join(timeout=60)
    assert len(built) == 1 and len(built[0]) >= 100


def _build_on_rank(rank: int, prefixes: list[list[str]], tmp: Path) -> None:
    """`prefixes[rank]`: each rank's paths, as each node sees its own copy of the data."""
    import torch.distributed as dist

    from mcorekit.train.data import indexed

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2)
    try:
        checked = indexed.check_index
        indexed.check_index = lambda *a: (open(tmp / f"read{rank}", "a").write("x"), checked(*a))[1]
        ds = build_gpt_dataset(prefixes[rank], None, 32, 100, 1, tmp / "cache", None, 256)
        torch.save(torch.stack([ds[i]["tokens"] for i in range(100)]), tmp / f"tokens{rank}.pt")
    except ConfigError as e:  # said, then raised: spawn ends the other rank, as srun --kill-on-bad-exit does
        (tmp / f"error{rank}").write_text(str(e))
        raise
    finally:
        dist.destroy_process_group()


def test_rank_zero_alone_reads_the_indexes_and_every_rank_gets_its_samples(two_corpora: list[str],
                                                                           tmp_path: Path) -> None:
    """Two gloo ranks: each .idx is read whole once, by rank 0 (not by every rank, from a shared file system), and
    the other rank, keyed on rank 0's digest, samples the same windows."""
    import torch.multiprocessing as mp

    mp.spawn(_build_on_rank, args=([two_corpora, two_corpora], tmp_path), nprocs=2)
    assert (tmp_path / "read0").read_text() == "xx" and not (tmp_path / "read1").exists()
    alone = build_gpt_dataset(two_corpora, None, 32, 100, 1, tmp_path / "alone", None, 256)
    expected = torch.stack([alone[i]["tokens"] for i in range(100)])
    for rank in (0, 1):
        assert torch.equal(torch.load(tmp_path / f"tokens{rank}.pt"), expected)


def test_a_rank_that_sees_other_data_than_rank_zero_stops(two_corpora: list[str], tmp_path: Path) -> None:
    """Rank 1's node holds another copy under the same place in data.paths (here: the other corpus): reading it
    through rank 0's indices would train on other documents than the index says. Its start stops, naming both."""
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessRaisedException, match="is not rank 0's"):
        mp.spawn(_build_on_rank, args=([two_corpora[:1], two_corpora[1:]], tmp_path), nprocs=2)
    idx, bin_ = (Path(two_corpora[1] + ext).stat().st_size for ext in (".idx", ".bin"))
    idx0, bin0 = (Path(two_corpora[0] + ext).stat().st_size for ext in (".idx", ".bin"))
    assert (tmp_path / "error1").read_text() == (
        f"the indexed data on {socket.gethostname()} is not rank 0's: {two_corpora[1]} (here .idx {idx:,} bytes, .bin "
        f"{bin_:,} bytes; rank 0 .idx {idx0:,} bytes, .bin {bin0:,} bytes); a node-local copy that is missing or "
        f"differs? Give every node the same files")


def test_a_token_outside_the_vocabulary_is_one_line(two_corpora: list[str], tmp_path: Path) -> None:
    """A .bin written with another tokenizer: an id past the vocabulary would train on a wrong loss (Megatron's
    cross entropy takes it) or index past the embedding. The sample holding it is refused, naming the data."""
    prefix = str(tmp_path / "web")
    for ext in (".bin", ".idx", ".json"):
        Path(prefix + ext).write_bytes(Path(two_corpora[0] + ext).read_bytes())
    tokens = np.memmap(prefix + ".bin", np.uint16, "r+")
    assert tokens.size > 200
    tokens[200] = 60000
    tokens.flush()
    ds = build_gpt_dataset([prefix], None, 32, 400, 1, tmp_path / "cache", None, 256)
    with pytest.raises(ConfigError, match=rf"sample \d+ of {prefix} holds token id 60000, outside the data's "
                                          r"vocabulary of \d+"):
        for i in range(len(ds)):
            ds[i]


# ---------------------------------------------------------------- SFT and packing


def test_chat_loss_mask_covers_assistant_turns_only(tok: Path) -> None:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    ex = tokenize_chat(t, [{"role": "system", "content": "you are good"}, {"role": "user", "content": "hello what is it"},
                           {"role": "assistant", "content": "it is a question"}, {"role": "user", "content": "yes"},
                           {"role": "assistant", "content": "no"}])
    learned = [w for w, m in zip(t.convert_ids_to_tokens(ex.ids), ex.mask) if m]
    assert learned == ["it", "is", "a", "question", "<|end|>", "no", "<|end|>"]


def test_a_conversation_opening_with_an_assistant_turn_learns_the_turn_only(tok: Path) -> None:
    """The first assistant turn's mask starts after what the template puts before it (here a default system prompt
    and the role header), as every later turn's does; before, from the first character of the text (transformers
    renders no empty conversation, so no generation prompt of one)."""
    from transformers import AutoTokenizer

    from hf_models import CHAT_TEMPLATE

    t = AutoTokenizer.from_pretrained(tok)
    t.chat_template = ("{% if not messages or messages[0]['role'] != 'system' %}<|system|> you are good <|end|> "
                       "{% endif %}" + CHAT_TEMPLATE)
    ex = tokenize_chat(t, [{"role": "assistant", "content": "it is"}, {"role": "user", "content": "yes"},
                           {"role": "assistant", "content": "no"}])
    learned = [w for w, m in zip(t.convert_ids_to_tokens(ex.ids), ex.mask) if m]
    assert learned == ["it", "is", "<|end|>", "no", "<|end|>"]
    t.chat_template = CHAT_TEMPLATE.replace("m['content']", "m['content'] | lower")  # the turn's text rewritten
    with pytest.raises(ConfigError, match="opens with an assistant turn whose start .* drop that turn, or start"):
        tokenize_chat(t, [{"role": "assistant", "content": "it is"}])


def test_a_pair_with_nothing_before_its_response_is_counted(tmp_path: Path, tok: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """No prompt tokens and no BOS: the response's first token is the first position, never a label. Such data is
    common (continued pretraining as SFT, a tokenizer without BOS), so it trains, and a warning counts it."""
    (tmp_path / "s.jsonl").write_text(json.dumps({"prompt": "", "response": "yes no"}) + "\n"
                                      + json.dumps({"prompt": "hello", "response": "yes"}) + "\n")
    with caplog.at_level("WARNING", logger="mcorekit.train"):
        ds = SFTDataset([str(tmp_path / "s.jsonl")], str(tok), 32, seed=0, packing=False, vocab_size=256)
    assert len(ds.examples) == 2
    assert "1 of 2 SFT examples have nothing before their response" in caplog.text


def sft_file(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
        if i % 2:
            lines.append({"messages": [{"role": "user", "content": words(rng.randint(1, 20))},
                                       {"role": "assistant", "content": words(rng.randint(1, 30))}]})
        else:
            lines.append({"prompt": words(rng.randint(1, 20)), "response": words(rng.randint(1, 30))})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_packing_keeps_examples_apart(tmp_path: Path, tok: Path) -> None:
    path = sft_file(tmp_path / "sft.jsonl", 120, seed=6)
    ds = SFTDataset([str(path)], str(tok), 128, seed=3, packing=True, vocab_size=256)
    unpacked = SFTDataset([str(path)], str(tok), 128, seed=3, packing=False, vocab_size=256)
    assert len(ds) < len(unpacked) / 3  # packing saves most of the padding
    rows = set()
    for i in range(len(ds)):
        s = ds[i]
        cu = s["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == 128 and s["max_seqlen"] == max(b - a for a, b in zip(cu, cu[1:]))
        for a, b in zip(cu, cu[1:]):
            assert s["position_ids"][a:b].tolist() == list(range(b - a))  # positions restart per example
            seg = (s["tokens"][a:b].tolist(), s["labels"][a:b].tolist(), s["loss_mask"][a:b].tolist())
            # labels are the segment's own next tokens: the label of its last position is its own last token,
            # never the next example's first token
            assert seg[0][1:] == seg[1][:-1]
            if any(seg[2]):
                rows.add(tuple(seg[0] + seg[1][-1:]))
            else:
                assert set(seg[0]) == {ds.pad_id}  # a segment with nothing to learn is end-of-bin padding
    # every example appears exactly once per epoch, whole, with the same tokens and mask as unpacked
    assert len(rows) == len(ds.examples) == len(unpacked)
    assert rows == {tuple(ex.ids) for ex in ds.examples}


def test_unpacked_sample_masks_prompt_and_padding(tmp_path: Path, tok: Path) -> None:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    (tmp_path / "one.jsonl").write_text(json.dumps({"prompt": "hello what", "response": "it is"}) + "\n")
    s = SFTDataset([str(tmp_path / "one.jsonl")], str(tok), 16, seed=0, packing=False, vocab_size=256)[0]
    ids = t("hello what", add_special_tokens=False)["input_ids"] + t("it is", add_special_tokens=False)["input_ids"]
    assert s["tokens"][:4].tolist() == ids and s["labels"][:3].tolist() == ids[1:] + []
    # targets: "it", "is", <eos> (predicted from "what", "it", "is"); the prompt and the padding are not learned
    assert s["loss_mask"].tolist() == [0, 1, 1, 1] + [0] * 12
    assert s["labels"][1:4].tolist() == ids[2:] + [t.eos_token_id]
    assert "cu_seqlens" not in s


def test_first_fit_decreasing() -> None:
    lengths = [50, 30, 30, 20, 70, 10, 40]
    bins = first_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(7))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert len(bins) == 3  # 250 positions in bins of 100
    with pytest.raises(ValueError, match="more than the sequence length"):
        first_fit_decreasing([101], 100)
    s = pack([Example([1, 2, 3], [0, 1, 1]), Example([4, 5], [0, 1])], 6, pad_id=0)
    assert s["tokens"].tolist() == [1, 2, 4, 0, 0, 0] and s["labels"].tolist() == [2, 3, 5, 0, 0, 0]
    assert s["loss_mask"].tolist() == [1, 1, 1, 0, 0, 0] and s["cu_seqlens"].tolist() == [0, 2, 3, 6]


def test_sft_order_is_reproducible_and_reshuffled_per_epoch(tmp_path: Path, tok: Path) -> None:
    path = sft_file(tmp_path / "sft.jsonl", 40, seed=7)
    a = SFTDataset([str(path)], str(tok), 128, seed=3, packing=False, vocab_size=256)
    b = SFTDataset([str(path)], str(tok), 128, seed=3, packing=False, vocab_size=256)
    n = len(a)
    first = [a[i]["tokens"].tolist() for i in range(n)]
    assert first == [b[i]["tokens"].tolist() for i in range(n)]
    second = [a[n + i]["tokens"].tolist() for i in range(n)]
    assert sorted(map(tuple, first)) == sorted(map(tuple, second)) and first != second


def test_sft_errors(tmp_path: Path, tok: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hello"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: expected 'messages', 'prompt'\+'response'"):
        SFTDataset([str(tmp_path / "bad.jsonl")], str(tok), 64, 0, False, 256)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "hello", "response": "x"}\n{oops\n')
    with pytest.raises(ConfigError, match=r"broken.jsonl:2: not valid JSON"):
        SFTDataset([str(tmp_path / "broken.jsonl")], str(tok), 64, 0, False, 256)
    with pytest.raises(ConfigError, match="vocabulary is 100"):
        SFTDataset([str(tmp_path / "bad.jsonl")], str(tok), 64, 0, False, 100)
