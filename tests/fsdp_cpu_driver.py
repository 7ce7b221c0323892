"""Run as a script (one gloo process, CPU, local layer spec, fp32): write a checkpoint in the fsdp_dtensor layout that
train/checkpoint.py's Megatron-FSDP save writes (DCP tensors under model.<key> at their global shapes, an
optimizer part, fsdp_dtensor.json), then read it into a differently initialised model without FSDP through
checkpoint.load_weights and checkpoint.load (weights, scheduler, step; fresh optimizer). Prints `FSDP {json}`.
Used by test_fsdp.py. The tensors here are whole (one rank); on GPUs Megatron-FSDP writes uneven DTensor shards of
the same global tensors, which DCP's metadata describes the same way to the reader.

    python fsdp_cpu_driver.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.cuda.current_device = lambda: "cpu"  # RotaryEmbedding.get_emb's device (see megatron_cpu_logits.py)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("FSDP_PORT", "29589"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    from mcorekit.models.megatron import build_gpt, transformer_config
    from mcorekit.models.spec import ModelSpec
    from mcorekit.train import checkpoint

    ps.initialize_model_parallel(1, 1)
    spec = ModelSpec("llama", 2, 64, 4, 2, 16, 128, 256)

    def model(seed: int):
        torch.manual_seed(seed)
        return build_gpt(spec, transformer_config(spec, cpu_init=True), 256, use_te=False)

    saved = model(1)
    sd = {k: v for k, v in saved.state_dict().items() if torch.is_tensor(v)}
    names = checkpoint.fsdp_model_keys(list(sd), None)
    path = Path(out) / "ckpt" / "iter_0000010"
    path.mkdir(parents=True)
    first = next(iter(names.values()))
    state = {"model": {names[k]: v.float() for k, v in sd.items() if k in names},
             "optimizer": {"state": {f"module.module.{first}": {"exp_avg": torch.ones(3)}}}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))
    sched = {"max_lr": 1e-3, "lr_warmup_steps": 16, "num_steps": 80, "lr_decay_style": "cosine"}
    info = {"format": checkpoint.FSDP_DTENSOR, "iteration": 10, "scheduler": checkpoint.to_json(sched),
            "optimizer": checkpoint.to_json({"param_to_group_meta": {first: {"betas": (0.9, 0.95)}}}),
            "layout": {"tp": 1, "etp": 1, "ep": 1, "pp": 1, "dp": 2}, "num_moe_experts": None}
    (path / checkpoint.FSDP_JSON).write_text(json.dumps(info))
    (path.parent / checkpoint.TRACKER).write_text("10")

    found = checkpoint.latest(path.parent)
    target = model(2)
    differs_before = any(not torch.equal(sd[k], v) for k, v in target.state_dict().items() if k in names)
    checkpoint.load_weights(found, [target])
    equal_weights = all(torch.equal(sd[k], v) for k, v in target.state_dict().items() if k in names)

    class Optimizer:
        reloaded = 0

        def reload_model_params(self) -> None:
            Optimizer.reloaded += 1

    class Scheduler:
        state: dict = {}

        def load_state_dict(self, s: dict) -> None:
            Scheduler.state = s

    resumed = model(3)
    step = checkpoint.load(found, [resumed], Optimizer(), Scheduler())
    print("FSDP " + json.dumps({
        "format": checkpoint.format_of(found), "latest": found.name, "keys": len(names),
        "extra_state_left_out": sorted(k for k in sd if k not in names),
        "differs_before": differs_before, "equal_weights": equal_weights,
        "resumed_equal": all(torch.equal(sd[k], v) for k, v in resumed.state_dict().items() if k in names),
        "step": step, "scheduler": Scheduler.state, "reloaded": Optimizer.reloaded}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
