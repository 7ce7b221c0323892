"""LoRA adapters between Megatron-Core (train/lora.py) and HF PEFT, and merged into the base model.

  Megatron (torch_dist, layer-stacked)                     PEFT (adapter_model.safetensors)
  decoder.layers.self_attention.linear_qkv.adapter.lora_a  [L, 3r, H]   the q, k, v modules' lora_A.weight  [r, H] each
  decoder.layers.self_attention.linear_qkv.adapter.lora_b  [L, qkv, r]  their lora_B.weight, split as the weight
  decoder.layers.mlp.linear_fc1.adapter.lora_a / lora_b    [L, 2r, H] / [L, 2F, r]   the gate and up modules
  ...linear_proj / linear_fc2 (and shared_experts.)        one A and one B each      the output and down modules
(the HF module names come from the family's weight map, models/mapping.py, as for the converter). A model whose layers
differ (DeepSeek-V3's dense then MoE layers: spec.per_layer_keys) has one key per layer, `decoder.layers.<l>.<name>`,
without the layer dim, as its weights and train/'s adapters are stored, and each only on the layers that have the
weight (the mapping's `layers`: the dense fc1 on the first layers, the shared expert's on the MoE layers).

A's blocks are PEFT's per-projection A matrices in the HF order of the weight's mapping (q, k, v; gate, up); B goes
through the weight's own mapping (models/mapping.py QKV, GatedFC1, Direct), so the q/k/v split of an adapter is
exactly the converter's split of the fused weight. PEFT names are `base_model.model.<HF module>.lora_A.weight`.
Every transform is a re-arrangement: PEFT -> Megatron -> PEFT is bit-exact.

A PEFT adapter imports the modules its adapter_config.json covers, resolved as PEFT resolves them (target_modules,
exclude_modules, layers_to_transform, layers_pattern): each needs its A and B, and no other tensor may be there. What
it leaves out of a Megatron weight it adapts (some of a fused group, PEFT's default being the q and v modules; the
layers layers_to_transform skips) imports as zero blocks: zero A and B give zero output and zero gradients, so they
stay zero in training. rsLoRA, DoRA,
per-module ranks or alphas, bias training, modules_to_save, fan_in_fan_out, activated LoRA and PEFT's other variants
(UNSUPPORTED) have no Megatron counterpart and are refused.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcorekit.convert import pipeline, torch_dist
from mcorekit.convert.files import model_file, read_json
from mcorekit.convert.hf_io import copy_assets
from mcorekit.errors import ConversionError, first_line
from mcorekit.models import dtypes
from mcorekit.models import gpt_weights as gw
from mcorekit.models.mapping import LAYER, Ctx, Mapping, WeightMap
from mcorekit.models.megatron import padded_vocab_size
from mcorekit.models.registry import family
from mcorekit.models.spec import ModelSpec
from mcorekit.outputs import check_output, staged_output
from mcorekit.train.checkpoint import LORA_JSON, RELEASE, TRACKER
from mcorekit.train.lora import AdapterShape, adapter_keys, adapter_shape, scaling

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# The Megatron weights each LoRA target adapts, where the model has them (a MoE layer's shared expert for fc1/fc2).
TARGET_WEIGHTS = {"qkv": (gw.QKV_WEIGHT,), "proj": (gw.PROJ,), "fc1": (gw.FC1, gw.SHARED_FC1),
                  "fc2": (gw.FC2, gw.SHARED_FC2)}
# PEFT adapter_config.json fields whose non-default values we cannot represent (null, [] and {} count as the default):
# each changes what the adapter computes, so converting it as plain LoRA would change the model (activated LoRA applies
# only after its invocation tokens; the variants' configs change the forward or the base weight)
UNSUPPORTED = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
               "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None, "target_parameters": None,
               "alora_invocation_tokens": None, "use_qalora": False, "lora_bias": False, "kasa_config": None,
               "monteclora_config": None, "use_bdlora": None, "arrow_config": None}


@dataclass(frozen=True)
class Adapted:
    """One adapted Megatron weight: its mapping (HF names), and the adapter's A/B keys and shape."""

    target: str
    mapping: Mapping
    shape: AdapterShape

    @property
    def keys(self) -> tuple[str, str]:
        return adapter_keys(self.mapping.mcore)

    def hf_modules(self, layer: int) -> list[str]:
        return [n.removesuffix(".weight") for n in self.mapping.hf_names(layer)]

    def layers(self, spec: ModelSpec) -> list[int]:
        """The decoder layers that have the weight (DeepSeek: the dense MLP the first layers, the shared expert the
        MoE layers)."""
        return [index[0] for index in self.mapping.slices(spec)]


