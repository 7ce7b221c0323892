"""HF -> Megatron and Megatron -> HF, streaming, into a temporary directory renamed only when complete.

Before anything is written, every tensor is checked against what the config implies: present, the expected
shape, and a floating-point dtype (bf16, fp16, fp32 or fp64). --dtype may cast between those; integer, bool
and fp8 weights are always an error (casting them would invent values). Without --dtype the tensors that
make one Megatron tensor must share one dtype. Megatron -> HF also checks that the HF config agrees with the
checkpoint (layers, hidden size, heads, experts, vocabulary) and that every element it writes was stored.
"""

from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection

import torch
from tqdm import tqdm

from mcorekit.convert import torch_dist
from mcorekit.convert.files import model_file, read_json, tracked_iteration
from mcorekit.convert.hf_io import HFReader, HFWriter, copy_assets
from mcorekit.convert.verify import same_bits
from mcorekit.errors import ConversionError, ModelError, first_line
from mcorekit.models import dtypes, registry
from mcorekit.models import gpt_weights as gw
from mcorekit.models.mapping import EXPERT, GLOBAL, LAYER, MTP, Ctx, Mapping, WeightMap
from mcorekit.models.megatron import padded_vocab_size
from mcorekit.models.parallel import Layout
from mcorekit.models.spec import ModelSpec
from mcorekit.models.spec_checks import model_problems
from mcorekit.outputs import staged_output
from mcorekit.train.checkpoint import LORA_JSON, RELEASE, TRACKER  # Megatron-LM's checkpoint directory layout

SIDECAR = "mcorekit.json"
# Buffers some HF checkpoints carry that are recomputed, never loaded.
IGNORED_HF = ("rotary_emb.inv_freq",)
# Weights we convert; --dtype casts between them. Anything else (int, bool, fp8 without its scales) is refused.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass
class Summary:
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def line(self, what: str) -> str:
        rss_gb = peak_rss_gb()
        rate = self.bytes / max(self.seconds, 1e-9) / 1e9
        return (f"{what}: {self.tensors} tensors, {self.bytes / 1e9:.3f} GB in {self.seconds:.1f} s "
                f"({rate:.2f} GB/s), peak RSS {rss_gb:.2f} GB")


def peak_rss_gb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it is not inherited across fork + exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def config_problems(config: dict[str, Any]) -> list[str]:
    """What makes an HF config unusable before any tensor is looked at (types, sizes, divisibility, features its
    family's map does not cover); the model registry knows them."""
    return registry.config_problems(config)


def spec_for(config: dict[str, Any], where: str | Path = "config.json") -> ModelSpec:
    """The model an HF config describes, or a ConversionError naming the file and every problem in it."""
    try:
        problems = config_problems(config) if isinstance(config, dict) else ["not a JSON object"]
        if problems:
            raise ConversionError(f"{where}: " + "; ".join(problems))
        spec = registry.for_config(config).read(config)
        if problems := model_problems(spec):  # values the family read but no model has (NaN, a negative clamp)
            raise ConversionError(f"{where}: " + "; ".join(problems))
        return spec
    except ModelError as e:
        raise ConversionError(str(e)) from None
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:  # e.g. rope_parameters that is
        # not an object, a rope_theta beyond any float
        raise ConversionError(f"{where}: unusable config ({type(e).__name__}: {first_line(e)})") from None


def weight_map(spec: ModelSpec) -> WeightMap:
    try:
        return registry.weight_map(spec)
    except ModelError as e:
        raise ConversionError(str(e)) from None


def expected_shapes(amap: WeightMap, ctx: Ctx) -> dict[str, tuple[int, ...]]:
    """Per-slice Megatron shapes the config implies (from the map); the weights must agree before anything is written."""
    return {m.mcore: m.mcore_shape(ctx) for m in amap.mappings}


def slice_indices(m: Mapping, spec: ModelSpec) -> list[tuple[int, ...]]:
    return m.slices(spec)


def hf_names_at(m: Mapping, index: tuple[int, ...]) -> list[str]:
    return m.hf_names_at(index)


def _progress(total: int, desc: str, quiet: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet, leave=False)


