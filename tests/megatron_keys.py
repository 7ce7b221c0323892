"""Run as a script: build train/'s Megatron model on CPU at a layout (one gloo process per rank) and print the
union of its sharded_state_dict keys with global shapes as JSON. Used by test_model_keys.py."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

import torch.multiprocessing as mp


def rank_main(rank: int, world: int, hf: str, tp: int, pp: int, ep: int, vpp: int | None, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("KEYS_PORT", "29533"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from mcorekit.models.megatron import build_gpt, padded_vocab_size, transformer_config
    from mcorekit.models.parallel import Layout
    from mcorekit.models.spec import from_hf_config, load_hf_config

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1, virtual_pipeline_model_parallel_size=vpp)
    spec = from_hf_config(load_hf_config(hf))
    extra = {"moe_token_dispatcher_type": "allgather"} if spec.is_moe else {}  # alltoall allocates CUDA streams
    cfg = transformer_config(spec, Layout(tp=tp, pp=pp, ep=ep, vpp=vpp), cpu_init=True, **extra)
    keys: dict[str, list[int]] = {}
    seen: set[tuple] = set()  # (key, offset): a layer built by two virtual stages would repeat one
    for stage in range(vpp or 1):  # one chunk per virtual pipeline stage, built as train/build.py does
        vp = stage if vpp else None
        model = build_gpt(spec, cfg, padded_vocab_size(spec.vocab_size, 128), use_te=False, vp_stage=vp,
                          pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                          post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp))
        sd = model.sharded_state_dict()
        apply_factories(sd)
        for v in nested_values(sd):
            if isinstance(v, ShardedTensor):
                assert (v.key, v.global_offset) not in seen, f"{v.key} at {v.global_offset} built twice"
                seen.add((v.key, v.global_offset))
                keys[v.key] = list(v.global_shape)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(keys, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    hf, tp, pp, ep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    vpp = int(sys.argv[5]) if len(sys.argv) > 5 else None
    world = math.lcm(tp, ep) * pp
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "keys")
        mp.spawn(rank_main, args=(world, hf, tp, pp, ep, vpp, out), nprocs=world, join=True)
        merged: dict[str, list[int]] = {}
        for r in range(world):
            with open(f"{out}.{r}") as f:
                merged.update(json.load(f))
    print("KEYS " + json.dumps(merged, sort_keys=True))
