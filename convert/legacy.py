"""Megatron-LM's legacy per-rank `torch` checkpoint format, for a fixed TP/PP/EP (and VPP) layout.

    iter_dir/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt  =  {"model" | "model0", "model1", ...: state dict,
                                                            "checkpoint_version": 3.0, "iteration": 0}

Names are per layer with local indices (`decoder.layers.3.self_attention.linear_qkv.weight`) and sequential
experts with local ids (`decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight`, global id =
ep_rank * experts/EP + local id). Each tensor is split over tensor parallel ranks the way its weight-map entry
says (models/mapping.py: QKV by query groups, gated fc1 as [gate_i; up_i], linear_proj and fc2 along the input
dim, vocabulary rows for embedding and output layer; norms, the router and the shared-expert gate replicated).
Expert tensor parallelism is 1 or equal to TP. Multi-token-prediction layers (DeepSeek-V3) sit on the last
pipeline stage (its last virtual chunk) under their module names, `mtp.layers.<i>.{enorm,hnorm,eh_proj,
final_layernorm}` and `mtp.layers.<i>.mtp_model_layer.*` (split like a decoder layer), and that stage then holds
a copy of the embedding too (Megatron-Core's MTP block uses it). Load it in Megatron-LM with
`--finetune --no-load-optim --no-load-rng` (it carries weights only).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from mcorekit.convert import torch_dist
from mcorekit.convert.files import model_file, write_failure
from mcorekit.convert.verify import same_bits
from mcorekit.errors import ConversionError
from mcorekit.models import gpt_weights as gw
from mcorekit.models.mapping import (GATED_COLUMN, GLOBAL, LAYER, MTP, MTP_LAYER, MTP_MODULE_LAYER, REPLICATED, ROW,
                                     Ctx, WeightMap, shard, unshard)
from mcorekit.models.parallel import MEGATRON, Layout, layout_problems
from mcorekit.models.spec import ModelSpec


def rank_dir(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    name = f"mp_rank_{tp_rank:02d}"
    if pp > 1:
        name += f"_{pp_rank:03d}"
    if ep > 1:
        name += f"_{ep_rank:03d}"
    return name


def local_name(mcore: str, local_layer: int | None, local_expert: int | None = None) -> str:
    if local_layer is None:
        return mcore
    if mcore.startswith(MTP):  # MTP layer `local_layer`: its decoder layer's module is mtp_model_layer
        name = mcore.replace(MTP_LAYER, MTP_MODULE_LAYER, 1)
        if local_expert is not None:
            name = name.replace(".mlp.experts.experts.", f".mlp.experts.local_experts.{local_expert}.", 1)
        return name.replace(MTP, f"{MTP}{local_layer}.", 1)
    if local_expert is None:
        return mcore.replace("decoder.layers.", f"decoder.layers.{local_layer}.", 1)
    return mcore.replace("decoder.layers.mlp.experts.experts.",
                         f"decoder.layers.{local_layer}.mlp.experts.local_experts.{local_expert}.", 1)


_MTP_LOCAL = (  # a legacy MTP name -> (MTP layer, its layer-stacked map name)
    (re.compile(rf"^{re.escape(MTP)}(\d+)\.mtp_model_layer\.(.*)\.local_experts\.\d+\.(.*)$"), MTP_LAYER + r"\2.experts.\3"),
    (re.compile(rf"^{re.escape(MTP)}(\d+)\.mtp_model_layer\.(.*)$"), MTP_LAYER + r"\2"),
    (re.compile(rf"^{re.escape(MTP)}(\d+)\.(.*)$"), MTP + r"\2"),
)


def mtp_stacked_name(name: str) -> tuple[int, str, bool] | None:
    """(MTP layer, stacked map name, is an expert's) of a legacy MTP tensor name; None for other names."""
    for pattern, template in _MTP_LOCAL:
        if m := pattern.match(name):
            return int(m.group(1)), m.expand(template), ".local_experts." in name
    return None


def stages(spec: ModelSpec, pp: int, vpp: int | None) -> dict[tuple[int, int], list[int]]:
    """(pp_rank, virtual chunk) -> global layer ids, as Megatron assigns them (interleaved when vpp is set)."""
    v = vpp or 1
    per = spec.num_layers // (pp * v)
    return {(p, c): [c * (spec.num_layers // v) + p * per + i for i in range(per)] for p in range(pp) for c in range(v)}


def check_layout(spec: ModelSpec, ctx: Ctx, layout: Layout, legacy: bool = True) -> None:
    """Every rule the layout breaks for this model (models/parallel.py's, for Megatron-Core), and with `legacy`
    this format's own limit on expert TP, as one ConversionError (the CLI already refused sizes < 1). torch_dist
    checkpoints are resharded at load, to any expert TP Megatron-Core runs."""
    problems = layout_problems(spec, layout, MEGATRON, ctx.padded_vocab)
    if legacy and spec.is_moe and layout.etp not in (1, layout.tp):
        problems.append(f"ETP={layout.etp}: the legacy format supports expert TP of 1 or equal to TP={layout.tp}")
    if problems:
        raise ConversionError("layout does not fit the model: " + "; ".join(problems))


def write(iter_dir: Path, planned: list[torch_dist.PlannedTensor], amap: WeightMap, ctx: Ctx, layout: Layout,
          on_tensor: Callable[[int], None] | None = None) -> None:
    spec = ctx.spec
    check_layout(spec, ctx, layout)
    tp, pp, ep, etp, vpp = layout.tp, layout.pp, layout.ep, layout.etp, layout.vpp
    splits = {m.mcore: m.split for m in amap.mappings}
    entries = amap.by_mcore()
    by_key = {t.fqn: t for t in planned}
    local_experts = (spec.num_experts or 1) // ep
    iter_dir.mkdir(parents=True)
    layout = stages(spec, pp, vpp)
    for p in range(pp):
        # files[(tp_rank, ep_rank)][chunk] = state dict
        files: dict[tuple[int, int], dict[int, dict[str, Any]]] = {
            (t, e): {c: {} for c in range(vpp or 1)} for t in range(tp) for e in range(ep)}
        for c in range(vpp or 1):
            first, last = (p == 0 and c == 0), (p == pp - 1 and c == (vpp or 1) - 1)
            for key, planned_tensor in by_key.items():
                scope = planned_tensor.scope
                if scope == GLOBAL:
                    is_emb = key.startswith("embedding.")
                    # the MTP block on the last stage embeds the next tokens with its own copy of the embedding
                    if not ((is_emb and (first or (last and spec.mtp_layers))) or (not is_emb and last)):
                        continue
                    full = _produce(planned_tensor, ())
                    for (t, e), chunks in files.items():
                        chunks[c][key] = shard(splits[key], full, t, tp)
                    _tick(on_tensor, full)
                    continue
                # decoder layers of this stage, or the MTP layers on the last one: (local index, slice index)
                here = ([(i, i) for i in range(spec.mtp_layers)] if last else []) if entries[key].is_mtp else \
                    [(i, layer) for i, layer in enumerate(layout[(p, c)]) if entries[key].has_layer(layer)]
                for i, layer in here:
                    if scope == LAYER:
                        full = _produce(planned_tensor, (layer,))
                        for (t, e), chunks in files.items():
                            chunks[c][local_name(key, i)] = shard(splits[key], full, t, tp)
                        _tick(on_tensor, full)
                    else:
                        for g in range(spec.num_experts):
                            e, j = divmod(g, local_experts)
                            full = _produce(planned_tensor, (layer, g))
                            for t in range(tp):
                                r, size = (t, tp) if etp == tp else (0, 1)
                                files[(t, e)][c][local_name(key, i, j)] = shard(splits[key], full, r, size)
                            _tick(on_tensor, full)
            if spec.tie_word_embeddings and last and pp > 1:
                # Megatron keeps a synchronized copy of the embedding as the last stage's output layer.
                full = _produce(by_key[gw.EMBEDDING], ())
                for (t, e), chunks in files.items():
                    chunks[c][gw.OUTPUT] = shard(splits[gw.EMBEDDING], full, t, tp)
            for (t, e), chunks in files.items():
                for te in amap.te_modules:
                    module, scope = te.name, te.scope
                    here = ((list(range(spec.mtp_layers)) if last else []) if te.is_mtp else
                            [i for i, layer in enumerate(layout[(p, c)]) if te.has_layer(layer)])
                    if scope == GLOBAL:
                        if last:
                            chunks[c][f"{module}._extra_state"] = None
                    elif scope == LAYER:
                        for i in here:
                            chunks[c][local_name(f"{module}._extra_state", i)] = None
                    else:
                        for i in here:
                            for j in range(local_experts):
                                chunks[c][local_name(f"{module}._extra_state", i, j)] = None
        for (t, e), chunks in files.items():
            state: dict[str, Any] = {"checkpoint_version": 3.0, "iteration": 0}
            if vpp:
                state.update({f"model{c}": sd for c, sd in chunks.items()})
            else:
                state["model"] = chunks[0]
            d = iter_dir / rank_dir(t, p, e, pp, ep)
            d.mkdir()
            _save(state, d / "model_optim_rng.pt")


def _save(state: dict[str, Any], file: Path) -> None:
    try:
        torch.save(state, file)
    except (OSError, RuntimeError) as e:  # torch reports a full disk as a RuntimeError from its zip writer
        raise ConversionError(f"{file}: cannot write ({write_failure(file, e)})") from None


def _produce(t: torch_dist.PlannedTensor, index: tuple[int, ...]) -> torch.Tensor:
    for c in t.chunks:
        if tuple(c.offsets[: len(index)]) == index:
            return c.produce().reshape(c.sizes[len(index):])
    raise ConversionError(f"{t.fqn}: no slice {index}")


def _tick(on_tensor: Callable[[int], None] | None, t: torch.Tensor) -> None:
    if on_tensor:
        on_tensor(t.numel() * t.element_size())


class LegacyReader:
    """Reassembles global layer-stacked tensors from per-rank files. Loads every rank file once (weights_only):
    unlike the torch_dist path this is not streaming, which the legacy format's per-rank files make costly."""

    def __init__(self, iter_dir: Path, spec: ModelSpec, amap: WeightMap) -> None:
        self.spec = spec
        self.entries = amap.by_mcore()
        self.iter_dir = iter_dir
        dirs = sorted(d for d in iter_dir.glob("mp_rank_*") if d.is_dir())
        if not dirs:
            raise ConversionError(f"{iter_dir}: no mp_rank_* directories")
        # read inside iter_dir only: a rank directory linked elsewhere (another checkpoint) would be an input that
        # --force could replace
        states = {d.name: load_rank_file(model_file(iter_dir, f"{d.name}/model_optim_rng.pt", str(iter_dir)))
                  for d in dirs}
        self.ranks: dict[tuple[int, int, int], dict[int, dict[str, Any]]] = {}
        for name, state in states.items():
            t, p, e = self._parse(name, states)
            self.ranks[(t, p, e)] = _models(state)
        self.tp = 1 + max(k[0] for k in self.ranks)
        self.pp = 1 + max(k[1] for k in self.ranks)
        self.ep = 1 + max(k[2] for k in self.ranks)
        expected = {(t, p, e) for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)}
        if set(self.ranks) != expected:
            raise ConversionError(f"{iter_dir}: missing rank directories {sorted(expected - set(self.ranks))}")
        self.vpp = len(self.ranks[(0, 0, 0)])
        if any(sorted(chunks) != list(range(self.vpp)) for chunks in self.ranks.values()):
            raise ConversionError(f"{iter_dir}: rank files disagree on their model chunks (model, model0, model1, ...)")
        self._check_counts()
        self.layout = stages(spec, self.pp, self.vpp if self.vpp > 1 else None)
        self.layer_home = {layer: (p, c, i) for (p, c), layers in self.layout.items() for i, layer in enumerate(layers)}
        self.local_experts = (spec.num_experts or 1) // self.ep
        self._sizes = self._global_sizes()

    def _check_counts(self) -> None:
        """The layers and experts the files hold must be the ones the config describes (else reads would miss)."""
        per_stage = {(p, c): _indices(self._sd(0, p, 0, c), r"^decoder\.layers\.(\d+)\.")
                     for p in range(self.pp) for c in range(self.vpp)}
        layers = sum(len(v) for v in per_stage.values())
        if layers != self.spec.num_layers or any(v != set(range(len(v))) or len(v) != layers // len(per_stage)
                                                 for v in per_stage.values()):
            raise ConversionError(
                f"{self.iter_dir}: the rank files hold {layers} layers ({', '.join(str(len(v)) for v in per_stage.values())} "
                f"per stage) but the config says num_hidden_layers={self.spec.num_layers}; wrong --hf-config?")
        if self.spec.is_moe:  # any stage: the first may hold only dense layers
            local = set().union(*(_indices(self._sd(0, p, 0, c), r"\.local_experts\.(\d+)\.")
                                  for p in range(self.pp) for c in range(self.vpp)))
            if len(local) * self.ep != self.spec.num_experts:
                raise ConversionError(f"{self.iter_dir}: the rank files hold {len(local)} experts x EP={self.ep} but the "
                                      f"config says {self.spec.num_experts} experts; wrong --hf-config?")

    _RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")

    @classmethod
    def _parse(cls, name: str, states: dict[str, Any]) -> tuple[int, int, int]:
        match = cls._RANK_DIR.fullmatch(name)
        if match is None:
            raise ConversionError(f"{name}: not a Megatron rank directory name (mp_rank_TT[_PPP][_EEE])")
        parts = [int(x) for x in match.groups() if x is not None]
        if len(parts) == 3:
            return parts[0], parts[1], parts[2]
        if len(parts) == 1:
            return parts[0], 0, 0
        # One suffix is PP or EP: with PP only the first stage holds the embedding (and the last too with MTP layers)
        # and only the last the final norm; with EP every file holds both.
        every_file = all(gw.EMBEDDING in _models(st)[min(_models(st))] and gw.FINAL_NORM in _models(st)[max(_models(st))]
                         for st in states.values())
        return (parts[0], 0, parts[1]) if every_file else (parts[0], parts[1], 0)

    def _sd(self, t: int, p: int, e: int, c: int) -> dict[str, Any]:
        return self.ranks[(t, p, e)][c]

    def _file(self, t: int, p: int, e: int) -> Path:
        return self.iter_dir / rank_dir(t, p, e, self.pp, self.ep) / "model_optim_rng.pt"

    def _get(self, t: int, p: int, e: int, c: int, name: str) -> torch.Tensor:
        value = self._sd(t, p, e, c).get(name)
        if not isinstance(value, torch.Tensor):
            where = self._file(t, p, e)
            raise ConversionError(f"{where}: {'no tensor' if value is None else 'not a tensor:'} {name!r} (model chunk {c})")
        return value

    def _parts(self, p: int, e: int, c: int, name: str, split: str) -> list[torch.Tensor]:
        """Every TP rank's part of `name`. They are equal splits (or copies), so they must agree in dtype and shape:
        torch.cat would promote a mixed dtype into wrong values, or fail on a mixed shape; and have the dimension
        they are joined on (gate and up halves: an even one)."""
        parts = [self._get(t, p, e, c, name) for t in range(self.tp)]
        dims = 0 if self.tp == 1 or split == REPLICATED else 2 if split == ROW else 1
        shape = tuple(parts[0].shape)
        if len(shape) < dims or (split == GATED_COLUMN and self.tp > 1 and shape[0] % 2):
            raise ConversionError(f"{self._file(0, p, e)}: {name!r} (model chunk {c}) has shape {shape}, but its "
                                  f"tensor-parallel parts are joined on dimension {dims - 1}"
                                  f"{' (gate and up halves)' if split == GATED_COLUMN else ''}; a damaged rank file")
        for t, part in enumerate(parts[1:], start=1):
            if part.dtype != parts[0].dtype or part.shape != parts[0].shape:
                raise ConversionError(
                    f"{name!r} (model chunk {c}) is {parts[0].dtype} {tuple(parts[0].shape)} in {self._file(0, p, e)} "
                    f"but {part.dtype} {tuple(part.shape)} in {self._file(t, p, e)}; the tensor-parallel parts of a "
                    f"tensor are equal splits, so these rank files do not make one checkpoint (re-save or "
                    f"re-convert it)")
        return parts

    def _global_sizes(self) -> dict[str, _Sized]:
        sizes: dict[str, _Sized] = {}
        L, E = self.spec.num_layers, self.spec.num_experts
        # every stage: in a model with dense and MoE layers a tensor need not be in the first or last one
        stage_keys = [((p, c), key) for p in range(self.pp) for c in range(self.vpp) for key in self._sd(0, p, 0, c)]
        mtp_ids: set[int] = set()
        for (p, c), key in stage_keys:
            if key.endswith("_extra_state"):
                continue
            if (mtp := mtp_stacked_name(key)) is not None:
                i, stacked, expert = mtp
                mtp_ids.add(i)
                if stacked not in sizes:
                    t = self.read(stacked, (i, 0) if expert else (i,))
                    sizes[stacked] = _Sized((0, E) if expert else (0,), _Properties(t.dtype), tuple(t.shape))
                continue
            parts = key.split(".")
            if key.startswith("decoder.layers.") and parts[2].isdigit():
                layer = self.layout[(p, c)][int(parts[2])] if int(parts[2]) < len(self.layout[(p, c)]) else 0
                if "local_experts" in parts:
                    stacked = "decoder.layers." + ".".join(parts[3:5]) + ".experts." + ".".join(parts[7:])
                    if stacked not in sizes:
                        t = self.read(stacked, (layer, 0))
                        sizes[stacked] = _Sized((L, E) + tuple(t.shape), _Properties(t.dtype))
                else:
                    stacked = "decoder.layers." + ".".join(parts[3:])
                    if stacked not in sizes:
                        t = self.read(stacked, (layer,))
                        sizes[stacked] = _Sized((L,) + tuple(t.shape), _Properties(t.dtype))
            elif key == gw.OUTPUT and self.spec.tie_word_embeddings and self._embedding_copy():
                continue  # Megatron's copy of a tied embedding (last stage, PP > 1): nothing of its own is lost
            elif key not in sizes:  # a head of its own under a tied config is then reported as unexpected
                t = self.read(key)
                sizes[key] = _Sized(tuple(t.shape), _Properties(t.dtype))
        self.mtp_layers = len(mtp_ids)  # how many multi-token-prediction layers the files hold
        for key, sized in sizes.items():  # the MTP layer count is known once every name was seen
            if key.startswith(MTP):
                sizes[key] = _Sized((self.mtp_layers, *sized.size[1:], *sized.slice), sized.properties)
        return sizes

    def _embedding_copy(self) -> bool:
        """Whether the stored output layer is a bit-identical copy of the embedding (what Megatron keeps on the
        last stage of a tied model), which a tied config may drop."""
        split = self.entries[gw.EMBEDDING].split
        head = unshard(split, self._parts(self.pp - 1, 0, self.vpp - 1, gw.OUTPUT, split))
        return same_bits(head, self.read(gw.EMBEDDING))

    def tensor_keys(self) -> dict[str, _Sized]:
        return dict(self._sizes)

    def read(self, key: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        entry = self.entries.get(key)  # a key the map lacks is reported by the caller; read it as rank 0 holds it
        split = entry.split if entry else REPLICATED
        if not index:
            p, c = (0, 0) if key.startswith("embedding.") else (self.pp - 1, self.vpp - 1)
            return unshard(split, self._parts(p, 0, c, key, split))
        p, c, i = (self.pp - 1, self.vpp - 1, index[0]) if key.startswith(MTP) else self.layer_home[index[0]]
        if len(index) == 1:
            return unshard(split, self._parts(p, 0, c, local_name(key, i), split))
        e, j = divmod(index[1], self.local_experts)
        parts = self._parts(p, e, c, local_name(key, i, j), split)
        whole = entry is None or tuple(parts[0].shape) == entry.shape
        return parts[0] if whole else unshard(split, parts)  # expert TP 1 or = TP


@dataclass(frozen=True)
class _Properties:
    dtype: torch.dtype


@dataclass(frozen=True)
class _Sized:
    """What TorchDistReader.tensor_keys() gives per tensor (size, properties.dtype), for the legacy reader."""

    size: tuple[int, ...]
    properties: _Properties
    slice: tuple[int, ...] = ()  # while sizes are gathered: one MTP slice's shape (the layer count comes last)


def _indices(state: dict[str, Any], pattern: str) -> set[int]:
    return {int(m.group(1)) for k in state if (m := re.search(pattern, k))}


def _models(state: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Model chunk -> state dict: `model` is chunk 0, `model0`, `model1`, ... under virtual pipeline stages."""
    return {int(k[5:] or 0): v for k, v in state.items() if isinstance(k, str) and re.fullmatch(r"model\d*", k)}


def load_rank_file(file: Path) -> dict[str, Any]:
    """One rank's state, loaded with weights_only=True: tensors and plain containers, nothing that runs code."""
    if not file.is_file():
        raise ConversionError(f"missing rank file {file}")
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols before refusing; one line is enough
            warnings.simplefilter("ignore")
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a refused global, a corrupt zip or pickle: all mean "not loadable"
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        reason = next((line for line in lines if "Unsupported" in line), lines[0] if lines else type(e).__name__)
        raise ConversionError(f"{file}: cannot load it as a weights-only checkpoint, so it is not read ({reason})") from None
    if not isinstance(state, dict) or not _models(state) or not all(isinstance(v, dict) for v in _models(state).values()):
        raise ConversionError(f"{file}: not a Megatron rank file (no `model` state dict in it)")
    names = [k for k in state if isinstance(k, str) and re.fullmatch(r"model\d*", k)]
    if len(names) != len(_models(state)):  # `model` and `model0` are both chunk 0: one would be read, one ignored
        raise ConversionError(f"{file}: holds a model chunk twice ({', '.join(sorted(names))}): `model` for one "
                              f"chunk, `model0`, `model1`, ... for several; re-save it")
    for name in names:  # tensors are found by matching their names
        bad = [k for k in state[name] if not isinstance(k, str)]
        if bad:
            raise ConversionError(f"{file}: {name} holds the key {bad[0]!r}, not a tensor name; a damaged rank file")
    return state