def hf_slice_shapes(m: Mapping, mcore_shape: tuple[int, ...], ctx: Ctx) -> list[tuple[int, ...]]:
    """The shapes of one slice's HF tensors (in m.hf order) implied by its Megatron slice shape: the mapping's
    own split, run on the meta device (no memory)."""
    try:
        return [tuple(t.shape) for t in m.to_hf(torch.empty(mcore_shape, device="meta"), ctx)]
    except (RuntimeError, TypeError, OverflowError) as e:  # sizes torch cannot split, or hold (int64 overflows)
        raise ConversionError(f"{m.mcore}: the config is inconsistent ({first_line(e)})") from None


def dtype_problem(dtype: torch.dtype) -> str | None:
    if dtype in FLOAT_DTYPES:
        return None
    return (f"is stored as {dtype}; only floating-point weights (bf16, fp16, fp32, fp64) are converted, and integer, "
            f"bool or fp8 weights are refused even with --dtype (casting them would invent values)")


# ---------------------------------------------------------------- HF -> Megatron


def _listed(ids: Collection[int]) -> str:
    shown = ids if isinstance(ids, range) else sorted(ids)  # a range may be a config's billion layers
    return "none" if not shown else ", ".join(map(str, shown[:8])) + (f", ... ({len(shown)} in all)" if len(shown) > 8 else "")


def _is_range(ids: set[int], n: int) -> bool:
    """ids == {0, ..., n-1}, without building that set (n comes from an untrusted config)."""
    return len(ids) == n and all(0 <= i < n for i in ids)


def check_counts(reader: HFReader, spec: ModelSpec, amap: WeightMap) -> None:
    """The config's layer and expert counts must be what the weights hold (read with the map's HF names); checked
    first, so that a config claiming a billion layers fails at once instead of planning them."""
    layers, experts = amap.stacked_ids(reader.names())
    if not _is_range(layers, spec.num_layers + spec.mtp_layers):
        mtp = f" and {spec.mtp_layers} MTP layers after them" if spec.mtp_layers else ""
        raise ConversionError(f"{reader.path / 'config.json'}: num_hidden_layers={spec.num_layers}{mtp}, but the "
                              f"weights hold layers {_listed(layers)}; the config disagrees with the weights")
    per_expert_names = any("{expert}" in n for m in amap.mappings for n in m.hf)  # else shapes say the count
    if spec.is_moe and per_expert_names:
        if not _is_range(experts, spec.num_experts):
            raise ConversionError(f"{reader.path / 'config.json'}: {spec.num_experts} experts per layer, but the weights "
                                  f"hold experts {_listed(experts)}; the config disagrees with the weights")


MTP_DIR = "mtp"  # where conversions before commit 90d678a (2026-12-01) carried DeepSeek's MTP layers through, unconverted


def declared_mtp(spec: ModelSpec) -> ModelSpec:
    """The model with the multi-token-prediction layers its HF config declares (DeepSeek-V3's
    num_nextn_predict_layers)."""
    from dataclasses import replace

    declared = spec.extra.get("nextn_predict_layers") or 0
    return replace(spec, mtp_layers=declared) if isinstance(declared, int) and declared > 0 else spec


def with_hf_mtp(reader: HFReader, spec: ModelSpec) -> ModelSpec:
    """The model with the MTP layers its HF weights hold (numbered after the decoder layers): all that the config
    declares when the weights hold layers past the decoder, none when they do not (transformers saves none)."""
    layers, _ = weight_map(spec).stacked_ids(reader.names())
    return declared_mtp(spec) if layers and max(layers) >= spec.num_layers else spec


def check_carried_mtp(folder: Path, spec: ModelSpec, declared: int) -> None:
    """What an old conversion carried through (MTP_DIR) must be the HF tensors of exactly the MTP layers the config
    declares (the layers after the decoder's, as the family's map names them; floating point): anything else would
    land in the HF output."""
    carried = HFReader(folder)
    carried.close()  # the headers are all this reads
    amap, mtp = weight_map(spec), set(range(spec.num_layers, spec.num_layers + declared))
    layers: set[int] = set()
    for name in carried.names():
        ids, _ = amap.stacked_ids([name])
        file = carried.path / carried.entries[name].shard
        if not ids or not ids <= mtp:
            raise ConversionError(
                f"{file}: {name!r} is not a tensor of the model's multi-token-prediction layers (layer "
                f"{_listed(mtp)}, num_nextn_predict_layers={declared}), so it has no place in the HF model; remove it "
                f"from {carried.path}")
        if problem := dtype_problem(carried.entries[name].dtype):
            raise ConversionError(f"{file}: {name} {problem}")
        layers |= ids
    if layers != mtp:
        raise ConversionError(
            f"{carried.path}: holds MTP layer(s) {_listed(layers)}, but the config declares num_nextn_predict_layers="
            f"{declared} (layer {_listed(mtp)}); the carried layers are incomplete")


