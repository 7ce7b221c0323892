"""Run as a script on one GPU: train a LoRA experiment with the real loop (train/loop.py), then, in the same process,
compare every base tensor of the trained model with the base checkpoint bitwise and write the Megatron logits on
fixed ids. Prints `LORA {json}`. Used by test_gpu_lora.py.

    python gpu_lora_driver.py CONFIG.yaml RUN_DIR BASE_RELEASE
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from single_rank import single_rank_env  # noqa: E402  (this folder is on sys.path: the driver runs as a script)

os.environ.update(single_rank_env())

import torch  # noqa: E402


def main(config: str, run_dir: str, base: str) -> None:
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    from mcorekit.config.experiment import load_experiment
    from mcorekit.train import checkpoint, loop
    from mcorekit.train.lora import is_adapter_key, parameter_counts

    exp = load_experiment(config)
    built = {}
    build = loop.build

    def keep(e, **kw):  # noqa: ANN001, ANN003, ANN202
        built["t"] = build(e, **kw)
        return built["t"]

    loop.build = keep
    loop.train(exp, Path(run_dir))
    t = built["t"]
    trainable, frozen = parameter_counts(t.model)
    model = checkpoint.unwrap(t.model[0])
    want = dist_checkpointing.load(checkpoint._model_state(t.model, checkpoint.BASE), base)
    have = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and not is_adapter_key(k)}
    compared = [k for k in have if torch.is_tensor(want.get(k)) and not k.endswith("_extra_state")]
    same = all(torch.equal(have[k], want[k].to(have[k].device, have[k].dtype)) for k in compared)
    ids = torch.randint(0, t.spec.vocab_size, (2, 64), generator=torch.Generator().manual_seed(5)).cuda()
    pos = torch.arange(ids.shape[1], device="cuda").unsqueeze(0).expand_as(ids)
    t.model[0].eval()
    with torch.no_grad():
        logits = t.model[0](ids, pos, attention_mask=None)[..., : t.spec.vocab_size].float().cpu()
    save_file({"ids": ids.cpu(), "on": logits.contiguous()}, str(Path(run_dir) / "logits.safetensors"))
    print("LORA " + json.dumps({"base_bitwise_unchanged": same, "base_tensors": len(compared),
                                "trainable": trainable, "frozen": frozen, **norm_paths_agree(t, ids, pos)}), flush=True)


def norm_paths_agree(t, ids: torch.Tensor, pos: torch.Tensor) -> dict:  # noqa: ANN001
    """The adapters' input on TE's LayerNormLinear layers taken from TE (return_layernorm_output, the default) vs
    recomputed (_fused_norm): loss and every adapter gradient on the same batch, each path once."""
    from mcorekit.train.lora import adapters

    norm_layers = [m for m in t.model[0].modules() if getattr(m, "return_layernorm_output", False)]
    params = [p for a in adapters(t.model) for p in (a.lora_a, a.lora_b)]
    out = {}
    for name, flag in (("te", True), ("recomputed", False)):
        for m in norm_layers:
            m.return_layernorm_output = flag
        logits = t.model[0](ids, pos, attention_mask=None)[..., : t.spec.vocab_size].float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        grads = torch.autograd.grad(loss, params)  # no DDP grad hooks: they fire on accumulation, not here
        out[name] = (loss.item(), torch.cat([g.flatten().double() for g in grads]))
    for m in norm_layers:
        m.return_layernorm_output = True
    cos = torch.nn.functional.cosine_similarity(out["te"][1], out["recomputed"][1], dim=0).item()
    return {"norm_layers": len(norm_layers), "loss_te_norm": out["te"][0], "loss_recomputed_norm": out["recomputed"][0],
            "adapter_grad_cosine": cos}


if __name__ == "__main__":
    main(*sys.argv[1:4])
