"""Run as a script, for tests/test_families.py: Megatron-Core's own model of a converted HF config, on CPU.

    keys HF TP PP EP    build train/'s model at a layout (one gloo process per rank) and print `KEYS <json>`: the
                        union of its sharded_state_dict keys with global shapes
    logits HF CKPT      build it at TP1 (local spec), print its `KEYS <json>`, load a converted torch_dist
                        checkpoint into it and print `LOGITS <max |diff|> <cosine> <top-1 agreement>` against the
                        HF model in fp32 (one process: Megatron-Core's import is most of a run on 2 cores)

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


def logits(hf: str, ckpt: str) -> None:
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
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "keys":
        keys(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        logits(sys.argv[2], sys.argv[3])