def adapted(spec: ModelSpec, amap: WeightMap, targets: list[str]) -> list[Adapted]:
    """The weights the LoRA targets adapt in this model, in map order."""
    out = []
    by_mcore = amap.by_mcore()
    for target in targets:
        for key in TARGET_WEIGHTS[target]:
            m = by_mcore.get(key)
            if m is None or not m.slices(spec):  # not in this model, or on none of its layers
                continue
            if m.scope != LAYER:
                raise ConversionError(f"{key}: LoRA on routed experts is not built")
            ffn = spec.moe_shared_expert_ffn_hidden_size if key in (gw.SHARED_FC1, gw.SHARED_FC2) else None
            out.append(Adapted(target, m, adapter_shape(spec, target, ffn)))
    if not out:
        raise ConversionError(f"the {spec.architecture} model has none of the LoRA targets {targets}")
    return out


def to_peft(a: Adapted, lora_a: torch.Tensor, lora_b: torch.Tensor, ctx: Ctx) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One layer's Megatron A [parts*r, in] and B [out, r] -> (A, B) per HF module, in the mapping's HF order."""
    blocks = [t.contiguous() for t in lora_a.chunk(a.shape.parts, dim=0)]
    return list(zip(blocks, a.mapping.to_hf(lora_b, ctx)))


def from_peft(a: Adapted, pairs: list[tuple[torch.Tensor, torch.Tensor]], ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """to_peft's inverse."""
    return torch.cat([p[0] for p in pairs], dim=0), a.mapping.to_mcore([p[1] for p in pairs], ctx)


def peft_key(module: str, which: str) -> str:
    return f"{PEFT_PREFIX}{module}.lora_{which}.weight"


def peft_target_modules(spec: ModelSpec, items: list[Adapted]) -> list[str] | str:
    """PEFT's target_modules: the HF module names (from the weight map); as a regex of the full paths where a name would
    also match a routed expert's module (MoE models)."""
    modules = sorted({m for a in items for m in a.hf_modules(0)})
    if not spec.is_moe:
        return sorted({m.rsplit(".", 1)[-1] for m in modules})
    import re

    return "|".join(re.escape(m).replace(r"\.0\.", r"\.\d+\.") for m in modules)


# ---------------------------------------------------------------- reading what describes an adapter checkpoint


