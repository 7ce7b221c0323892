"""On the GPU: does packing keep attention within each example? usage: gpu_packing_driver.py CONFIG
Builds train/'s model for an SFT-packing experiment, sharpens its random weights (so outputs depend strongly
on context), and compares per-token losses of one packed sequence (a) with the packed-sequence boundaries,
(b) as one plain causal sequence (attention crosses examples: the control), against (c) each example run alone.
Prints `PACKING {"packed": max|a-c|, "leaky": max|b-c|}`."""

from __future__ import annotations

import json
import os
import sys

from single_rank import single_rank_env  # noqa: E402  (this folder is on sys.path: the driver runs as a script)

for key, value in single_rank_env().items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402

from mcorekit.config.experiment import load_experiment  # noqa: E402
from mcorekit.train.build import build  # noqa: E402
from mcorekit.train.data import build_dataset  # noqa: E402


def main() -> int:
    from megatron.core.packed_seq_params import PackedSeqParams

    exp = load_experiment(sys.argv[1])
    t = build(exp)
    model = t.model[0].eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    sample = build_dataset(exp, t.spec, __import__("pathlib").Path(sys.argv[2]))[0]
    cu = sample["cu_seqlens"].cuda()
    tokens, labels, pos = (sample[k].cuda().unsqueeze(0) for k in ("tokens", "labels", "position_ids"))
    n = int(sample["max_seqlen"])
    with torch.no_grad():
        packed = model(tokens, pos, None, labels=labels, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n))[0].float()
        leaky = model(tokens, torch.arange(tokens.size(1), device="cuda").unsqueeze(0), None, labels=labels)[0].float()
        bounds = cu.tolist()
        d_packed = d_leaky = 0.0
        segments = 0
        for a, b in zip(bounds, bounds[1:]):
            if sample["loss_mask"][a:b].sum() == 0:
                continue  # end-of-bin padding
            alone = model(tokens[:, a:b], torch.arange(b - a, device="cuda").unsqueeze(0), None,
                          labels=labels[:, a:b])[0].float()
            d_packed = max(d_packed, (packed[a:b] - alone).abs().max().item())
            d_leaky = max(d_leaky, (leaky[a:b] - alone).abs().max().item())
            segments += 1
    print("PACKING " + json.dumps({"packed": d_packed, "leaky": d_leaky, "segments": segments}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
