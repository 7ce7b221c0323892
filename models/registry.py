"""The model registry: every architecture family we support, one file each in models/families/.

A family says once what it is to us (Megatron-Bridge's per-architecture bridge, torchtitan's state_dict adapter):
the HF `model_type`s it reads, how their config becomes a ModelSpec, the config features its map does not cover,
the HF <-> Megatron weight map (models/gpt_weights.py building blocks filled with its HF names), and the names
export targets need. convert/, export/ and models/spec.py read it; adding an architecture is adding one file to
models/families/ (found by its module-level FAMILY), or `register(...)` from elsewhere (tests).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

from mcorekit.errors import ModelError
from mcorekit.models.mapping import WeightMap
from mcorekit.models.spec import ModelSpec, decoder_field_problems


@dataclass(frozen=True)
class TensorRTLLM:
    """What TensorRT-LLM (<= 1.2, the engine target's rank files) calls this family."""

    architecture: str  # config.json "architecture", e.g. "LlamaForCausalLM"
    qwen_type: str | None = None  # QWenForCausalLM's variant


def _no_problems(config: dict[str, Any]) -> list[str]:
    return []


@dataclass(frozen=True)
class Family:
    name: str  # ModelSpec.architecture
    model_types: tuple[str, ...]  # the HF config model_type values it reads
    read: Callable[[dict[str, Any]], ModelSpec]  # HF config -> ModelSpec
    weights: Callable[[ModelSpec], WeightMap]  # the HF <-> Megatron weight map of one model
    problems: Callable[[dict[str, Any]], list[str]] = _no_problems  # config features the map does not cover
    trtllm: TensorRTLLM | None = None  # None: the engine target cannot express it
    no_engine: str = ""  # why not, when trtllm is None (the engine target's refusal says it)
    # PEFT 0.21's view of the family's HF modules: what it adapts for an adapter whose target_modules is null, and
    # whether under transformers 5 it moves the MLP's targets to the routed experts' fused weights (its MoE weight
    # conversion), so that a dense or shared-expert MLP adapter in PEFT's format is not what PEFT then loads
    peft_default_targets: tuple[str, ...] = ()
    peft_moves_mlp_to_experts: bool = False


_FAMILIES: dict[str, Family] = {}
_BUILTIN_LOADED = False


def _builtin() -> dict[str, Family]:
    global _BUILTIN_LOADED
    if not _BUILTIN_LOADED:
        _BUILTIN_LOADED = True
        from mcorekit.models import families

        for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda i: i.name):
            if not info.name.startswith("_"):
                register(importlib.import_module(f"{families.__name__}.{info.name}").FAMILY)
    return _FAMILIES


def families() -> dict[str, Family]:
    """Every registered family by name."""
    return dict(_builtin())


def register(family: Family) -> Family:
    """Add a family; its name and model types must be new."""
    known = _builtin()
    taken = {t: f.name for f in known.values() for t in f.model_types}
    clash = [t for t in family.model_types if t in taken]
    if family.name in known or clash:
        raise ValueError(f"family {family.name!r}: name or model types {clash} already registered")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    _builtin().pop(name, None)


def supported_model_types() -> list[str]:
    return sorted(t for f in _builtin().values() for t in f.model_types)


def family(name: str) -> Family:
    """The family of ModelSpec.architecture `name`."""
    found = _builtin().get(name)
    if found is None:
        raise ModelError(f"no model family {name!r}; known: {', '.join(sorted(_builtin()))}")
    return found


def for_config(config: dict[str, Any]) -> Family:
    """The family that reads this HF config (by its model_type)."""
    model_type = config.get("model_type")
    for f in _builtin().values():
        if model_type in f.model_types:
            return f
    raise ModelError(f"unsupported architecture model_type={model_type!r}; supported: {', '.join(supported_model_types())}")


def weight_map(spec: ModelSpec) -> WeightMap:
    return family(spec.architecture).weights(spec)


def config_problems(config: dict[str, Any]) -> list[str]:
    """What keeps an HF config from being read and converted, before any tensor is looked at: the fields every
    decoder reads, then what the GPTModel we build cannot express, then the family's own limits. An unknown
    model_type raises ModelError (the supported list)."""
    if not isinstance(config.get("model_type"), str):
        return [f"model_type={config.get('model_type')!r} is not a name"]
    out = decoder_field_problems(config)
    if out:
        return out
    found = for_config(config)
    if config.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act={config.get('hidden_act')!r} is not supported; supported: silu (SwiGLU)")
    if config.get("use_sliding_window"):
        out.append(f"sliding-window attention (sliding_window={config.get('sliding_window')}) is not supported")
    if config.get("mlp_bias"):
        out.append("mlp_bias=true is not supported")
    return out + found.problems(config)