def _finite(value: object) -> float | None:
    """A JSON number as a finite float; None for anything else (a bool, a string, Infinity, NaN, an int too large)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def value_problems(values: dict[str, Any], rank: str, alpha: str, dropout: str, max_rank: int) -> list[str]:
    """The rank, alpha and dropout fields (named as the file names them), one problem each: what they would do
    otherwise is a traceback or a non-finite merged model. `max_rank`: the largest dimension of the weights adapted
    (a rank above the smallest is legal, if wasteful; one above every dimension is a damaged file, and a huge one
    would only overflow)."""
    out = []
    r, a, d = values.get(rank), _finite(values.get(alpha)), values.get(dropout)
    if not (type(r) is int and 0 < r <= max_rank):
        out.append(f"{rank}={r!r} is not a positive integer at most {max_rank} (the largest dimension of the weights "
                   f"it adapts)")
    if a is None or a <= 0:
        out.append(f"{alpha}={values.get(alpha)!r} is not a finite positive number")
    if d is not None and not (_finite(d) is not None and 0 <= d < 1):
        out.append(f"{dropout}={d!r} is not a number from 0 to below 1")
    return out


def rank_bound(items: list[Adapted]) -> int:
    """The largest dimension of the weights adapted: no rank above it can come from a real adapter."""
    return max(max(a.shape.in_features, a.shape.out_features) for a in items)


def read_lora_json(iter_dir: Path) -> dict[str, Any]:
    """lora.json, once its fields are usable; rank, alpha and dropout are checked with the model (AdapterCheckpoint)."""
    file = iter_dir / LORA_JSON
    if not file.is_file():
        raise ConversionError(f"{iter_dir}: no {LORA_JSON}, so not a LoRA checkpoint (a peft.lora run writes one in "
                              f"each iteration); without --lora, mcore-to-hf converts a full model")
    info = read_json(file)
    if not {"rank", "alpha", "target_modules"} <= info.keys():
        raise ConversionError(f"{file}: needs rank, alpha and target_modules")
    targets = info["target_modules"]
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) and t in TARGET_WEIGHTS for t in targets)):
        raise ConversionError(f"{file}: target_modules={targets!r} is not a list of {', '.join(TARGET_WEIGHTS)}")
    return info


def _hf_config(root: Path, iter_dir: Path, info: dict[str, Any], hf_config: str | None) -> tuple[dict, Path, Path]:
    """The HF config: --hf-config, else stored with the checkpoint, else stored with the base model it adapts."""
    if hf_config:
        return pipeline.hf_config_for(root, hf_config)
    candidates = [root if iter_dir != root else root.parent]
    if isinstance(info.get("base"), str):
        candidates.append(Path(info["base"]))
    for c in candidates:
        for d in (c / "hf", c.parent / "hf"):
            if (d / "config.json").is_file():
                return read_json(model_file(d, "config.json", str(d))), d / "config.json", d
    raise ConversionError(f"{root}: no HF config stored with the checkpoint or its base ({info.get('base')}); pass "
                          f"--hf-config HF_DIR_OR_CONFIG")


class AdapterCheckpoint:
    """A Megatron LoRA checkpoint (a training run's iter_N, or a converted `release`): its adapter tensors, checked
    against the model."""

    def __init__(self, ckpt: str | Path, hf_config: str | None = None) -> None:
        self.root = Path(ckpt)
        self.iter_dir = pipeline.find_iteration_dir(self.root)
        self.info = read_lora_json(self.iter_dir)
        self.config, self.config_file, self.assets = _hf_config(self.root, self.iter_dir, self.info, hf_config)
        self.spec = pipeline.spec_for(self.config, self.config_file)
        self.amap = pipeline.weight_map(self.spec)
        self.items = adapted(self.spec, self.amap, list(self.info["target_modules"]))
        if problems := value_problems(self.info, "rank", "alpha", "dropout", rank_bound(self.items)):
            raise ConversionError(f"{self.iter_dir / LORA_JSON}: " + "; ".join(problems))
        self.rank, self.alpha = int(self.info["rank"]), float(self.info["alpha"])
        # what it reads, which no output may overlap: the config as given (a file), else the folder it came from
        given_file = hf_config is not None and not Path(hf_config).is_dir()
        self.inputs = (self.root, self.iter_dir, self.config_file if given_file else self.assets)
        # one key per layer (a model whose layers differ) seen with the map's layer-stacked keys, as pipeline reads it
        self.reader = torch_dist.LayerStackedView(torch_dist.TorchDistReader(self.iter_dir), self.spec.num_layers)
        self.ctx = Ctx(self.spec, 0)
        stored = self.reader.tensor_keys()
        L = self.spec.num_layers
        for a in self.items:
            for key, want in zip(a.keys, (a.shape.a_shape(self.rank), a.shape.b_shape(self.rank))):
                md = stored.get(key)
                if md is None:
                    raise ConversionError(f"{self.iter_dir}: adapter tensor {key!r} is missing ({LORA_JSON} names "
                                          f"target {a.target}); the checkpoint is incomplete or not of this model")
                held = self.reader.layers.get(key)
                if held is not None and held != set(a.layers(self.spec)):
                    raise ConversionError(f"{self.iter_dir}: {key} is stored for layers {sorted(held)}, but "
                                          f"{self.config_file} has it on layers {a.layers(self.spec)}; pass the "
                                          f"--hf-config it adapts")
                if tuple(md.size) != (L, *want):
                    raise ConversionError(f"{self.iter_dir}: {key} is {tuple(md.size)}, but rank {self.rank} on "
                                          f"{self.config_file} implies {(L, *want)}; pass the --hf-config it adapts")
                problem = pipeline.dtype_problem(md.properties.dtype)
                if problem:
                    raise ConversionError(f"{self.iter_dir}: {key} {problem}")

    def layer(self, a: Adapted, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        ka, kb = a.keys
        return self.reader.read(ka, (layer,)), self.reader.read(kb, (layer,))

    def peft_tensors(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        out = {}
        for layer in range(self.spec.num_layers):
            for a in self.items:
                if not a.mapping.has_layer(layer):  # DeepSeek: a dense MLP or a shared expert, not both
                    continue
                for module, (la, lb) in zip(a.hf_modules(layer), to_peft(a, *self.layer(a, layer), self.ctx)):
                    out[peft_key(module, "A")] = la if dtype is None else la.to(dtype)
                    out[peft_key(module, "B")] = lb if dtype is None else lb.to(dtype)
        return out

    def peft_config(self) -> dict[str, Any]:
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "lora_dropout": float(self.info.get("dropout") or 0.0),
                "target_modules": peft_target_modules(self.spec, self.items), "bias": "none",
                "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
                "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True,
                "base_model_name_or_path": None}


# ---------------------------------------------------------------- Megatron -> PEFT, and merged


def mcore_to_peft(ckpt: str | Path, out_dir: str | Path, hf_config: str | None = None, dtype: str | None = None,
                  force: bool = False) -> pipeline.Summary:
    """A LoRA checkpoint -> an HF PEFT adapter folder (adapter_config.json, adapter_model.safetensors)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    start = time.monotonic()
    src = AdapterCheckpoint(ckpt, hf_config)
    tensors = src.peft_tensors(dtypes.to_torch(dtype) if dtype else None)
    if family(src.spec.architecture).peft_moves_mlp_to_experts and any(a.target in ("fc1", "fc2") for a in src.items):
        print(f"mcorekit: warning: peft 0.21 under transformers 5 loads the MLP targets of a "
              f"{src.config.get('model_type')} model as LoRA on its routed experts (its MoE weight conversion) and "
              f"drops these adapters of the dense and shared-expert MLPs; to serve them, write the merged model "
              f"(mcore-to-hf --merge)", file=sys.stderr)
    with staged_output(Path(out_dir), force, inputs=src.inputs, command="mcorekit convert mcore-to-hf --lora") as tmp:
        try:
            save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        except SafetensorError as e:  # safetensors reports a full or read-only disk as its own error type
            raise ConversionError(f"cannot write {out_dir}: {first_line(e)}; nothing was written there") from None
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(src.peft_config(), indent=2) + "\n")
    return pipeline.Summary(len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()),
                            time.monotonic() - start)


