"""Tiny random HF models built from transformers configs (no downloads), saved as sharded safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

CONFIGS = {
    "llama": lambda tied: transformers.LlamaConfig(**COMMON, tie_word_embeddings=tied),
    "llama3": lambda tied: transformers.LlamaConfig(**COMMON, tie_word_embeddings=tied, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "qwen2": lambda tied: transformers.Qwen2Config(**COMMON, tie_word_embeddings=tied),
    "qwen3": lambda tied: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=tied),
    "mixtral": lambda tied: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=tied),
    "qwen3_moe": lambda tied: transformers.Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                                          num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=tied),
    # shared expert (48) with its sigmoid gate beside 4 routed experts; softmax-then-top-k without renormalising
    "qwen2_moe": lambda tied: transformers.Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                          num_experts=4, num_experts_per_tok=2, tie_word_embeddings=tied),
}
MOE = ("mixtral", "qwen3_moe", "qwen2_moe")


def make_model(name: str, tied: bool, out: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](tied), dtype=torch.bfloat16)
    with torch.no_grad():  # random norms too, so a swapped norm cannot pass as "equal"
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out, max_shard_size="40KB")
    (out / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    return out


WORDS = ("the a an of to and in is it that for on with as was at by be this are from or have not but what all "
         "were when we there can more if out so up said about into than them only some could new time two may "
         "first then do any like my now over such our man me even most made after also did many before must "
         "through back years where much your way well down should because each just those people how too little "
         "state good very make world still own see men work long get here between both life being under never "
         "day same another know while last might us great old year off come since against go came right used "
         "take three hello question answer user assistant system yes no").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def make_tokenizer(out: Path) -> Path:
    """A small word-level HF tokenizer (fast, with offsets) and a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="<eos>", additional_special_tokens=specials[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out