def check_copies(reader: HFReader, amap: WeightMap) -> list[str]:
    """The HF tensors that must equal another (an MTP layer's embedding and head equal the main model's: Megatron-Core
    shares them); returns their names, or a ConversionError naming the first that differs."""
    for name, source in amap.copies:
        for n in (name, source):
            if n not in reader.entries:
                raise ConversionError(f"{reader.path}: tensor {n!r} is missing; the checkpoint is incomplete")
        if not same_bits(reader.get(name), reader.get(source)):
            raise ConversionError(
                f"{reader.path}: {name} differs from {source}: Megatron-Core's MTP layers share the main model's "
                f"embedding and output layer, so an MTP layer with its own would be lost; nothing was written "
                f"(convert a checkpoint whose MTP layer holds copies of them, as DeepSeek's do)")
    return [name for name, _ in amap.copies]


def check_tied_head(reader: HFReader, head: str, embedding: str) -> None:
    """A tied model's checkpoint may hold its head too; Megatron keeps only the embedding, so the head must be a
    bit-identical copy of it (else it would be lost without a word)."""
    if not same_bits(reader.get(head), reader.get(embedding)):
        raise ConversionError(
            f"{reader.path / reader.entries[head].shard}: {head} differs from {embedding}, but config.json says "
            f"tie_word_embeddings=true, so Megatron would keep only the embedding and this head would be lost; nothing "
            f"was written (set tie_word_embeddings to false if the model has its own output layer)")


def check_hf_tensor(reader: HFReader, name: str, want: tuple[int, ...], m: Mapping, mcore_shape: tuple[int, ...]) -> torch.dtype:
    """The dtype of HF tensor `name`, once its header shows it is present, shaped as the config implies, and float."""
    entry = reader.entries.get(name)
    if entry is None:
        raise ConversionError(f"{reader.path}: tensor {name!r} is missing (part of {m.mcore}); the checkpoint is incomplete")
    where = reader.path / entry.shard
    if entry.shape != want:
        raise ConversionError(f"{where}: {name} has shape {entry.shape}, but config.json implies {want} ({m.mcore}: "
                              f"config.json implies {mcore_shape}); the config disagrees with the weights")
    problem = dtype_problem(entry.dtype)
    if problem:
        raise ConversionError(f"{where}: {name} {problem}")
    return entry.dtype