def mcore_to_hf_merged(ckpt: str | Path, out_dir: str | Path, base: str | None = None, hf_config: str | None = None,
                       dtype: str | None = None, max_shard_bytes: int = 5 * 1024**3, force: bool = False,
                       quiet: bool = False) -> pipeline.Summary:
    """The base model with the adapters merged in, W + scaling * B @ A per HF weight (as PEFT's merge_and_unload),
    computed in fp32 and rounded once to the output dtype; written like `mcore-to-hf` writes a full model."""
    src = AdapterCheckpoint(ckpt, hf_config)
    base_path = base or src.info.get("base")
    if not isinstance(base_path, str):
        raise ConversionError(f"{src.iter_dir / LORA_JSON} names no base checkpoint; pass --base BASE_CKPT")
    if base is None and not Path(base_path).exists():  # e.g. pruned by its own run once no LoRA run trained on it
        where = "" if Path(base_path).is_absolute() else f", a relative path not found from {Path.cwd()}"
        raise ConversionError(f"the base these adapters were trained on, {base_path} (recorded in "
                              f"{src.iter_dir / LORA_JSON}{where}), is gone; pass --base with a copy of that checkpoint")
    check_output(Path(out_dir), src.inputs, force)  # pipeline.mcore_to_hf checks the base's own
    s = scaling(src.rank, src.alpha)
    by_key = {a.mapping.mcore: a for a in src.items}

    def merge(m: Mapping, index: tuple[int, ...], weights: list[torch.Tensor]) -> list[torch.Tensor]:
        a = by_key.get(m.mcore)
        if a is None:
            return weights
        pairs = to_peft(a, *src.layer(a, index[0]), src.ctx)
        out = []
        for name, w, (la, lb) in zip(m.hf_names_at(index), weights, pairs):
            exact = w.float() + (lb.float() @ la.float()) * s
            merged = exact.to(w.dtype)
            if not torch.isfinite(merged).all():  # NaN adapters, or a sum beyond the range of the weight's dtype
                why = (f"exceeds the range of {w.dtype} (up to {exact.abs().max().item():.3g}): the adapter is not "
                       f"of this base, or its alpha is wrong" if torch.isfinite(exact).all() else
                       "is not finite: the adapter (or the base) holds NaN or infinite values")
                raise ConversionError(f"merging {src.iter_dir} into {name}: W + alpha/r * B @ A {why}; nothing was "
                                      f"written")
            out.append(merged)
        return out

    return pipeline.mcore_to_hf(base_path, out_dir, hf_config=hf_config or str(src.config_file), dtype=dtype,
                                max_shard_bytes=max_shard_bytes, force=force, quiet=quiet, edit=merge)


