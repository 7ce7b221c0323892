"""Everything the GRPO example needs, made here without downloads: a synthetic verifiable task (multi-digit
addition, `123+4567=` -> `4690`), a character-level HF tokenizer and the HF config of a small Llama (random
weights: the SFT run trains it from scratch), SFT data, GRPO prompts and held-out prompts.

    python examples/grpo/make_data.py --out examples/grpo/data     # then see docs/post-training.md, "GRPO"

Files written under OUT:
  model/        config.json (Llama, ~3.2M parameters) and the tokenizer (one token per character: 0-9 + = and
                <unk> <pad> <eos>); model.hf_config and data.tokenizer of both experiments point here
  sft.jsonl     {"prompt": "123+4567=", "response": "4690"}: SFT learns the format and most of the arithmetic, from
                a sloppy teacher: with --sloppy 0.6 (the default), 60% of the sums that carry into the hundreds are
                written without that carry (999+1 = 900), so the SFT model, imitating its data, drops it more often
                than not. Rewards that check the sum (GRPO) can fix what the imitated data got wrong.
  train.jsonl   {"prompt": "123+4567=", "answer": 4690}: GRPO's prompts (the answer feeds the reward)
  heldout.jsonl the same kind, none of them in sft.jsonl or train.jsonl (examples/grpo/evaluate.py scores them)
Operands have 1 to --digits digits (uniform in the number of digits, so short sums do not dominate).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIALS = ["<unk>", "<pad>", "<eos>"]
CHARS = list("0123456789+=")


def operand(rng: random.Random, digits: int) -> int:
    n = rng.randint(1, digits)
    return rng.randrange(0 if n == 1 else 10 ** (n - 1), 10 ** n)


def problem(rng: random.Random, digits: int) -> tuple[str, int]:
    a, b = (operand(rng, digits) for _ in range(2))
    return f"{a}+{b}=", a + b


def sloppy_sum(a: int, b: int) -> int:
    """a + b without the carry from the tens into the hundreds (what the sloppy teacher writes)."""
    carry = (a % 100 + b % 100) >= 100
    return a + b - 100 if carry else a + b


def problems(n: int, digits: int, seed: int, exclude: set[str] = frozenset()) -> list[tuple[str, int]]:
    """n distinct problems not in `exclude`."""
    rng = random.Random(seed)
    seen, out = set(exclude), []
    while len(out) < n:
        prompt, answer = problem(rng, digits)
        if prompt not in seen:
            seen.add(prompt)
            out.append((prompt, answer))
    return out


def score(prompt: str, completion: str) -> float:
    """1.0 when the completion is the sum the prompt asks for (what math_answer checks on the answer field)."""
    left = prompt.rstrip("=").split("+")
    return float(completion.strip() == str(int(left[0]) + int(left[1])))


def make_tokenizer(out: Path) -> None:
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character is a token
    tok.decoder = decoders.Fuse()  # and decoding joins them back without spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="<eos>")
    fast.save_pretrained(out)


def make_model_config(out: Path, vocab: int) -> None:
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                      max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=1,
                                      torch_dtype="bfloat16")
    config.save_pretrained(out)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="examples/grpo/data")
    p.add_argument("--digits", type=int, default=3, help="operands have 1 to this many digits")
    p.add_argument("--sft", type=int, default=20000, help="SFT examples")
    p.add_argument("--train", type=int, default=20000, help="GRPO prompts")
    p.add_argument("--heldout", type=int, default=512, help="held-out prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sloppy", type=float, default=0.6,
                   help="share of SFT answers that carry into the hundreds written without the carry (0: all right)")
    a = p.parse_args(argv)
    if not 1 <= a.digits <= 9:
        p.error("--digits must be 1..9")
    if not 0 <= a.sloppy <= 1:
        p.error("--sloppy must be in [0, 1]")
    out = Path(a.out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    make_tokenizer(out / "model")
    make_model_config(out / "model", len(SPECIALS) + len(CHARS))
    held = problems(a.heldout, a.digits, a.seed + 1)
    taken = {q for q, _ in held}
    sft = problems(a.sft, a.digits, a.seed + 2, taken)
    taken |= {q for q, _ in sft}
    train = problems(a.train, a.digits, a.seed + 3, taken)
    rng = random.Random(a.seed + 4)
    responses = []
    for q, s in sft:
        x, y = (int(v) for v in q.rstrip("=").split("+"))
        responses.append(str(sloppy_sum(x, y) if rng.random() < a.sloppy else s))
    write_jsonl(out / "sft.jsonl", [{"prompt": q, "response": r} for (q, _), r in zip(sft, responses)])
    write_jsonl(out / "train.jsonl", [{"prompt": q, "answer": s} for q, s in train])
    write_jsonl(out / "heldout.jsonl", [{"prompt": q, "answer": s} for q, s in held])
    wrong = sum(r != str(s) for (_, s), r in zip(sft, responses))
    print(f"wrote {out}: model/ (config + tokenizer), sft.jsonl ({len(sft)}, {wrong} without a carry), train.jsonl "
          f"({len(train)}), heldout.jsonl ({len(held)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
