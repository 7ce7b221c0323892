"""Logits of the HF model (transformers) against the Megatron model loaded from the converted checkpoint (GPU).

The Megatron model is train/'s (models/megatron.py, Transformer Engine spec when TE is importable), loaded with
`dist_checkpointing.load` under strict="raise_all": a missing or unexpected key fails the check. Both run in
fp32 on the same fixed prompts; in fp32 the only differences are kernel summation orders, so we require
cosine >= 0.9999 and 100% top-1 agreement.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mcorekit.convert.files import read_json
from mcorekit.convert.pipeline import find_iteration_dir, spec_for
from mcorekit.convert.torch_dist import TorchDistReader
from mcorekit.convert.verify import LogitsReport, compare_logits
from mcorekit.errors import ConversionError
from mcorekit.models.spec import ModelSpec
from mcorekit.train.checkpoint_reader import checked_extra_states, checked_records, read_ahead


def fixed_prompts(vocab: int, batch: int = 4, seq: int = 64, seed: int = 1234) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def init_single_gpu() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():  # one process: an in-memory store, no port to collide with another run
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def megatron_logits(hf_dir: str | Path, ckpt: str | Path, ids: torch.Tensor) -> torch.Tensor:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from mcorekit.models.megatron import build_gpt, te_available, transformer_config

    spec = hf_spec(hf_dir)
    iter_dir, reader = checked_checkpoint(ckpt)
    padded = tuple(reader.tensor_keys()["embedding.word_embeddings.weight"].size)[0]
    init_single_gpu()
    config = transformer_config(spec)
    model = build_gpt(spec, config, padded, use_te=te_available()).cuda().eval()
    with read_ahead():  # its .metadata and common state read as checked_checkpoint read them, nothing unrestricted
        state = dist_checkpointing.load(model.sharded_state_dict(), str(iter_dir), strict=StrictHandling.RAISE_ALL)
    with checked_extra_states():  # checked_checkpoint checked its records, TE's FP8 extra states among them
        model.load_state_dict(state)
    ids = ids.cuda()
    pos = torch.arange(ids.shape[1], device="cuda").unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, pos, attention_mask=None)
    return logits[..., : spec.vocab_size].float().cpu()


def hf_logits(hf_dir: str | Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, trust_remote_code=False)
    model = model.cuda().eval()
    with torch.no_grad():
        return model(ids.cuda()).logits.float().cpu()


def hf_spec(hf_dir: str | Path) -> ModelSpec:
    """The model an HF directory (or its config.json) describes; a bad config is one line."""
    path = Path(hf_dir)
    file = path / "config.json" if path.is_dir() else path
    return spec_for(read_json(file), file)


def checked_checkpoint(ckpt: str | Path) -> tuple[Path, TorchDistReader]:
    """The iteration folder and its reader, once nothing in it would run code: .metadata is read by our restricted
    unpickler, and every bytes record, the TE extra states inside them and a common.pt by the training side's
    restricted unpicklers (checked_records), because Megatron's loader and TE's set_extra_state unpickle them freely."""
    iter_dir = find_iteration_dir(Path(ckpt))
    reader = TorchDistReader(iter_dir)
    checked_records(iter_dir, reader.metadata)
    return iter_dir, reader


def verify_logits(hf_dir: str | Path, ckpt: str | Path) -> LogitsReport:
    hf_spec(hf_dir)
    checked_checkpoint(ckpt)  # inputs first: a bad one is reported without a GPU too
    if not torch.cuda.is_available():
        raise ConversionError("--logits needs a CUDA GPU (Megatron-Core does not run a forward pass on CPU)")
    from mcorekit.models.megatron import te_available

    te_available()  # load TE's cuDNN before anything makes torch load its own (mixing them fails on some images)
    spec = hf_spec(hf_dir)
    ids = fixed_prompts(spec.vocab_size)
    got = megatron_logits(hf_dir, ckpt, ids)
    return compare_logits(hf_logits(hf_dir, ids), got)