# ---------------------------------------------------------------- PEFT -> Megatron


def read_peft(adapter_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """adapter_config.json and the tensors of adapter_model.safetensors (never a pickled adapter_model.bin)."""
    from safetensors import SafetensorError, safe_open

    if not adapter_dir.is_dir():
        raise ConversionError(f"{adapter_dir}: not a directory; pass a PEFT adapter folder ({ADAPTER_CONFIG}, "
                              f"{ADAPTER_WEIGHTS})")
    config = read_json(model_file(adapter_dir, ADAPTER_CONFIG, str(adapter_dir)))
    weights = model_file(adapter_dir, ADAPTER_WEIGHTS, str(adapter_dir))
    if not weights.is_file():
        pickled = " (adapter_model.bin is a pickle, which is never loaded: save it with safe_serialization)" \
            if (adapter_dir / "adapter_model.bin").exists() else ""
        raise ConversionError(f"{adapter_dir}: no {ADAPTER_WEIGHTS}{pickled}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ConversionError(f"{weights}: not a readable safetensors file ({e})") from None
    return config, tensors


def peft_config_problems(config: dict[str, Any], max_rank: int) -> list[str]:
    out = []
    if config.get("peft_type") != "LORA":
        out.append(f"peft_type is {config.get('peft_type')!r}, not LORA")
    out += value_problems(config, "r", "lora_alpha", "lora_dropout", max_rank)
    for key, default in UNSUPPORTED.items():
        value = config.get(key)
        # PEFT writes null or an empty list or dict for a field it does not use (peft 0.21: target_parameters=[] for
        # MoE models), depending on its version and the model
        if value != default and value not in (None, [], {}):
            out.append(f"{key}={config.get(key)!r} has no Megatron LoRA counterpart (supported: {default!r})")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and (init.startswith("pissa") or init in BASE_CHANGING_INITS):
        out.append(f"init_lora_weights={init!r} changes the base weights too, so these adapters do not apply to the "
                   f"HF model; save them with PEFT's path_initial_model_for_weight_conversion (plain LoRA) first")
    return out


# PEFT initialisations that also rewrite the base weights (PiSSA, its pissa_niter_N, OLoRA, CorDA, LoftQ, LoRA-GA):
# an adapter saved from them applies to that rewritten base, not to the HF model's
BASE_CHANGING_INITS = ("olora", "corda", "loftq", "lora_ga")


ALL_LINEAR = "all-linear"  # PEFT's target_modules for every linear layer but the head


def target_problems(config: dict[str, Any]) -> list[str]:
    """adapter_config.json's fields that pick the adapted modules, where PEFT could not read them either."""
    out = []
    targets = config.get("target_modules")
    if not targets or not (isinstance(targets, str) or _names(targets)):
        out.append(f"target_modules={targets!r} is neither a list of module names nor a regex (PEFT needs it to know "
                   f"which modules the adapter covers; it has a default for some model types only)")
    if isinstance(targets, str) and (config.get("layers_to_transform") is not None or config.get("layers_pattern")):
        out.append("target_modules is a regex, which PEFT takes with neither layers_to_transform nor layers_pattern "
                   "(its LoraConfig refuses them together)")
    if config.get("layers_pattern") and config.get("layers_to_transform") is None:
        out.append("layers_pattern without layers_to_transform, which PEFT's LoraConfig refuses")
    exclude = config.get("exclude_modules")
    if exclude is not None and not (isinstance(exclude, str) or _names(exclude)):
        out.append(f"exclude_modules={exclude!r} is neither a list of module names nor a regex")
    layers = config.get("layers_to_transform")
    if not (layers is None or _index(layers) or isinstance(layers, list) and all(_index(i) for i in layers)):
        out.append(f"layers_to_transform={layers!r} is neither a layer index nor a list of them")
    pattern = config.get("layers_pattern")
    if pattern is not None and not (isinstance(pattern, str) or _names(pattern)):
        out.append(f"layers_pattern={pattern!r} is neither a name nor a list of names")
    regexes = [("target_modules", targets), ("exclude_modules", exclude)]
    regexes += [("layers_pattern", p) for p in ([pattern] if isinstance(pattern, str) else pattern or [])]
    for field, value in regexes:
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                out.append(f"{field}={value!r} is not a valid regular expression ({e})")
    return out


def _names(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _index(value: object) -> bool:
    return type(value) is int and value >= 0


def peft_covers(config: dict[str, Any], module: str) -> bool:
    """Whether PEFT adapts HF module `module` under adapter_config.json `config` (its fields checked by
    target_problems), decided as peft 0.21's check_target_module_exists decides it: exclude_modules first; a string
    target_modules is a regex the whole name must match; a list names a module whole, or by its last parts, and then
    only on the layers layers_to_transform picks (their index found after layers_pattern, else after any name)."""
    exclude = config.get("exclude_modules")
    if exclude and (re.fullmatch(exclude, module) if isinstance(exclude, str) else _named(module, exclude)):
        return False
    targets = config["target_modules"]
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    if module in targets:  # a whole name: PEFT takes it whatever layers_to_transform says
        return True
    if not _named(module, targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern") or []
    # the first number after a pattern, or after any name: the layer's, not an expert's further on
    regexes = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in ([patterns] if isinstance(patterns, str) else patterns)]
    match = next(filter(None, (re.match(r, module) for r in regexes or [r".*?\.[^.]*\.(?P<idx>\d+)\."])), None)
    if match is None:
        return False
    return int(match["idx"]) == layers if isinstance(layers, int) else int(match["idx"]) in layers


def _named(module: str, names: list[str]) -> bool:
    return module in names or any(module.endswith(f".{n}") for n in names)


def selection(config: dict[str, Any]) -> str:
    """The fields that pick the adapted modules, as the config gives them (for messages)."""
    fields = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")
    return ", ".join(f"{k}={config[k]!r}" for k in fields if config.get(k) not in (None, [], ""))


def model_modules(spec: ModelSpec, amap: WeightMap) -> set[str]:
    """The modules holding the model's HF weights, by name: those PEFT could adapt (not the MTP layers, which
    transformers does not build)."""
    return {n.rsplit(".", 1)[0] for m in amap.mappings if not m.is_mtp for index in m.slices(spec)
            for n in m.hf_names_at(index)}


def covered_modules(config: dict[str, Any], spec: ModelSpec, amap: WeightMap, adaptable: set[str]) -> set[str]:
    """The model's modules that the adapter covers, as PEFT resolves its config against the model."""
    modules = model_modules(spec, amap)
    targets = config["target_modules"]
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:  # PEFT: every linear layer but the head
        linear = adaptable | {m for m in amap.linear_hf_modules(spec) if m in modules}
        config = {**config, "target_modules": sorted(linear)}
    return {m for m in modules if peft_covers(config, m)}


def peft_to_mcore(hf_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, dtype: str | None = None,
                  force: bool = False) -> pipeline.Summary:
    """An HF PEFT adapter of the HF_DIR model -> a Megatron LoRA checkpoint (`release`) to continue training from
    (peft.lora.load). The modules it adapts are those its config covers, resolved as PEFT resolves them: each must
    have its A and B, and no other tensor may be there. A module the config leaves out (a q/k/v or gate/up member it
    does not name, a layer layers_to_transform skips) gets zero A and B: no output and no gradient, as without one."""
    start = time.monotonic()
    hf, adapter = Path(hf_dir), Path(adapter_dir)
    config_file = model_file(hf, "config.json", str(hf))
    config = read_json(config_file)
    spec = pipeline.spec_for(config, config_file)
    amap = pipeline.weight_map(spec)
    peft_config, tensors = read_peft(adapter)
    if peft_config.get("target_modules") is None and (default := family(spec.architecture).peft_default_targets):
        peft_config = {**peft_config, "target_modules": list(default)}  # what PEFT adapts for such a config
    ctx = Ctx(spec, padded_vocab_size(spec.vocab_size, 128))
    every = adapted(spec, amap, list(TARGET_WEIGHTS))
    adaptable = {m for a in every for layer in a.layers(spec) for m in a.hf_modules(layer)}
    field_problems = target_problems(peft_config)
    covered = set() if field_problems else covered_modules(peft_config, spec, amap, adaptable)
    found_targets = []
    for a in every:
        if any(m in covered for layer in a.layers(spec) for m in a.hf_modules(layer)) and a.target not in found_targets:
            found_targets.append(a.target)
    items = [a for a in every if a.target in found_targets]
    # the config first (a non-LoRA adapter has no LoRA tensors either), its rank bounded by the weights it adapts
    if problems := peft_config_problems(peft_config, rank_bound(items or every)) + field_problems:
        raise ConversionError(f"{adapter / ADAPTER_CONFIG}: " + "; ".join(problems))
    rank, alpha = int(peft_config["r"]), float(peft_config["lora_alpha"])
    picked = selection(peft_config)
    if others := sorted(covered - adaptable):
        more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
        raise ConversionError(f"{adapter / ADAPTER_CONFIG}: {picked} covers {others[0]}{more}, which Megatron LoRA "
                              f"does not adapt (only the attention and MLP projections, not the routed experts, norms, "
                              f"embeddings or the head)")
    if not items:
        raise ConversionError(f"{adapter / ADAPTER_CONFIG}: {picked} covers none of the {spec.architecture} model's "
                              f"attention or MLP projections (modules like {sorted(adaptable)[0]})")
    out_dtype = dtypes.to_torch(dtype) if dtype else None
    zero_dtype = next((t.dtype for t in tensors.values()), torch.float32)
    used: set[str] = set()
    stacked: dict[str, dict[int, torch.Tensor]] = {}  # Megatron key -> layer -> its tensor
    for a in items:
        ka, kb = a.keys
        for layer in a.layers(spec):
            pairs = []
            for module, want_b in zip(a.hf_modules(layer), _hf_b_shapes(a, rank, ctx)):
                na, nb = peft_key(module, "A"), peft_key(module, "B")
                want_a = (rank, a.shape.in_features)
                if module not in covered:  # PEFT leaves it as it is: a zero block (no output, no gradient)
                    pairs.append((torch.zeros(want_a, dtype=zero_dtype), torch.zeros(want_b, dtype=zero_dtype)))
                    continue
                if (na in tensors) != (nb in tensors):
                    raise ConversionError(f"{adapter / ADAPTER_WEIGHTS}: {na if na in tensors else nb} has no "
                                          f"lora_{'B' if na in tensors else 'A'} partner")
                if na not in tensors:
                    raise ConversionError(f"{adapter / ADAPTER_WEIGHTS}: no lora_A/lora_B for {module}, which "
                                          f"{ADAPTER_CONFIG}'s {picked} covers; the adapter is incomplete, or not of "
                                          f"this model ({config_file}: {spec.num_layers} layers)")
                for name, want in ((na, want_a), (nb, want_b)):
                    t = tensors[name]
                    if tuple(t.shape) != want:
                        raise ConversionError(f"{adapter / ADAPTER_WEIGHTS}: {name} has shape {tuple(t.shape)}, but "
                                              f"r={rank} on {config_file} implies {want}")
                    if problem := pipeline.dtype_problem(t.dtype):
                        raise ConversionError(f"{adapter / ADAPTER_WEIGHTS}: {name} {problem}")
                    if not torch.isfinite(t).all():
                        raise ConversionError(f"{adapter / ADAPTER_WEIGHTS}: {name} holds NaN or infinite values, "
                                              f"which no trained adapter has; the file is damaged: save the adapter "
                                              f"again")
                    used.add(name)
                pairs.append((tensors[na], tensors[nb]))
            la, lb = from_peft(a, pairs, ctx)
            stacked.setdefault(ka, {})[layer] = la if out_dtype is None else la.to(out_dtype)
            stacked.setdefault(kb, {})[layer] = lb if out_dtype is None else lb.to(out_dtype)
    if unused := sorted(set(tensors) - used):
        outside = [n for n in unused if _peft_module(n) in adaptable]
        if outside:
            raise ConversionError(f"{adapter / ADAPTER_WEIGHTS}: {outside[0]} adapts {_peft_module(outside[0])}, "
                                  f"which {ADAPTER_CONFIG}'s {picked} does not cover (PEFT would not load it); fix "
                                  f"the config or the tensors, nothing was written")
        raise ConversionError(f"{adapter / ADAPTER_WEIGHTS}: {len(unused)} tensors are not LoRA weights of the "
                              f"{spec.architecture} model's attention/MLP projections (e.g. {unused[:3]}); nothing "
                              f"was written")
    planned = [_planned(key, parts, spec.num_layers) for key, parts in stacked.items()]
    if spec.per_layer_keys:  # as the model's own weights are stored (pipeline.hf_to_mcore) and train/ saves adapters
        planned = torch_dist.per_layer(planned)
    total = sum(t.numel() * t.element_size() for parts in stacked.values() for t in parts.values())
    info = {"rank": rank, "alpha": alpha, "dropout": float(peft_config.get("lora_dropout") or 0.0),
            "target_modules": found_targets, "experts": False, "base": None, "model": spec.to_dict(),
            "source": str(adapter)}
    with staged_output(Path(out_dir), force, inputs=(hf, adapter), command="mcorekit convert hf-to-mcore --lora") as tmp:
        torch_dist.write(tmp / RELEASE, planned, {"common_state/shard_0_1": torch_dist.common_state()})
        (tmp / RELEASE / LORA_JSON).write_text(json.dumps(info, indent=2) + "\n")
        (tmp / TRACKER).write_text(RELEASE)
        (tmp / "hf").mkdir()
        copy_assets(hf, tmp / "hf")
    return pipeline.Summary(len(planned), total, time.monotonic() - start)


def _peft_module(key: str) -> str | None:
    """The HF module of a PEFT LoRA tensor name (`base_model.model.<module>.lora_A.weight`), else None."""
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if key.startswith(PEFT_PREFIX) and key.endswith(suffix):
            return key[len(PEFT_PREFIX):-len(suffix)]
    return None


def _hf_b_shapes(a: Adapted, rank: int, ctx: Ctx) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in a.mapping.to_hf(torch.empty(a.shape.b_shape(rank), device="meta"), ctx)]


def _planned(key: str, parts: dict[int, torch.Tensor], num_layers: int) -> torch_dist.PlannedTensor:
    """A layer-stacked tensor written one layer per chunk, the layers in `parts` (all of them unless the model's
    layers differ, whose tensors torch_dist.per_layer then stores one key per layer)."""
    first = next(iter(parts.values()))
    shape, dtype = tuple(first.shape), first.dtype
    if any(p.dtype != dtype for p in parts.values()):
        raise ConversionError(f"the PEFT tensors of {key} mix dtypes; pass --dtype to convert them to one")
    chunks = [torch_dist.ChunkSource((layer,) + (0,) * len(shape), (1, *shape), lambda t=t: t.unsqueeze(0))
              for layer, t in parts.items()]
    return torch_dist.PlannedTensor(key, (num_layers, *shape), dtype, chunks, LAYER)
