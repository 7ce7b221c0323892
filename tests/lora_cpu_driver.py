"""Run as a script (one gloo process, CPU, local layer spec, fp32): load a converted base checkpoint into train/'s
Megatron model, add LoRA (train/lora.py) with random non-zero A and B, save the adapters as a LoRA run does
(train/checkpoint.py's adapter part + lora.json), and write the Megatron logits with adapters on and off. Prints
`LORA {json}` with parameter counts. Used by test_lora.py.

    python lora_cpu_driver.py BASE_CKPT HF_DIR OUT_DIR RANK ALPHA TARGETS(comma-separated)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(base: str, hf: str, out: str, rank: int, alpha: float, targets: list[str]) -> None:
    import torch.distributed as dist

    torch.cuda.current_device = lambda: "cpu"  # RotaryEmbedding.get_emb's device (see megatron_cpu_logits.py)
    torch.cuda.synchronize = lambda *a, **k: None  # Megatron's checkpoint writer syncs before it copies tensors
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("LORA_PORT", "29588"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from mcorekit.config.experiment import LoraConfig
    from mcorekit.convert.torch_dist import TorchDistReader
    from mcorekit.models.megatron import build_gpt, transformer_config
    from mcorekit.models.spec import from_hf_config, load_hf_config
    from mcorekit.train import checkpoint, lora

    ps.initialize_model_parallel(1, 1)
    spec = from_hf_config(load_hf_config(hf))
    padded = tuple(TorchDistReader(Path(base) / "release").tensor_keys()["embedding.word_embeddings.weight"].size)[0]
    model = build_gpt(spec, transformer_config(spec, cpu_init=True), padded, use_te=False).eval()
    cfg = LoraConfig(rank=rank, alpha=alpha, target_modules=targets)
    adapted = lora.apply_lora(model, cfg, spec, seed=7)
    model.mcorekit_lora = {"rank": rank, "alpha": alpha, "dropout": 0.0, "target_modules": targets, "experts": False,
                           "base": base, "model": spec.to_dict()}
    checkpoint.load_base(Path(base) / "release", [model])
    base_weights = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # B non-zero, so the adapters change the output
        for a in lora.adapters(model):
            a.lora_b.copy_(torch.randn(a.lora_b.shape, generator=g) * 0.05)
    trainable, frozen = lora.parameter_counts(model)
    frozen_ok = all(not p.requires_grad for n, p in model.named_parameters() if not lora.is_adapter_key(n))
    path = Path(out) / "ckpt" / "iter_0000001"
    path.mkdir(parents=True)
    (path / checkpoint.LORA_JSON).write_text(json.dumps(model.mcorekit_lora))
    dist_checkpointing.save(checkpoint._model_state([model], checkpoint.ADAPTERS), str(path))
    (path.parent / checkpoint.TRACKER).write_text("1")
    ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        on = model(ids, pos, attention_mask=None)[..., : spec.vocab_size].float()
        with lora.adapters_disabled([model]):
            off = model(ids, pos, attention_mask=None)[..., : spec.vocab_size].float()
    # a training step moves only the adapters
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss = model(ids, pos, attention_mask=None)[..., : spec.vocab_size].float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    unchanged = all(torch.equal(base_weights[k], v) for k, v in model.state_dict().items()
                    if torch.is_tensor(v) and not lora.is_adapter_key(k))
    save_file({"ids": ids, "on": on.contiguous(), "off": off.contiguous()}, str(Path(out) / "logits.safetensors"))
    sizes = {n: list(p.shape) for n, p in model.named_parameters() if lora.is_adapter_key(n)}
    print("LORA " + json.dumps({"adapted": adapted, "trainable": trainable, "frozen": frozen, "frozen_ok": frozen_ok,
                                "base_unchanged_after_step": unchanged, "sizes": sizes}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), sys.argv[6].split(","))
