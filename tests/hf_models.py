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


# ---------------------------------------------------------------- the MoE families of issue 19 (tests/test_families.py)

# DeepSeek-V3: MLA with a q LoRA (q_lora_rank) or without, YaRN rope, one dense layer then MoE layers with a shared
# expert, sigmoid routing with 4 groups of which 2 are picked (top-4 of 8: 4 / 2 = DeepSeek's top-2 group scores)
DEEPSEEK_V3 = dict(vocab_size=250, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                   routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
                   qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
                   max_position_embeddings=256, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                    "mscale": 1.0, "mscale_all_dim": 1.0})
FAMILY_CONFIGS = {
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**DEEPSEEK_V3),
    "deepseek_v3_2dense": lambda: transformers.DeepseekV3Config(**{**DEEPSEEK_V3, "first_k_dense_replace": 2,
                                                                   "n_shared_experts": 2}),
}


def make_family_model(name: str, out: Path, seed: int = 0) -> Path:
    """A tiny random model of FAMILY_CONFIGS[name] with random norms, biases and sinks, and for DeepSeek a random
    router bias (transformers initialises e_score_correction_bias and GPT-OSS's biases to zeros, which would not
    show a lost or swapped bias)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(FAMILY_CONFIGS[name](), dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif n.endswith(("bias", "sinks")):  # GPT-OSS initialises its biases to zeros
                p.copy_(0.1 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(out, max_shard_size="200KB")
    (out / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    return out


# GPT-OSS: sliding window 8 on even layers (shorter than the 24-token prompts), YaRN (truncate=false), 4 experts top-2,
# a SwiGLU limit small enough that the tiny model's activations are clamped
GPT_OSS = dict(vocab_size=250, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
               max_position_embeddings=256, rms_norm_eps=1e-5, swiglu_limit=0.1,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False})
FAMILY_CONFIGS["gpt_oss"] = lambda: transformers.GptOssConfig(**GPT_OSS)

# DeepSeek-V2: softmax routing (group-limited greedy: 3 of 4 groups, each ranked by its best expert; unnormalised)
# scaled by 1.5, two shared experts, YaRN with mscale = mscale_all_dim
DEEPSEEK_V2 = {**DEEPSEEK_V3, "n_group": 4, "topk_group": 3, "n_shared_experts": 2, "routed_scaling_factor": 1.5,
               "topk_method": "group_limited_greedy",
               "rope_parameters": {**DEEPSEEK_V3["rope_parameters"], "mscale": 0.707, "mscale_all_dim": 0.707}}
FAMILY_CONFIGS["deepseek_v2"] = lambda: transformers.DeepseekV2Config(**DEEPSEEK_V2)


def add_mtp_layer(hf: Path, seed: int = 1, embed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Give a DeepSeek-V3 checkpoint (make_family_model's) the MTP layer of DeepSeek's own checkpoints, which
    transformers neither builds nor saves: `model.layers.<num_hidden_layers>.*` = a decoder layer like the last one
    (its tensors perturbed, so that a swap with it shows), enorm, hnorm, eh_proj [hidden, 2 * hidden],
    shared_head.norm, and copies of the embedding and the head (`embed`: a different embedding copy, to test the
    refusal). Written as one more shard in the index; returns the tensors added."""
    import json

    from safetensors.torch import save_file

    from mcorekit.convert.hf_io import HFReader

    cfg = json.loads((hf / "config.json").read_text())
    last, mtp = cfg["num_hidden_layers"] - 1, cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    src = HFReader(hf)
    names = src.names()
    out = {}
    for name in names:
        if name.startswith(f"model.layers.{last}."):
            t = src.get(name)
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype)
            out[name.replace(f".{last}.", f".{mtp}.", 1)] = (t + 0.1 * noise * t.abs().mean()).contiguous()
    h, dtype = cfg["hidden_size"], src.get("model.embed_tokens.weight").dtype
    for key, shape, scale, base in (("enorm.weight", (h,), 0.1, 1.0), ("hnorm.weight", (h,), 0.1, 1.0),
                                    ("shared_head.norm.weight", (h,), 0.1, 1.0),
                                    ("eh_proj.weight", (h, 2 * h), (2 * h) ** -0.5, 0.0)):
        out[f"model.layers.{mtp}.{key}"] = (base + scale * torch.randn(shape, generator=g)).to(dtype)
    out[f"model.layers.{mtp}.embed_tokens.weight"] = (embed if embed is not None else src.get("model.embed_tokens.weight")).clone()
    out[f"model.layers.{mtp}.shared_head.head.weight"] = src.get("lm_head.weight").clone()
    src.close()
    save_file(out, hf / "model-mtp.safetensors", metadata={"format": "pt"})
    index_file = hf / "model.safetensors.index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
    else:  # one shard without an index: give it one
        (hf / "model.safetensors").rename(hf / "model-main.safetensors")
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model-main.safetensors")}
    index["weight_map"].update(dict.fromkeys(out, "model-mtp.safetensors"))
    index_file.write_text(json.dumps(index))
    cfg["num_nextn_predict_layers"] = 1
    (hf / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