def plan_from_hf(reader: HFReader, spec: ModelSpec, amap: WeightMap, ctx: Ctx, dtype: torch.dtype | None
                 ) -> tuple[list[torch_dist.PlannedTensor], int]:
    """Check every HF tensor from the shard headers (presence, shape, dtype) and return the streaming plan and
    its bytes; nothing is read or written before every slice of every Megatron tensor is known to fit."""
    check_counts(reader, spec, amap)
    shapes = expected_shapes(amap, ctx)
    used: set[str] = set()
    planned = []
    total = 0
    for m in amap.mappings:
        shape = shapes[m.mcore]
        want_hf = hf_slice_shapes(m, shape, ctx)
        if m.hf_experts:  # one HF tensor holds every expert
            want_hf = [(spec.num_experts, *w) for w in want_hf]
        indices = slice_indices(m, spec)
        dtypes = set()
        for index in indices:
            for name, want in zip(hf_names_at(m, index), want_hf):
                dtypes.add(check_hf_tensor(reader, name, want, m, shape))
                used.add(name)
        if dtype is None and len(dtypes) > 1:
            raise ConversionError(f"{reader.path}: the HF tensors of {m.mcore} mix dtypes ({', '.join(sorted(map(str, dtypes)))}); "
                                  f"pass --dtype to convert them to one")
        out_dtype = dtype or dtypes.pop()
        lead = () if m.scope == GLOBAL else (m.stack(spec),) if m.scope == LAYER else (m.stack(spec), spec.num_experts)
        chunks = []
        for index in indices:
            def produce(m: Mapping = m, index: tuple[int, ...] = index, out_dtype: torch.dtype = out_dtype) -> torch.Tensor:
                row = index[1] if m.hf_experts else None
                t = m.to_mcore([reader.get(n, row) for n in hf_names_at(m, index)], ctx).to(out_dtype)
                return t.reshape((1,) * len(index) + tuple(t.shape))
            chunks.append(torch_dist.ChunkSource(index + (0,) * len(shape), (1,) * len(index) + shape, produce))
        planned.append(torch_dist.PlannedTensor(m.mcore, lead + shape, out_dtype, chunks, m.scope))
        total += int(torch.Size(shape).numel()) * out_dtype.itemsize * len(indices)
    used.update(check_copies(reader, amap))
    unmapped = sorted(n for n in reader.names() if n not in used and not n.endswith(IGNORED_HF))
    if spec.tie_word_embeddings:  # a tied copy of the embedding (the head the family names); Megatron reuses it
        head = registry.weight_map(_untied(spec)).get(gw.OUTPUT)
        for name in head.hf_names() if head else ():
            if name in unmapped:
                check_tied_head(reader, name, amap.hf(gw.EMBEDDING)[0])
                unmapped.remove(name)
    if unmapped:
        raise ConversionError(
            f"{len(unmapped)} HF tensors have no Megatron counterpart (e.g. {unmapped[:3]}): the checkpoint has features "
            f"the {spec.architecture} mapping does not cover; nothing was written"
        )
    return planned, total


def _untied(spec: ModelSpec) -> ModelSpec:
    from dataclasses import replace

    return replace(spec, tie_word_embeddings=False)


def extra_state_blobs(amap: WeightMap, spec: ModelSpec) -> dict[str, bytes]:
    empty = torch_dist.empty_extra_state()
    blobs = {"common_state/shard_0_1": torch_dist.common_state()}
    L, E = spec.num_layers, spec.num_experts
    for te in amap.te_modules:
        if te.scope == GLOBAL:
            blobs[torch_dist.extra_state_key(te.name)] = empty
            continue
        if te.is_mtp:  # one key per MTP layer, as per-layer decoder keys
            for i in te.layers or range(spec.mtp_layers):
                name = torch_dist.layer_key(te.name, i)
                keys = [torch_dist.extra_state_key(name)] if te.scope == LAYER else \
                    [torch_dist.extra_state_key(name, e, E) for e in range(E)]
                blobs.update(dict.fromkeys(keys, empty))
            continue
        for layer in filter(te.has_layer, range(L)):
            if spec.per_layer_keys:  # one key per layer, no layer dimension (torch_dist.per_layer)
                name = torch_dist.layer_key(te.name, layer)
                keys = [torch_dist.extra_state_key(name)] if te.scope == LAYER else \
                    [torch_dist.extra_state_key(name, e, E) for e in range(E)]
            else:
                keys = [torch_dist.extra_state_key(te.name, layer, L)] if te.scope == LAYER else \
                    [torch_dist.extra_state_key(te.name, layer, L, e, E) for e in range(E)]
            blobs.update(dict.fromkeys(keys, empty))
    return blobs


