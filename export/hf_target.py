"""Target `pytorch` (today's TensorRT-LLM): HF-format weights and config, tokenizer files, and for FP8 the
ModelOpt-style per-tensor FP8 checkpoint (`weight` in float8_e4m3fn, `weight_scale`, `input_scale`) with
`hf_quant_config.json` and `quantization_config` in config.json, which TensorRT-LLM's loader reads. An
`llm_api_options.yaml` carries the parallel sizes for `trtllm-serve --extra_llm_api_options`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import yaml

from mcorekit.convert.hf_io import HFReader, HFWriter, copy_assets
from mcorekit.convert.pipeline import with_hf_mtp
from mcorekit.export import fp8
from mcorekit.models import dtypes, registry
from mcorekit.models.parallel import Layout
from mcorekit.models.spec import ModelSpec

EXCLUDED = ("lm_head",)  # kept in the model dtype, as ModelOpt does


def keep_dtype_names(spec: ModelSpec) -> set[str]:
    """HF tensors served in their own dtype whatever --dtype says (DeepSeek's fp32 router and its bias)."""
    amap = registry.weight_map(spec)
    return {n for m in amap.mappings if m.keep_dtype for index in m.slices(spec) for n in m.hf_names_at(index)}


def write(reader: HFReader, spec: ModelSpec, out: Path, layout: Layout, dtype: str,
          scales: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> int:
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    torch_dtype = dtypes.to_torch(dtype)
    with HFWriter(out) as writer:  # on an error, its queued writes end before the staged output is removed
        quantized = set(scales or {})
        keep = keep_dtype_names(with_hf_mtp(reader, spec))  # DeepSeek's MTP layers hold an fp32 router too
        for name in reader.names():
            t = reader.get(name)
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            if module in quantized:
                w_scale, a_scale = scales[module]
                writer.add(name, fp8.quantize(t, w_scale))
                writer.add(f"{module}.weight_scale", w_scale.clone())
                writer.add(f"{module}.input_scale", a_scale.clone())
            else:
                writer.add(name, t.to(torch_dtype) if t.is_floating_point() and name not in keep else t)
        writer.finish()
    copy_assets(reader.path, out)
    config = dict(reader.config)
    config["dtype"] = dtypes.NAMES[dtype]
    stale = config.pop("quantization_config", None)
    if stale is not None and not scales:  # a loader would read these bf16/fp16 weights as quantized
        method = stale.get("quant_method") if isinstance(stale, dict) else None
        print(f"mcorekit: warning: the source config.json has a quantization_config (quant_method {method!r}) but "
              f"these weights are {dtypes.NAMES[dtype]}: it is left out of the exported config.json", file=sys.stderr)
    if scales:
        quant = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": list(EXCLUDED)}
        (out / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "mcorekit"}, "quantization": quant}, indent=2) + "\n")
        config["quantization_config"] = {"quant_method": "modelopt", **quant}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    options = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "moe_expert_parallel_size": ep}
    (out / "llm_api_options.yaml").write_text(
        "# trtllm-serve <this dir> --extra_llm_api_options llm_api_options.yaml\n" + yaml.safe_dump(options, sort_keys=False))
    return writer.total_bytes
