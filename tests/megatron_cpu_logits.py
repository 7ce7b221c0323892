"""Run as a script: load a converted torch_dist checkpoint into train/'s Megatron model on CPU (one gloo process,
local layer spec) and compare its logits with the HF model's on fixed prompts; prints `LOGITS <max |diff|>
<cosine> <top-1 agreement>`. Used by test_convert.py.

Megatron-Core has no CPU forward path only because RotaryEmbedding moves its frequencies to
torch.cuda.current_device(); that one call is pointed at the CPU here. Everything else (attention, router, token
dispatch, experts, shared experts) is Megatron-Core's own code."""

from __future__ import annotations

import os
import sys

import torch


def main(hf: str, ckpt: str) -> None:
    import torch.distributed as dist

    torch.cuda.current_device = lambda: "cpu"  # RotaryEmbedding.get_emb's device
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("LOGITS_PORT", "29577"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    from mcorekit.convert.torch_dist import TorchDistReader
    from mcorekit.models.megatron import build_gpt, transformer_config
    from mcorekit.models.spec import from_hf_config, load_hf_config

    ps.initialize_model_parallel(1, 1)
    spec = from_hf_config(load_hf_config(hf))
    padded = tuple(TorchDistReader(ckpt).tensor_keys()["embedding.word_embeddings.weight"].size)[0]
    extra = {"moe_token_dispatcher_type": "allgather"} if spec.is_moe else {}  # alltoall allocates CUDA streams
    model = build_gpt(spec, transformer_config(spec, cpu_init=True, **extra), padded, use_te=False).eval()
    load_and_compare(model, spec, hf, ckpt)
    dist.destroy_process_group()


def load_and_compare(model: torch.nn.Module, spec: object, hf: str, ckpt: str) -> None:
    """Load the checkpoint into `model` and print `LOGITS <max |diff|> <cosine> <top-1 agreement>` against the HF
    model on fixed prompts (also used by family_megatron.py)."""
    import transformers
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from mcorekit.convert.verify import compare_logits

    # TE's extra states in the checkpoint have no module in the local spec; every model tensor must load
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    model.load_state_dict(state)
    ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = model(ids, torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids), attention_mask=None)
        ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(ids).logits
    got = got[..., : spec.vocab_size].float()
    report = compare_logits(ref.float(), got)
    print(f"LOGITS {(ref - got).abs().max().item()} {report.cosine} {report.top1_agreement}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
