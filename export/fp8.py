"""Per-tensor FP8 (e4m3) quantization of linear weights, and activation scales from a calibration pass.

Weight scale = amax(|W|) / 448, stored as fp32; W_fp8 = (W / scale) cast to float8_e4m3fn. Layers that
TensorRT-LLM fuses (q/k/v, gate/up) share one weight scale and one input scale (the max of theirs), so the
fused GEMM is exact to the same rounding. Activation scales come from a calibration pass: the HF model runs on
user-supplied token sequences on CPU and every linear's input amax is recorded (amax / 448). Without
calibration data there are no activation scales, and FP8 export refuses to guess.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mcorekit.errors import ExportError

E4M3_MAX = 448.0
# HF linear names that TensorRT-LLM fuses into one GEMM: they must share scales.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def weight_scale(*weights: torch.Tensor) -> torch.Tensor:
    amax = max(w.detach().abs().max().float().item() for w in weights)
    return torch.tensor(max(amax, 1e-12) / E4M3_MAX, dtype=torch.float32)


def quantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def read_calibration(path: str | Path, hf_dir: str | Path, max_samples: int = 64) -> list[torch.Tensor]:
    """JSON lines, each {"input_ids": [...]} or {"text": "..."} (text needs the model's tokenizer files)."""
    samples: list[torch.Tensor] = []
    tokenizer = None
    for line in Path(path).read_text().splitlines()[:max_samples]:
        if not line.strip():
            continue
        row = json.loads(line)
        if "input_ids" in row:
            samples.append(torch.tensor(row["input_ids"], dtype=torch.long))
        elif "text" in row:
            if tokenizer is None:
                import transformers

                try:
                    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
                except Exception as e:  # noqa: BLE001
                    raise ExportError(f"calibration text needs a tokenizer in {hf_dir}: {e}") from None
            samples.append(torch.tensor(tokenizer(row["text"])["input_ids"][:2048], dtype=torch.long))
        else:
            raise ExportError(f"{path}: each line needs 'input_ids' or 'text'")
    if not samples:
        raise ExportError(f"{path}: no calibration samples")
    return samples


def calibrate(hf_dir: str | Path, samples: list[torch.Tensor]) -> dict[str, float]:
    """Input amax of every nn.Linear (by HF module name), over the calibration samples, in fp32 on CPU."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(mod: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor, name: str = name) -> None:
                amax[name] = max(amax.get(name, 0.0), inputs[0].detach().abs().max().item())
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for ids in samples:
            model(ids.unsqueeze(0))
    for h in hooks:
        h.remove()
    return amax


def linear_scales(amax: dict[str, float], weights: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF linear module name -> (weight scale, input scale), fused groups sharing both."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, w in weights.items():
        if module in out:
            continue
        parent, _, leaf = module.rpartition(".")
        group = next((g for g in FUSED_GROUPS if leaf in g), (leaf,))
        members = [f"{parent}.{m}" for m in group if f"{parent}.{m}" in weights]
        missing = [m for m in members if m not in amax]
        if missing:
            raise ExportError(f"no calibration statistics for {missing[0]} (was it reached by the calibration pass?)")
        w_scale = weight_scale(*(weights[m] for m in members))
        a_scale = torch.tensor(max(max(amax[m] for m in members), 1e-12) / E4M3_MAX, dtype=torch.float32)
        for m in members:
            out[m] = (w_scale, a_scale)
    return out
