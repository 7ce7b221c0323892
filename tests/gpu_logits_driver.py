"""Every rank of an srun step (2+ GPUs): load an HF-converted checkpoint at one parallel layout and compare the
full logits with transformers' (fp32) on the same tokens.
usage: gpu_logits_driver.py HF_DIR MCORE_DIR OUT_DIR NAME:KEY=VALUE,KEY=VALUE [DTYPE]
       (e.g. tp2-sp:tp=2,sequence_parallel=true; DTYPE fp32 by default, bf16 for CP, which TE runs only in 16 bit)
One layout per process: Megatron's process groups are set up once per process, as in training.

Per layout: train/'s own build() (process groups, TE model, DDP chunks), checkpoint.load_weights(), one
forward-only pass through Megatron's pipeline schedule, then the vocab-parallel logits are gathered over TP, the
zigzag sequence chunks over CP, and the last pipeline stage's rank (TP/CP/DP rank 0) writes OUT_DIR/NAME.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from mcorekit.config.experiment import load_experiment
from mcorekit.convert.logits import hf_logits
from mcorekit.convert.verify import compare_logits
from mcorekit.train import checkpoint
from mcorekit.train.build import build
from mcorekit.train.data import batches
from mcorekit.train.data.mock import MockDataset

SEQ, MBS, SEED = 256, 2, 11


def parse_layout(text: str) -> tuple[str, dict]:
    name, _, items = text.partition(":")
    return name, {k: yaml.safe_load(v) for k, v in (i.split("=") for i in items.split(",") if i)}


def gather(t: torch.Tensor, group: object) -> list[torch.Tensor]:
    """Every rank's T in GROUP, in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def unzigzag(parts: list[torch.Tensor]) -> torch.Tensor:
    """CP rank r holds sequence chunks r and 2*CP-1-r (Megatron's load balancing); put them back in order."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * cp - 1 - r] = part.chunk(2, dim=1)
    return torch.cat(chunks, dim=1)  # type: ignore[arg-type]


def megatron_logits(exp: object, mcore_dir: Path) -> torch.Tensor | None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_batch_on_this_cp_rank

    t = build(exp)
    checkpoint.load_weights(checkpoint.latest(mcore_dir) or mcore_dir, t.model)
    for chunk in t.model:
        chunk.eval()
    captured: list[torch.Tensor] = []

    def forward_step(it: object, model: object) -> tuple[torch.Tensor, object]:
        batch = next(it)
        if ps.get_context_parallel_world_size() > 1:
            batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group())
        out = model(batch["tokens"], batch["position_ids"], attention_mask=None)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            captured.append(output.detach().float())
            return output.sum() * 0, {}

        return out, loss_func

    micro = exp.parallel.pp  # the interleaved schedule needs at least PP micro-batches; the first is compared
    data = [batches(MockDataset(SEED, t.spec.vocab_size, SEQ), MBS, 0, 0, 1) for _ in t.model]
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data if len(data) > 1 else data[0],
                                    model=t.model, num_microbatches=micro, seq_length=SEQ, micro_batch_size=MBS,
                                    forward_only=True)
    logits = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        local = captured[0]  # [batch, local sequence, vocab / TP] of the first micro-batch
        logits = torch.cat(gather(local, ps.get_tensor_model_parallel_group()), dim=-1)
        if ps.get_context_parallel_world_size() > 1:
            logits = unzigzag(gather(logits, ps.get_context_parallel_group()))
        logits = logits[..., : t.spec.vocab_size]
        report = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
                  and ps.get_data_parallel_rank() == 0)
        logits = logits if report else None
    return logits


def main() -> int:
    hf_dir, mcore_dir, out_dir, layout = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    dtype = sys.argv[5] if len(sys.argv) > 5 else "fp32"
    out_dir.mkdir(parents=True, exist_ok=True)
    name, parallel = parse_layout(layout)
    cfg = {"name": f"logits-{name}", "model": {"hf_config": str(hf_dir)}, "precision": {"dtype": dtype},
           "parallel": parallel, "data": {"seq_length": SEQ, "seed": SEED},
           "schedule": {"train_iters": 1, "warmup_iters": 0, "micro_batch_size": MBS, "global_batch_size": MBS * 2}}
    path = out_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    logits = megatron_logits(load_experiment(path), mcore_dir)
    if logits is not None:  # transformers on the same tokens, with convert/'s own logits check
        logits = logits.cpu()
        tokens = next(batches(MockDataset(SEED, logits.shape[-1], SEQ), MBS, 0, 0, 1, device="cpu"))["tokens"]
        reference = hf_logits(hf_dir, tokens)
        report = compare_logits(reference, logits)
        top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()  # every position, near-ties too
        result = {"layout": name, "parallel": parallel, "dtype": dtype, "max_abs": report.max_abs_diff,
                  "mean_abs": report.mean_abs_diff, "cosine": report.cosine, "top1": top1, "shape": list(logits.shape)}
        print("LOGITS " + json.dumps(result), flush=True)
        (out_dir / f"{name}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
