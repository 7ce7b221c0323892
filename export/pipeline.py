"""Megatron or HF checkpoint -> TensorRT-LLM (target pytorch or engine), staged and renamed when complete.

Everything that can be checked before writing is checked first (parallel sizes against the model, the output
path against the inputs, calibration data); the output is built in a staged folder that becomes OUT only when
complete, so a failure or a kill never leaves a complete-looking export.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from mcorekit.convert.hf_io import HFReader
from mcorekit.convert.pipeline import (Summary, find_iteration_dir, hf_config_for, mcore_to_hf, plan_from_hf,
                                       refuse_lora_checkpoint, spec_for, with_hf_mtp)
from mcorekit.errors import ExportError, OutputError
from mcorekit.export import fp8, targets
from mcorekit.models import dtypes, registry
from mcorekit.models.mapping import Ctx
from mcorekit.models.parallel import Layout
from mcorekit.models.spec import ModelSpec
from mcorekit.outputs import check_output, staged_output

# A Megatron source is converted to HF inside the staged output: same filesystem as OUT (never a small /tmp),
# removed with the stage on failure, and a killed run's stage is removed by the next run.
SOURCE_HF = ".source-hf"


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def megatron_config(src: Path, hf_config: str | None) -> tuple[dict[str, Any], Path | None]:
    """The HF config (and the folder with its tokenizer) that a Megatron checkpoint is converted with."""
    iter_dir = find_iteration_dir(src)
    refuse_lora_checkpoint(src, iter_dir, ", then export OUT")
    config, *_, tokenizer_dir = hf_config_for(src if iter_dir != src else src.parent, hf_config)
    return config, tokenizer_dir


def check_hf_weights(reader: HFReader, spec: ModelSpec, dtype: str) -> None:
    """Every tensor of an HF source against its config, from the shard headers (names, shapes, dtypes, nothing
    unmapped): what hf-to-mcore checks before it writes. The vocabulary padding does not matter here, and the
    export casts to `dtype`, so tensors of one mapping may mix dtypes."""
    spec = with_hf_mtp(reader, spec)
    plan_from_hf(reader, spec, registry.weight_map(spec), Ctx(spec, spec.vocab_size), dtypes.to_torch(dtype))


def export(src: str | Path, out: str | Path, target: str, tp: int = 1, pp: int = 1, ep: int = 1, dtype: str = "bf16",
           use_fp8: bool = False, calib: str | None = None, hf_config: str | None = None, force: bool = False,
           quiet: bool = False) -> Summary:
    start = time.monotonic()
    src, out = Path(src), Path(out)
    writer = targets.writer(target)  # an unknown target is an ExportError naming the known ones
    if dtype not in dtypes.NAMES:
        raise ExportError(f"unknown dtype {dtype!r}; use one of {', '.join(dtypes.NAMES)}")
    if calib and not use_fp8:
        raise ExportError("--calib is the FP8 calibration data: add --fp8, or drop --calib for a bf16/fp16 export")
    megatron = not is_hf_dir(src)
    reader = None if megatron else HFReader(src)
    config, tokenizer_dir = megatron_config(src, hf_config) if megatron else (reader.config, src)
    # every folder read, the one the HF config and tokenizer come from included: --force must not replace it
    inputs = [Path(p) for p in (src, hf_config, calib, tokenizer_dir) if p]
    check_output(out, inputs, force)  # before a long conversion, not after it
    spec = spec_for(config)
    if reader is not None:  # an HF source is checked as hf-to-mcore checks it (a Megatron one is, by mcore_to_hf)
        check_hf_weights(reader, spec, dtype)
    layout = Layout(tp=tp, pp=pp, ep=ep)
    targets.check_layout(spec, layout)  # every target: TensorRT-LLM splits the model the same way
    if hasattr(writer, "check"):
        writer.check(spec, layout)
    samples = None
    if use_fp8:
        if spec.is_moe:
            raise ExportError("FP8 export of MoE models is not supported yet (expert activations need per-expert "
                              "calibration); export MoE models in bf16/fp16")
        if problem := fp8.shape_problem(spec, layout.tp):
            raise ExportError(problem)
        if not calib:
            raise ExportError("FP8 needs activation scales and this checkpoint carries none: pass --calib FILE "
                              "(JSON lines with input_ids or text) for a calibration pass")
        samples = fp8.read_calibration(calib, tokenizer_dir, spec.vocab_size)
    summary = Summary()
    with staged_output(out, force, inputs, command=f"export trtllm --target {target}") as stage:
        try:
            if megatron:  # through convert/ first (streaming, verified mappings)
                mcore_to_hf(src, stage / SOURCE_HF, hf_config=hf_config, quiet=quiet)
                reader = HFReader(stage / SOURCE_HF)
            summary.bytes = _write(writer, reader, spec, stage, layout, dtype, samples, out)
        finally:
            if reader is not None:
                reader.close()
        shutil.rmtree(stage / SOURCE_HF, ignore_errors=True)
    summary.seconds = time.monotonic() - start
    return summary


def _write(writer: Any, reader: HFReader, spec: Any, stage: Path, layout: Layout, dtype: str, samples: list | None,
           out: Path) -> int:
    scales = None
    if samples is not None:
        amax = fp8.calibrate(reader.path, samples)
        weights = {m: reader.get(f"{m}.weight") for m in fp8.linear_modules(reader, spec)}
        scales = fp8.linear_scales(amax, weights, registry.weight_map(spec).fused_hf_modules(spec))
    try:
        return writer.write(reader, spec, stage, layout, dtype, scales)
    except SafetensorError as e:  # safetensors reports a full or read-only disk as its own error type
        raise OutputError(f"cannot write {out}: {e}; nothing was written there") from None
    except OSError as e:  # a full disk, or a file that vanished under us: what and where, OUT left untouched
        where = f"{e.filename}: " if e.filename else ""
        raise OutputError(f"export to {out} failed: {where}{e.strerror or e}; nothing was written there") from None
