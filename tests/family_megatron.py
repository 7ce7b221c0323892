"""Run as a script, for tests/test_families.py: Megatron-Core's own model of a converted HF config, on CPU.

    keys HF TP PP EP    build train/'s model at a layout (one gloo process per rank) and print `KEYS <json>`: the
                        union of its sharded_state_dict keys with global shapes
    logits HF CKPT      build it at TP1 (local spec), print its `KEYS <json>`, load a converted torch_dist
                        checkpoint into it and print `LOGITS <max |diff|> <cosine> <top-1 agreement>` against the
                        HF model in fp32 (one process: Megatron-Core's import is most of a run on 2 cores)
    mtp HF CKPT         the same with Megatron-Core's MTP block (DeepSeek-V3 with its MTP layer), then one training-
                        mode forward with labels: `MTP <Megatron's MTP loss> <the loss from DeepSeek's formula>`,
                        the formula computed here with transformers' modules (mtp_reference)

Megatron-Core puts RotaryEmbedding's frequencies and the MoE router's expert-bias buffers on
torch.cuda.current_device(), and its local attention's causal and sliding-window masks on "cuda"; those are
pointed at the CPU here (the masks rebuilt as Megatron-Core's utils build them), and the CUDA RNG fork around
its attention dropout (p = 0) is skipped. Everything else is Megatron-Core's
code."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp


def _cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    # Megatron-Core's local attention builds its causal and sliding-window masks on "cuda"; the same masks on CPU
    from megatron.core.fusions import fused_softmax

    def causal(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    def sliding(sq: int, skv: int, window: tuple[int, int]) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window[0]), diagonal=skv - sq + window[1])

    fused_softmax.get_default_causal_mask, fused_softmax.get_sliding_window_causal_mask = causal, sliding
    # its attention dropout (p = 0 here) forks the CUDA RNG tracker
    import contextlib

    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def keys_rank(rank: int, world: int, hf: str, tp: int, pp: int, ep: int, out: str) -> None:
    import torch.distributed as dist

    _cpu()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("KEYS_PORT", "29633"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from mcorekit.models.megatron import build_gpt, padded_vocab_size, transformer_config
    from mcorekit.models.parallel import Layout
    from mcorekit.models.spec import from_hf_config, load_hf_config

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    spec = from_hf_config(load_hf_config(hf))
    cfg = transformer_config(spec, Layout(tp=tp, pp=pp, ep=ep), cpu_init=True, moe_token_dispatcher_type="allgather")
    model = build_gpt(spec, cfg, padded_vocab_size(spec.vocab_size, 128), use_te=False,
                      pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    sd = model.sharded_state_dict()
    apply_factories(sd)
    keys = {v.key: list(v.global_shape) for v in nested_values(sd) if isinstance(v, ShardedTensor)}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(keys, f)
    dist.destroy_process_group()


def keys(hf: str, tp: int, pp: int, ep: int) -> None:
    world = math.lcm(tp, ep) * pp
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "keys")
        mp.spawn(keys_rank, args=(world, hf, tp, pp, ep, out), nprocs=world, join=True)
        merged: dict[str, list[int]] = {}
        for r in range(world):
            with open(f"{out}.{r}") as f:
                merged.update(json.load(f))
    print("KEYS " + json.dumps(merged, sort_keys=True))


def logits(hf: str, ckpt: str, mtp: bool = False) -> None:
    import dataclasses

    import torch.distributed as dist

    _cpu()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("LOGITS_PORT", "29677"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    from mcorekit.convert.torch_dist import TorchDistReader
    from mcorekit.models.megatron import build_gpt, transformer_config
    from mcorekit.models.spec import from_hf_config, load_hf_config

    ps.initialize_model_parallel(1, 1)
    spec = from_hf_config(load_hf_config(hf))
    if mtp:
        spec = dataclasses.replace(spec, mtp_layers=spec.extra["nextn_predict_layers"])
    padded = tuple(TorchDistReader(ckpt).tensor_keys()["embedding.word_embeddings.weight"].size)[0]
    cfg = transformer_config(spec, cpu_init=True, moe_token_dispatcher_type="allgather")
    model = build_gpt(spec, cfg, padded, use_te=False).eval()
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    keys = {v.key: list(v.global_shape) for v in nested_values(sd) if isinstance(v, ShardedTensor)}
    print("KEYS " + json.dumps(keys, sort_keys=True))
    from megatron_cpu_logits import load_and_compare  # this file's folder is on sys.path when run as a script

    load_and_compare(model, spec, hf, ckpt)
    if mtp:
        mtp_losses(model, spec, hf)
    dist.destroy_process_group()


def mtp_losses(model: torch.nn.Module, spec: object, hf: str) -> None:
    """Megatron-Core's MTP loss (MTPLossLoggingHelper's per-layer value of a training-mode forward with labels) and
    DeepSeek's formula on the same tokens; prints `MTP <megatron> <reference>`."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    g = torch.Generator().manual_seed(7)
    seq = torch.randint(0, spec.vocab_size, (2, 25), generator=g)
    ids, labels = seq[:, :-1], seq[:, 1:]
    mask = torch.ones(labels.shape)
    mask[0, 5:9] = 0  # a loss mask with holes, as SFT data has
    model.train()  # the helper records the MTP loss in training only (dropout is 0)
    with torch.no_grad():
        model(ids, torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids), attention_mask=None, labels=labels,
              loss_mask=mask)
    got = float(MTPLossLoggingHelper.tracker["loss_values"][0])
    padded = model.embedding.word_embeddings.weight.shape[0]
    print(f"MTP {got} {mtp_reference(hf, ids, labels, mask, spec.num_layers, padded)}")


