"""The one dtype table: our short names (experiment precision.dtype, every --dtype flag) and the name torch, HF
configs (`dtype` / `torch_dtype`) and TensorRT-LLM configs use for each. Importing it does not import torch, so
the CLIs list the choices in --help without it; models/megatron.py's DTYPES (torch dtypes) derives from it."""

from __future__ import annotations

from typing import Any

# short name -> torch / HF / TensorRT-LLM name
NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def to_torch(name: str) -> Any:
    """The torch dtype of a short name (KeyError for an unknown one)."""
    import torch

    return getattr(torch, NAMES[name])


def from_config(config_name: object) -> str | None:
    """The short name of an HF config's dtype string ("bfloat16" -> "bf16"), None for anything else."""
    return next((short for short, full in NAMES.items() if full == config_name), None)


def of_torch(dtype: Any) -> str:
    """The HF / TensorRT-LLM name of a torch dtype we support (KeyError for another)."""
    name = str(dtype).removeprefix("torch.")
    if name not in NAMES.values():
        raise KeyError(name)
    return name
