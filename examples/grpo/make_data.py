"""Everything the GRPO example needs, made here without downloads: a synthetic verifiable task (multi-digit
addition of two numbers below 1000, every number written units digit first with a fixed number of digits: 123 +
45 is `321+540=` and its sum 168 is `8610`), a
character-level HF tokenizer and the HF config of a small Llama (random weights: the SFT run trains it from
scratch), SFT data, GRPO prompts and held-out prompts.

    python examples/grpo/make_data.py --out examples/grpo/data     # then see docs/post-training.md, "GRPO"

Why this layout: the sum is written in the order it is worked out by hand, so each of its digits depends only on
the two operand digits of its place, always the same distance back in the sequence, and on the carry of the digit
just written. A small transformer learns that in a few hundred steps, where the usual layout (operands of any
width, most significant digit first, which needs every carry before the first digit of the sum) takes it
thousands (Lee et al. 2023, "Teaching arithmetic to small transformers").

Files written under OUT:
  model/        config.json (Llama, ~0.8M parameters) and the tokenizer (one token per character: 0-9 + = and
                <unk> <pad> <eos>); model.hf_config and data.tokenizer of both experiments point here
  sft.jsonl     {"prompt": "321+540=", "response": "8610"}: SFT learns the format and the arithmetic, from a
                sloppy teacher: with --sloppy 0.8 (the default), 80% of the sums that carry from the tens into the
                hundreds (about a third of all sums) are written without that carry (99 + 1: "990+100=" -> "0000",
                i.e. 0, instead of "0010"), nothing else wrong. The SFT model imitates its data: on those sums greedy
                decoding mostly writes the uncarried hundreds digit, while sampling still writes the carried one now
                and then. Rewards that check the sum (GRPO) turn that minority into the greedy answer.
  train.jsonl   {"prompt": "321+540=", "answer": "8610"}: GRPO's prompts (the answer, as the model must write
                it, feeds the rewards: mcorekit.train.rewards:exact_match and examples/grpo/rewards.py)
  heldout.jsonl the same kind, none of them in sft.jsonl or train.jsonl (examples/grpo/evaluate.py scores them)
Operands have 1 to --digits significant digits (uniform in that number, so short sums do not dominate), written
with --digits digits, units first (zeros fill the end); sums with --digits + 1 the same way.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIALS = ["<unk>", "<pad>", "<eos>"]
CHARS = list("0123456789+=")


def written(n: int, digits: int = 3) -> str:
    """How the task writes a sum: digits + 1 digits, units first (168 -> "8610"); operands: written(n, digits - 1)."""
    return str(n).zfill(digits + 1)[::-1]


def operand(rng: random.Random, digits: int) -> int:
    n = rng.randint(1, digits)
    return rng.randrange(0 if n == 1 else 10 ** (n - 1), 10 ** n)


def problem(rng: random.Random, digits: int) -> tuple[str, int]:
    a, b = (operand(rng, digits) for _ in range(2))
    return f"{written(a, digits - 1)}+{written(b, digits - 1)}=", a + b


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
    """1.0 when the completion is the sum the prompt asks for, as the task writes it (what exact_match checks
    against the answer field)."""
    left = [int(x[::-1]) for x in prompt.rstrip("=").split("+")]
    digits = len(prompt.split("+")[0])
    return float(completion.strip() == written(left[0] + left[1], digits))


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

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
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
    p.add_argument("--sloppy", type=float, default=0.8,
                   help="share of the SFT sums with a carry from the tens into the hundreds written without it "
                        "(0: all right)")
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
        x, y = (int(v[::-1]) for v in q.rstrip("=").split("+"))
        responses.append(written(sloppy_sum(x, y) if rng.random() < a.sloppy else s, a.digits))
    write_jsonl(out / "sft.jsonl", [{"prompt": q, "response": r} for (q, _), r in zip(sft, responses)])
    write_jsonl(out / "train.jsonl", [{"prompt": q, "answer": written(s, a.digits)} for q, s in train])
    write_jsonl(out / "heldout.jsonl", [{"prompt": q, "answer": written(s, a.digits)} for q, s in held])
    wrong = sum(r != written(s, a.digits) for (_, s), r in zip(sft, responses))
    print(f"wrote {out}: model/ (config + tokenizer), sft.jsonl ({len(sft)}, {wrong} without a carry), train.jsonl "
          f"({len(train)}), heldout.jsonl ({len(held)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
