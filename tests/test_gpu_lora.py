"""On the GPU machine: SFT + LoRA (train/lora.py, TE spec, bf16) from an HF-converted model: the loss falls while
every base tensor stays bitwise as loaded, the checkpoint holds only the adapters (size printed), the exported PEFT
adapter on the HF model gives the Megatron model's logits, and --merge equals PEFT's merge_and_unload().

    cd /tmp && python3 -m pytest /path/to/checkout/tests/test_gpu_lora.py -v -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from test_gpu_train import BASE, converted_llama, run, sft_config  # noqa: E402

LORA = {"rank": 16, "alpha": 32.0, "target_modules": ["qkv", "proj", "fc1", "fc2"]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    from hf_models import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_sft_lora_trains_adapters_only_and_exports_to_peft(tmp_path: Path, tokenizer: Path) -> None:
    import torch
    import transformers

    from mcorekit.convert import lora
    from mcorekit.convert.torch_dist import TorchDistReader
    from mcorekit.train.lora import is_adapter_key

    converted_llama(tmp_path)  # tmp/hf (fp32, random) and tmp/mcore (its release)
    cfg = sft_config(tmp_path, tokenizer, packing=False)
    cfg = {**cfg, "name": "sft-lora", "model": {"hf_config": str(tmp_path / "hf")}, "peft": {"lora": LORA},
           "optimizer": {"lr": 2e-3, "min_lr": 2e-4, "weight_decay": 0.0},
           "checkpoint": {"load": str(tmp_path / "mcore"), "save_interval": 1000, "keep_last": 2}}
    run_dir = tmp_path / "lora"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, str(HERE / "gpu_lora_driver.py"), str(run_dir / "config.yaml"), str(run_dir),
                           str(tmp_path / "mcore/release")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])})
    print(proc.stdout[-2000:])
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("LORA ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-5000:]
    got = json.loads(line[5:])
    assert got["base_bitwise_unchanged"] and got["base_tensors"] > 20  # every base tensor as loaded, after training
    assert got["trainable"] < got["frozen"] / 10
    # TE hands the adapters of qkv/fc1 its normalised input: same loss and gradients as recomputing the norm
    print(f"adapter input from TE's norm vs recomputed: loss {got['loss_te_norm']:.6f} vs "
          f"{got['loss_recomputed_norm']:.6f}, adapter gradient cosine {got['adapter_grad_cosine']:.6f} "
          f"({got['norm_layers']} LayerNormLinear layers)")
    assert got["norm_layers"] > 0 and abs(got["loss_te_norm"] - got["loss_recomputed_norm"]) < 1e-2
    assert got["adapter_grad_cosine"] > 0.999
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in m if "loss" in x]
    print("LoRA losses:", [round(x, 4) for x in losses[::5]])
    assert losses[-1] < losses[0] - 0.3

    ckpt = run_dir / "checkpoints"
    final = ckpt / f"iter_{BASE['schedule']['train_iters']:07d}"
    stored = TorchDistReader(final).tensor_keys()
    model_keys = [k for k in stored if k.startswith(("decoder.", "embedding.", "output_layer."))]
    assert model_keys and all(is_adapter_key(k) for k in model_keys)  # no base weight in the checkpoint
    size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
    base_size = sum(f.stat().st_size for f in (tmp_path / "mcore/release").rglob("*") if f.is_file())
    print(f"LoRA checkpoint {size / 1e6:.2f} MB (adapters + optimizer state), base model {base_size / 1e6:.2f} MB")

    lora.mcore_to_peft(ckpt, tmp_path / "adapter", hf_config=str(tmp_path / "hf"))
    import peft
    from safetensors.torch import load_file

    ref = load_file(str(run_dir / "logits.safetensors"))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).cuda().eval()
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        hf_logits = model(ref["ids"].cuda()).logits.float().cpu()
    cosine = torch.nn.functional.cosine_similarity(hf_logits.flatten().double(), ref["on"].flatten().double(), dim=0)
    print(f"HF+PEFT vs Megatron+LoRA logits: cosine {cosine.item():.6f}, max |diff| "
          f"{(hf_logits - ref['on']).abs().max().item():.4f}")
    assert cosine >= 0.9999

    lora.mcore_to_hf_merged(ckpt, tmp_path / "merged", base=str(tmp_path / "mcore"), hf_config=str(tmp_path / "hf"),
                            dtype="bf16", quiet=True)
    merged = model.merge_and_unload().state_dict()
    from mcorekit.convert.hf_io import HFReader

    reader, unmerged = HFReader(tmp_path / "merged"), HFReader(tmp_path / "hf")
    worst = 0.0
    for name in reader.names():
        ours, theirs = reader.get(name).float(), merged[name].float().cpu()
        # Both are bf16 merges: PEFT rounds the product B @ A and then the sum, we round the sum once. Each rounding
        # is within 2^-8 of its value, so the two agree to 2^-6 of the larger of the base weight and the result (a
        # result near zero after cancellation can differ by one ulp of the base weight: relative to the result
        # alone that was 6e-2 on 2026-12-01).
        scale = torch.maximum(unmerged.get(name).float().abs(), theirs.abs()).clamp_min(1e-12)
        worst = max(worst, ((ours - theirs).abs() / scale).max().item())
    print(f"merged vs merge_and_unload: worst difference {worst:.2e} of max(|base weight|, |merged|)")
    assert worst <= 2 ** -6  # within bf16 rounding of the two merge orders


def test_lora_dropout_resume_reproduces_losses(tmp_path: Path, tokenizer: Path) -> None:
    """LoRA with dropout, stopped by a signal after step 6 and resumed: each step's random streams are seeded from
    data.seed and the step (train/build.seed_step), so the resumed steps draw the masks of the run that was not
    interrupted and give its losses. The same pair with the per-step seeding switched off (the driver's
    GPU_TEST_STEP_SEED=off, as before seed_step) draws other masks after the resume, and its losses drift from its
    own uninterrupted run: the comparison can fail."""
    converted_llama(tmp_path)
    cfg = sft_config(tmp_path, tokenizer, packing=False)
    cfg = {**cfg, "name": "lora-dropout", "model": {"hf_config": str(tmp_path / "hf")},
           "peft": {"lora": {**LORA, "dropout": 0.5}}, "optimizer": {"lr": 2e-3, "min_lr": 2e-4, "weight_decay": 0.0},
           "schedule": {**cfg["schedule"], "train_iters": 12},
           "checkpoint": {"load": str(tmp_path / "mcore"), "save_interval": 1000, "keep_last": 2}}
    gaps = {}
    for name, env in (("seeded", {}), ("unseeded", {"GPU_TEST_STEP_SEED": "off"})):
        full = [x for x in run(tmp_path, f"{name}-full", cfg, env=env) if "loss" in x]
        run(tmp_path, name, cfg, stop_at=6, expect=3, env=env)
        resumed = [x for x in run(tmp_path, name, cfg, env=env) if "loss" in x and x["step"] > 6]
        assert [x["step"] for x in resumed] == list(range(7, 13))
        gaps[name] = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(resumed, full[6:]))
    print(f"LoRA dropout 0.5, resumed after step 6: largest relative loss difference to the uninterrupted run "
          f"{gaps['seeded']:.2e} seeded per step, {gaps['unseeded']:.2e} without")
    assert gaps["seeded"] <= 1e-3  # the other resume tests' tolerance
    assert gaps["unseeded"] > max(1e-4, 10 * gaps["seeded"])
