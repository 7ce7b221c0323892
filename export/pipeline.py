"""Megatron or HF checkpoint -> TensorRT-LLM (target pytorch or engine), staged and renamed when complete."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from mcorekit.convert.hf_io import HFReader, copy_assets
from mcorekit.convert.pipeline import DTYPES, Summary, mcore_to_hf, spec_for, staged_output
from mcorekit.errors import ExportError
from mcorekit.export import engine, fp8, hf_target

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def export(src: str | Path, out: str | Path, target: str, tp: int = 1, pp: int = 1, ep: int = 1, dtype: str = "bf16",
           use_fp8: bool = False, calib: str | None = None, hf_config: str | None = None, force: bool = False,
           quiet: bool = False) -> Summary:
    start = time.monotonic()
    src, out = Path(src), Path(out)
    if target not in ("pytorch", "engine"):
        raise ExportError(f"unknown target {target!r}; use pytorch (today's TensorRT-LLM) or engine (<= 1.2)")
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    # A Megatron source is converted to HF next to the output (same filesystem, never a small /tmp).
    with tempfile.TemporaryDirectory(prefix=".mcorekit-export-", dir=out.resolve().parent) as tmp:
        if is_hf_dir(src):
            hf_dir = src
        else:  # a Megatron checkpoint: through convert/ first (streaming, verified mappings)
            hf_dir = Path(tmp) / "hf"
            mcore_to_hf(src, hf_dir, hf_config=hf_config, quiet=quiet)
        reader = HFReader(hf_dir)
        spec = spec_for(reader.config)
        if target == "engine":
            engine.check_layout(spec, tp, pp, ep)
        scales = None
        if use_fp8:
            if spec.is_moe:
                raise ExportError("FP8 export of MoE models is not supported yet (expert activations need per-expert "
                                  "calibration); export MoE models in bf16/fp16")
            if not calib:
                raise ExportError("FP8 needs activation scales and this checkpoint carries none: pass --calib FILE "
                                  "(JSON lines with input_ids or text) for a calibration pass")
            amax = fp8.calibrate(hf_dir, fp8.read_calibration(calib, hf_dir))
            modules = hf_target.linear_modules(reader)
            scales = fp8.linear_scales(amax, {m: reader.get(f"{m}.weight") for m in modules})
        summary = Summary()
        with staged_output(out, force) as stage:
            if target == "pytorch":
                summary.bytes = hf_target.write(reader, stage, tp, pp, ep, DTYPES[dtype], scales)
            else:
                summary.bytes = engine.write(reader, spec, stage, tp, pp, ep, DTYPES[dtype], DTYPE_NAMES[dtype], scales)
                (stage / "hf").mkdir()
                copy_assets(hf_dir, stage / "hf")  # tokenizer for serving the engine
        reader.close()
    summary.seconds = time.monotonic() - start
    return summary