FORMATS = ("torch_dist", "torch")
MAX_VOCAB_DIVISOR = 65536


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, fmt: str = "torch_dist", dtype: str | None = None,
                vocab_divisible_by: int = 128, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1, vpp: int | None = None,
                force: bool = False, quiet: bool = False) -> Summary:
    from mcorekit.convert import legacy

    start = time.monotonic()
    if fmt not in FORMATS:
        raise ConversionError(f"unknown format {fmt!r}; supported: {', '.join(FORMATS)}")
    if dtype is not None and dtype not in dtypes.NAMES:
        raise ConversionError(f"unknown dtype {dtype!r}; supported: {', '.join(dtypes.NAMES)}")
    if not 1 <= vocab_divisible_by <= MAX_VOCAB_DIVISOR:  # a larger one pads the embedding to an absurd size
        raise ConversionError(f"--vocab-divisible-by {vocab_divisible_by}: must be from 1 to {MAX_VOCAB_DIVISOR:,} "
                              f"(Megatron's default is 128)")
    reader = HFReader(hf_dir)
    try:
        spec = with_hf_mtp(reader, spec_for(reader.config, reader.path / "config.json"))
        ctx = Ctx(spec, padded_vocab_size(spec.vocab_size, vocab_divisible_by))
        layout = Layout(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp)
        legacy.check_layout(spec, ctx, layout, legacy=fmt == "torch")  # torch_dist has none, but must load at it
        amap = weight_map(spec)
        planned, total = plan_from_hf(reader, spec, amap, ctx, dtypes.to_torch(dtype) if dtype else None)
        summary = Summary()
        with staged_output(Path(out_dir), force, inputs=(reader.path,), command="mcorekit convert hf-to-mcore") as tmp:
            bar = _progress(total, f"hf -> mcore ({fmt})", quiet)

            def tick(n: int) -> None:
                summary.tensors += 1
                summary.bytes += n
                bar.update(n)

            if fmt == "torch_dist":
                # MTP layers are stored one key per layer whatever the decoder does
                stored = [s for t in planned for s in (torch_dist.per_layer([t]) if spec.per_layer_keys
                                                       or t.fqn.startswith(MTP) else [t])]
                torch_dist.write(tmp / RELEASE, stored, extra_state_blobs(amap, spec), on_chunk=tick)
            else:
                legacy.write(tmp / RELEASE, planned, amap, ctx, layout, on_tensor=tick)
            bar.close()
            (tmp / TRACKER).write_text(RELEASE)
            (tmp / "hf").mkdir()
            copy_assets(reader.path, tmp / "hf")
            sidecar = {"format": fmt, "model": spec.to_dict(), "padded_vocab_size": ctx.padded_vocab,
                       "layout": {"tp": tp, "pp": pp, "ep": ep, "etp": etp, "vpp": vpp} if fmt == "torch" else None,
                       "source": str(reader.path), "mtp_layers": spec.mtp_layers}
            (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=2) + "\n")
    finally:
        reader.close()
    summary.seconds = time.monotonic() - start
    return summary


# ---------------------------------------------------------------- Megatron -> HF


def find_iteration_dir(path: Path) -> Path:
    """A checkpoint root (with latest_checkpointed_iteration.txt) or an iteration directory itself."""
    if not path.is_dir():
        raise ConversionError(f"{path}: not a directory; pass a checkpoint root ({TRACKER}) or an iteration directory")
    if (path / "metadata.json").is_file() or any(path.glob("mp_rank_*")):
        return path
    found = tracked_iteration(path)
    if found is None:
        raise ConversionError(f"{path}: neither a checkpoint root ({TRACKER}) nor an iteration directory (metadata.json)")
    return found


def hf_config_for(ckpt_root: Path, hf_config: str | None) -> tuple[dict[str, Any], Path, Path]:
    """(config, its file, the folder its tokenizer files are copied from)."""
    if hf_config:
        given = Path(hf_config)
        file = given / "config.json" if given.is_dir() else given
        if not file.is_file():
            raise ConversionError(f"no HF config at {file}; pass an HF model directory or its config.json")
        return read_json(file), file, file.parent
    for candidate in (ckpt_root / "hf", ckpt_root.parent / "hf"):
        if (candidate / "config.json").is_file():
            return read_json(model_file(candidate, "config.json", str(candidate))), candidate / "config.json", candidate
    raise ConversionError(f"{ckpt_root}: no HF config stored with the checkpoint; pass --hf-config HF_DIR_OR_CONFIG")


MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", MTP)


