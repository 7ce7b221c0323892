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
from typing import Any, Iterable

import torch

from mcorekit.convert.hf_io import HFReader
from mcorekit.convert.pipeline import hf_slice_shapes
from mcorekit.errors import ExportError, first_line
from mcorekit.models import registry
from mcorekit.models.mapping import HF_SPLIT_DIM, QKV, REPLICATED, Ctx, VocabRows
from mcorekit.models.spec import ModelSpec

E4M3_MAX = 448.0
ALIGN = 16  # torch._scaled_mm and TensorRT-LLM's FP8 GEMMs need both dims of a weight to be multiples of 16


def linear_modules(reader: HFReader, spec: ModelSpec) -> list[str]:
    """HF modules whose weights get quantized: the decoder's linear layers as the family's weight map names them
    (not norms, routers or gates, embeddings or the head), where the checkpoint has them."""
    present = set(reader.names())
    return [m for m in registry.weight_map(spec).linear_hf_modules(spec) if f"{m}.weight" in present]


def shape_problem(spec: ModelSpec, tp: int) -> str | None:
    """The first weight FP8 would quantize whose per-rank shape (split over `tp` as TensorRT-LLM splits it; K and V
    rows are one head when there are fewer KV heads than ranks) is not a multiple of ALIGN in both dims."""
    amap = registry.weight_map(spec)
    ctx = Ctx(spec, spec.vocab_size)
    for m in amap.mappings:
        if m.split == REPLICATED or isinstance(m, VocabRows) or not m.slices(spec):
            continue  # what linear_hf_modules leaves out: never quantized
        names = m.hf_names_at(m.slices(spec)[0])
        for i, (name, shape) in enumerate(zip(names, hf_slice_shapes(m, m.mcore_shape(ctx), ctx))):
            if not name.endswith(".weight") or len(shape) != 2:
                continue
            local = list(shape)
            dim = HF_SPLIT_DIM[m.split]
            if isinstance(m, QKV) and i > 0 and spec.num_query_groups < tp:
                local[0] = spec.kv_channels
            else:
                local[dim] //= tp
            if any(n % ALIGN for n in local):
                return (f"FP8 needs every quantized weight to be a multiple of {ALIGN} in both dims on each rank (FP8 "
                        f"GEMMs require it), but {name} is {local[0]}x{local[1]} per rank at TP={tp} (of "
                        f"{shape[0]}x{shape[1]}); export this model without --fp8 (bf16/fp16)")
    return None


def weight_scale(*weights: torch.Tensor) -> torch.Tensor:
    amax = max(w.detach().abs().max().float().item() for w in weights)
    return torch.tensor(max(amax, 1e-12) / E4M3_MAX, dtype=torch.float32)


def quantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


MAX_LINE_BYTES = 16 * 1024**2  # a calibration sample is at most a few thousand tokens; longer lines are a wrong file
MAX_TOKENS = 2048


def read_calibration(path: str | Path, tokenizer_dir: str | Path | None, vocab_size: int,
                     max_samples: int = 64) -> list[torch.Tensor]:
    """JSON lines, each {"input_ids": [...]} or {"text": "..."} (text needs the model's tokenizer files); every id
    must lie in the model's vocabulary. Bad lines fail as `FILE:LINE: what is wrong`."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path}: calibration file not found (JSON lines with input_ids or text)")
    samples: list[torch.Tensor] = []
    tokenizer = None
    with open(path, "rb") as f:
        for n, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(samples) == max_samples:
                break
            row = _json_line(raw, f"{path}:{n}")
            if row is None:
                continue
            if "input_ids" in row:
                ids = row["input_ids"]
            elif "text" in row:
                if not isinstance(row["text"], str):
                    raise ExportError(f"{path}:{n}: 'text' must be a string")
                tokenizer = tokenizer or _tokenizer(tokenizer_dir)
                ids = tokenizer(row["text"])["input_ids"]
            else:
                raise ExportError(f"{path}:{n}: each line needs 'input_ids' or 'text' (got keys {sorted(row)[:5]})")
            samples.append(torch.tensor(_checked_ids(ids, vocab_size, f"{path}:{n}")[:MAX_TOKENS], dtype=torch.long))
    if not samples:
        raise ExportError(f"{path}: no calibration samples")
    return samples


def _json_line(raw: bytes, where: str) -> dict | None:
    """One JSON-object line, or None for a blank one."""
    if len(raw) > MAX_LINE_BYTES:
        raise ExportError(f"{where}: line longer than {MAX_LINE_BYTES // 1024**2} MB; calibration lines hold one "
                          f"sample of at most {MAX_TOKENS} tokens")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ExportError(f"{where}: not UTF-8 text (byte {e.start}); calibration data is JSON lines") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ExportError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    except RecursionError:
        raise ExportError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ExportError(f"{where}: not valid JSON ({first_line(e)})") from None
    if not isinstance(row, dict):
        raise ExportError(f"{where}: expected a JSON object with 'input_ids' or 'text', got {type(row).__name__}")
    return row


def _checked_ids(ids: object, vocab_size: int, where: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise ExportError(f"{where}: input_ids must be a non-empty list of token ids")
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size:
            raise ExportError(f"{where}: token id {i!r} is outside the model's vocabulary [0, {vocab_size}); "
                              f"calibrate with ids of this model's tokenizer")
    return ids


def _tokenizer(tokenizer_dir: str | Path | None) -> Any:
    import transformers

    if tokenizer_dir is None:
        raise ExportError("calibration text needs the model's tokenizer, and none is stored with this checkpoint; "
                          "pass input_ids instead, or --hf-config with an HF directory that has the tokenizer")
    try:
        return transformers.AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001  (transformers raises many types for a missing or broken tokenizer)
        raise ExportError(f"calibration text needs a tokenizer in {tokenizer_dir}: {first_line(e)}") from None


def calibrate(hf_dir: str | Path, samples: list[torch.Tensor]) -> dict[str, float]:
    """Input amax of every nn.Linear (by HF module name), over the calibration samples, in fp32 on CPU."""
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                                  trust_remote_code=False).eval()
    except Exception as e:  # noqa: BLE001  (transformers raises many types for a model it cannot load)
        raise ExportError(f"{hf_dir}: transformers cannot load the model for the calibration pass: {first_line(e)}") from None
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


def linear_scales(amax: dict[str, float], weights: dict[str, torch.Tensor],
                  fused: Iterable[tuple[str, ...]] = ()) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF linear module name -> (weight scale, input scale); the modules of a `fused` group (those TensorRT-LLM
    runs as one GEMM, from the weight map: q/k/v, gate/up) share both."""
    group_of = {m: group for group in fused for m in group}
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, w in weights.items():
        if module in out:
            continue
        members = [m for m in group_of.get(module, (module,)) if m in weights]
        missing = [m for m in members if m not in amax]
        if missing:
            raise ExportError(f"no calibration statistics for {missing[0]} (was it reached by the calibration pass?)")
        w_scale = weight_scale(*(weights[m] for m in members))
        a_scale = torch.tensor(max(max(amax[m] for m in members), 1e-12) / E4M3_MAX, dtype=torch.float32)
        for m in members:
            out[m] = (w_scale, a_scale)
    return out
