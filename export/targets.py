"""The export targets, in one place: what `mcorekit export trtllm --target` accepts, the line --help shows for
each, and the module that writes it. Importing this does not import torch (the CLIs list the targets in --help).

Every target is served by TensorRT-LLM, so every one checks its layout with TensorRT-LLM's rules (check_layout).
A target's module has `write(reader, spec, out, layout, dtype, scales) -> bytes written`: an HFReader over the HF
weights, the ModelSpec, the staged output folder, the served models.parallel.Layout (tp, pp, ep), a dtype name of
models/dtypes.py, and FP8 scales by HF linear module (None without FP8); and may have `check(spec, layout)`,
run before anything is written. Adding a target is adding its module and
one line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from mcorekit.errors import ExportError
from mcorekit.models.parallel import TENSORRT_LLM, Layout, layout_problems
from mcorekit.models.spec import ModelSpec


@dataclass(frozen=True)
class Target:
    name: str
    description: str  # one line, for --help
    module: str  # mcorekit.export.<module> writes it
    builds_engines: bool = False  # `mcorekit export engine` (trtllm-build) takes its output


TARGETS = {t.name: t for t in (
    Target("pytorch", "HF weights and config (+ ModelOpt FP8 checkpoint) for today's TensorRT-LLM (trtllm-serve)",
           "hf_target"),
    Target("engine", "config.json + rank{N}.safetensors per rank for trtllm-build (TensorRT-LLM <= 1.2)", "engine",
           builds_engines=True),
)}
NAMES = tuple(TARGETS)


def get(name: str) -> Target:
    if name not in TARGETS:
        raise ExportError(f"unknown target {name!r}; use " + " or ".join(f"{t.name} ({t.description})" for t in TARGETS.values()))
    return TARGETS[name]


def writer(name: str) -> ModuleType:
    """The module that writes target `name` (imports torch)."""
    return importlib.import_module(f"mcorekit.export.{get(name).module}")


def check_layout(spec: ModelSpec, layout: Layout) -> None:
    """TP/PP/EP must split the model the way TensorRT-LLM splits it (models/parallel.py, runtime tensorrt-llm)."""
    problems = layout_problems(spec, layout, TENSORRT_LLM)
    if problems:
        raise ExportError("layout does not fit the model: " + "; ".join(problems))