def config_mismatches(spec: ModelSpec, amap: WeightMap, sizes: dict[str, tuple[int, ...]],
                      shapes: dict[str, tuple[int, ...]], layer_ids: dict[str, set[int]]) -> list[str]:
    """Where the HF config and the stored tensors disagree: model dimensions first, then each tensor. `layer_ids`:
    the layers each tensor stored one key per layer has (its stacked size is the config's, so they tell)."""
    out = []
    held = layer_ids.get(gw.PROJ)
    if held is not None and len(held) != spec.num_layers:
        out.append(f"num_hidden_layers {spec.num_layers} in the config, {len(held)} in the checkpoint")

    def compare(field: str, value: int, key: str, dim: int) -> None:
        size = sizes.get(key, ())
        if len(size) > dim and size[dim] != value:
            out.append(f"{field} {value} in the config, {size[dim]} in the checkpoint")

    compare("num_hidden_layers", spec.num_layers, gw.PROJ, 0)
    compare("hidden_size", spec.hidden_size, gw.FINAL_NORM, 0)
    if spec.is_moe:
        compare("num_experts", spec.num_experts, gw.ROUTER, 1)
    rows = sizes[gw.EMBEDDING][:1]
    if rows and rows[0] < spec.vocab_size:
        out.append(f"vocab_size {spec.vocab_size} in the config, {rows[0]} embedding rows in the checkpoint")
    for m in amap.mappings:
        lead = {GLOBAL: (), LAYER: (m.stack(spec),), EXPERT: (m.stack(spec), spec.num_experts or 0)}[m.scope]
        want = lead + shapes[m.mcore]
        if sizes[m.mcore] != want:
            out.append(f"{m.mcore} is {sizes[m.mcore]} in the checkpoint, the config implies {want}")
        held, layers = layer_ids.get(m.mcore), m.stacked_layers(spec)
        if held is not None and not (len(held) == len(layers) and all(i in layers for i in held)):
            out.append(f"{m.mcore} is stored for layers {_listed(held)}, the config implies layers {_listed(layers)}")
    return out


# What the tensor shapes do not show: q/k/v are regrouped by heads, and other heads x head_dim give the same shapes
HEAD_LAYOUT = {"num_attention_heads": "num_attention_heads", "num_query_groups": "num_key_value_heads",
               "kv_channels": "head_dim"}
MLA_HEAD_LAYOUT = {"num_attention_heads": "num_attention_heads", "qk_head_dim": "qk_nope_head_dim",
                   "qk_pos_emb_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim"}


def recorded_mismatches(spec: ModelSpec, ckpt_root: Path) -> list[str]:
    """Where the config's head layout differs from the one the checkpoint was converted with (its mcorekit.json,
    when it has one)."""
    if not (ckpt_root / SIDECAR).is_file():
        return []
    recorded = read_json(model_file(ckpt_root, SIDECAR, str(ckpt_root))).get("model")
    if not isinstance(recorded, dict):
        return []
    out = []
    for field, name in (MLA_HEAD_LAYOUT if spec.is_mla else HEAD_LAYOUT).items():
        if field in recorded and recorded[field] != getattr(spec, field):
            out.append(f"{name} {getattr(spec, field)} in the config, {recorded[field]} in the checkpoint ({SIDECAR})")
    return out


def open_checkpoint(iter_dir: Path, spec: ModelSpec, amap: WeightMap) -> Any:
    """The checkpoint seen with the map's layer-stacked keys (per-layer and MTP keys stacked; `mtp_layers` says how
    many MTP layers it holds)."""
    if any(iter_dir.glob("mp_rank_*")):
        from mcorekit.convert import legacy

        return legacy.LegacyReader(iter_dir, spec, amap)
    return torch_dist.LayerStackedView(torch_dist.TorchDistReader(iter_dir), spec.num_layers)


def with_checkpoint_mtp(spec: ModelSpec, found: int, iter_dir: Path, config_file: Path) -> ModelSpec:
    """The model with the MTP layers the Megatron checkpoint holds (none: written back as transformers saves the
    model); more than the HF config declares cannot be written back under its names."""
    from dataclasses import replace

    declared = declared_mtp(spec).mtp_layers
    if found and found != declared:
        raise ConversionError(f"{iter_dir}: the checkpoint holds {found} multi-token-prediction layer(s) (mtp.layers.*), "
                              f"but {config_file} declares num_nextn_predict_layers={declared}; pass an --hf-config "
                              f"that declares {found}")
    return replace(spec, mtp_layers=found)