def mtp_reference(hf: str, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, layers: int,
                  padded_vocab: int) -> float:
    """DeepSeek-V3's first MTP module from the HF checkpoint, with transformers' own modules: at position i the main
    model's final hidden state h_i and the embedding of token i+1 give eh_proj([enorm(emb); hnorm(h)]), then the
    decoder layer model.layers.<layers> (transformers' DeepseekV3DecoderLayer, its weights loaded by transformers),
    shared_head.norm and shared_head.head predict label i+1 (token i+2); the mean cross entropy over the positions
    whose shifted mask is 1 (the last position has no such label). The head's rows are padded with zeros to
    Megatron's vocabulary, as its output layer's are (a zero logit per padding row, in its loss as in its LM loss)."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    import torch.nn.functional as F
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    from mcorekit.convert.hf_io import HFReader

    main = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as d:  # the same checkpoint read as a model one layer deeper: its MTP layer
        for f in Path(hf).iterdir():
            shutil.copy(f, d)
        cfg = json.loads((Path(d) / "config.json").read_text())
        (Path(d) / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers + 1}))
        deeper = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
    reader = HFReader(hf)
    w = {k: reader.get(f"model.layers.{layers}.{k}.weight").float()
         for k in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")}
    eps = main.config.rms_norm_eps

    def norm(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        module = DeepseekV3RMSNorm(x.shape[-1], eps)
        module.weight.data.copy_(weight)
        return module(x)

    b, s = ids.shape
    with torch.no_grad():
        h = main.model(ids).last_hidden_state  # after the final norm, as Megatron-Core hands it to its MTP block
        nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # token i+1 (none after the last)
        x = torch.cat([norm(w["enorm"], main.model.embed_tokens(nxt)), norm(w["hnorm"], h)], dim=-1) @ w["eh_proj"].t()
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        causal = torch.full((s, s), float("-inf")).triu(1)[None, None].expand(b, 1, s, s)
        y = deeper.model.layers[layers](x, attention_mask=causal, position_ids=pos,
                                        position_embeddings=deeper.model.rotary_emb(x, pos))
        head = torch.cat([w["shared_head.head"], w["shared_head.head"].new_zeros(padded_vocab - w["shared_head.head"].shape[0],
                                                                                 w["shared_head.head"].shape[1])])
        logits = norm(w["shared_head.norm"], y) @ head.t()
        target = torch.cat([labels[:, 1:], torch.zeros_like(labels[:, :1])], dim=1)
        keep = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
        ce = F.cross_entropy(logits.reshape(b * s, -1), target.reshape(-1), reduction="none").reshape(b, s)
    return float((ce * keep).sum() / keep.sum())


if __name__ == "__main__":
    if sys.argv[1] == "keys":
        keys(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        logits(sys.argv[2], sys.argv[3], mtp=sys.argv[1] == "mtp")