def refuse_lora_checkpoint(ckpt: Path, iter_dir: Path, then: str) -> None:
    """A LoRA run's checkpoint holds adapters, not a model: say how to make it one (`then`: what to do after)."""
    if (iter_dir / LORA_JSON).is_file():
        raise ConversionError(f"{ckpt} is a LoRA adapter checkpoint ({iter_dir / LORA_JSON}), not a model: merge it "
                              f"into its base with `mcorekit convert mcore-to-hf {ckpt} OUT --merge --base BASE_CKPT`"
                              f"{then}")


def mcore_to_hf(ckpt: str | Path, out_dir: str | Path, hf_config: str | None = None, dtype: str | None = None,
                max_shard_bytes: int = 5 * 1024**3, force: bool = False, quiet: bool = False,
                edit: Callable[[Mapping, tuple[int, ...], list[torch.Tensor]], list[torch.Tensor]] | None = None) -> Summary:
    """`edit` may change each slice's HF tensors before they are written (convert/lora.py merges adapters so)."""
    start = time.monotonic()
    root = Path(ckpt)
    iter_dir = find_iteration_dir(root)
    refuse_lora_checkpoint(root, iter_dir, " (or write it as a PEFT adapter with --lora)")
    ckpt_root = root if iter_dir != root else root.parent
    config, config_file, assets = hf_config_for(ckpt_root, hf_config)
    if dtype is not None and dtype not in dtypes.NAMES:
        raise ConversionError(f"unknown dtype {dtype!r}; supported: {', '.join(dtypes.NAMES)}")
    spec = spec_for(config, config_file)
    source = open_checkpoint(iter_dir, spec, weight_map(declared_mtp(spec)))  # the legacy reader splits MTP tensors too
    spec = with_checkpoint_mtp(spec, source.mtp_layers, iter_dir, config_file)
    amap = weight_map(spec)
    stored = {k: v for k, v in source.tensor_keys().items() if k.startswith(MODEL_PREFIXES)}
    wanted = {m.mcore for m in amap.mappings}
    missing, extra = sorted(wanted - set(stored)), sorted(set(stored) - wanted)
    if any(".shared_experts." in k for k in extra):
        raise ConversionError(
            f"{iter_dir}: the checkpoint has shared-expert weights (moe_shared_expert_intermediate_size, "
            f"moe.shared_expert_ffn), but {config_file} describes a {spec.architecture} model, which has no shared "
            f"expert, so they have no HF counterpart; pass the --hf-config of a model with a shared expert")
    if missing or extra:
        raise ConversionError(
            f"{iter_dir}: checkpoint and {config_file} disagree: missing {missing[:4]}, unexpected {extra[:4]} "
            f"(wrong --hf-config, or tied embeddings differ?)"
        )
    sizes = {k: tuple(v.size) for k, v in stored.items()}
    rows = sizes[gw.EMBEDDING][:1]
    ctx = Ctx(spec, rows[0] if rows else 0)
    shapes = expected_shapes(amap, ctx)
    layer_ids = source.layers if isinstance(source, torch_dist.LayerStackedView) else {}
    problems = config_mismatches(spec, amap, sizes, shapes, layer_ids) + recorded_mismatches(spec, ckpt_root)
    if problems:
        raise ConversionError(f"{iter_dir}: the checkpoint and {config_file} disagree: {'; '.join(problems[:6])}"
                              f"{' ...' if len(problems) > 6 else ''}; pass the --hf-config it was converted from")
    for key, md in sorted(stored.items()):
        problem = dtype_problem(md.properties.dtype)
        if problem:
            raise ConversionError(f"{iter_dir}: {key} {problem}")
    hf_shapes = {m.mcore: hf_slice_shapes(m, shapes[m.mcore], ctx) for m in amap.mappings}
    out_dtype = dtypes.to_torch(dtype) if dtype else _config_dtype(config)
    summary = Summary()
    total = sum(int(torch.Size(s).numel()) for s in sizes.values()) * (out_dtype or torch.float32).itemsize
    declared = declared_mtp(spec).mtp_layers  # only a model that declares MTP layers has any carried through
    carried_mtp = not spec.mtp_layers and declared > 0 and (ckpt_root / MTP_DIR / "config.json").is_file()
    if carried_mtp:
        check_carried_mtp(ckpt_root / MTP_DIR, spec, declared)
    given_file = hf_config is not None and not Path(hf_config).is_dir()
    inputs = [root, iter_dir, config_file if given_file else assets]
    if carried_mtp:  # read too (it may be a link to a folder elsewhere)
        inputs.append(ckpt_root / MTP_DIR)
    with (staged_output(Path(out_dir), force, inputs=inputs, command="mcorekit convert mcore-to-hf") as tmp,
          HFWriter(tmp, max_shard_bytes) as writer):
        bar = _progress(total, "mcore -> hf", quiet)
        # Layer by layer, so HF shards come out in the usual order (embeddings, layer 0, 1, ..., norm, head).
        order = ([m for m in amap.mappings if m.scope == GLOBAL and m.mcore == gw.EMBEDDING]
                 + [(m, layer) for layer in range(spec.num_layers) for m in amap.mappings if m.has_layer(layer)]
                 + [m for m in amap.mappings if m.scope == GLOBAL and m.mcore != gw.EMBEDDING]
                 + [(m, i) for i in range(spec.mtp_layers) for m in amap.mappings if m.is_mtp])
        for item in order:
            m, layer = item if isinstance(item, tuple) else (item, None)
            indices = [()] if layer is None else [(layer,)] if m.scope == LAYER else [(layer, e) for e in range(spec.num_experts)]
            stacked: dict[str, list[torch.Tensor]] = {}
            for index in indices:
                part = source.read(m.mcore, index)
                if tuple(part.shape) != shapes[m.mcore]:
                    raise ConversionError(f"{iter_dir}: {m.mcore} slice {index} reads as {tuple(part.shape)}, expected {shapes[m.mcore]}")
                hf_tensors = m.to_hf(part, ctx)
                if edit is not None:
                    hf_tensors = edit(m, index, hf_tensors)
                for name, t, want in zip(hf_names_at(m, index), hf_tensors, hf_shapes[m.mcore]):
                    if tuple(t.shape) != want:
                        raise ConversionError(f"{name}: came out as {tuple(t.shape)}, expected {want} (from {m.mcore})")
                    cast = dtypes.to_torch(dtype) if dtype else None if m.keep_dtype else out_dtype
                    t = t.to(cast) if cast else t
                    if m.hf_experts:  # every expert's slice, written below as one tensor
                        stacked.setdefault(name, []).append(t)
                        continue
                    writer.add(name, t)
                    n = t.numel() * t.element_size()
                    summary.tensors += 1
                    summary.bytes += n
                    bar.update(n)
            for name, parts in stacked.items():
                t = torch.stack(parts)
                writer.add(name, t)
                summary.tensors += 1
                summary.bytes += t.numel() * t.element_size()
                bar.update(t.numel() * t.element_size())
        for name, source_name in amap.copies:  # the MTP layers' copies of the embedding and head, from them
            summary.tensors += 1
            writer.add(name, _hf_tensor(source, amap, ctx, source_name, dtype, out_dtype))
        if carried_mtp:
            # a conversion before commit 90d678a carried the MTP layers through unconverted: back as they came
            carried = HFReader(ckpt_root / MTP_DIR)
            try:
                for name in carried.names():
                    t = carried.get(name)
                    writer.add(name, t.to(dtypes.to_torch(dtype)) if dtype else t)
            finally:
                carried.close()
        writer.finish()
        bar.close()
        copy_assets(assets, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    summary.seconds = time.monotonic() - start
    return summary


def _hf_tensor(source: Any, amap: WeightMap, ctx: Ctx, name: str, dtype: str | None,
               out_dtype: torch.dtype | None) -> torch.Tensor:
    """The HF tensor `name` of a global (not per-layer) entry, read from the checkpoint again."""
    m = next(m for m in amap.mappings if m.scope == GLOBAL and name in m.hf_names())
    t = m.to_hf(source.read(m.mcore), ctx)[m.hf_names().index(name)]
    cast = dtypes.to_torch(dtype) if dtype else out_dtype
    return t.to(cast) if cast else t


def _config_dtype(config: dict[str, Any]) -> torch.dtype | None:
    short = dtypes.from_config(config.get("dtype") or config.get("torch_dtype"))
    return dtypes.to_torch(short) if short else None
