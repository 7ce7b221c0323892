"""HF -> Megatron and Megatron -> HF, streaming, into a temporary directory renamed only when complete."""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from mcorekit.convert import torch_dist
from mcorekit.convert.architectures import ArchitectureMap, architecture_map, check_supported
from mcorekit.convert.hf_io import HFReader, HFWriter, copy_assets
from mcorekit.convert.mapping import EXPERT, GLOBAL, LAYER, Ctx, Mapping
from mcorekit.errors import ConversionError, ModelError
from mcorekit.models.megatron import DTYPES, padded_vocab_size  # noqa: F401  (DTYPES: the CLI's --dtype choices)
from mcorekit.models.spec import ModelSpec, from_hf_config, load_hf_config
from mcorekit.train.checkpoint import RELEASE, TRACKER, tracked  # Megatron-LM's checkpoint directory layout

SIDECAR = "mcorekit.json"
# Buffers some HF checkpoints carry that are recomputed, never loaded.
IGNORED_HF = ("rotary_emb.inv_freq",)


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


def spec_for(config: dict[str, Any]) -> ModelSpec:
    check_supported(config)
    try:
        return from_hf_config(config)
    except ModelError as e:
        raise ConversionError(str(e)) from None


def expected_shapes(spec: ModelSpec, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    """Per-slice shapes the config implies; the weights must agree before anything is written."""
    h, d, H = spec.num_attention_heads, spec.kv_channels, spec.hidden_size
    g = spec.num_query_groups
    qkv = (h + 2 * g) * d
    shapes = {
        "embedding.word_embeddings.weight": (padded_vocab, H),
        "output_layer.weight": (padded_vocab, H),
        "decoder.final_layernorm.weight": (H,),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (H,),
        "decoder.layers.self_attention.linear_qkv.weight": (qkv, H),
        "decoder.layers.self_attention.linear_qkv.bias": (qkv,),
        "decoder.layers.self_attention.linear_proj.weight": (H, h * d),
        "decoder.layers.self_attention.q_layernorm.weight": (d,),
        "decoder.layers.self_attention.k_layernorm.weight": (d,),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (H,),
        "decoder.layers.mlp.linear_fc1.weight": (2 * spec.ffn_hidden_size, H),
        "decoder.layers.mlp.linear_fc2.weight": (H, spec.ffn_hidden_size),
        "decoder.layers.pre_mlp_layernorm.weight": (H,),
    }
    if spec.is_moe:
        f = spec.moe_ffn_hidden_size or spec.ffn_hidden_size
        shapes.update({
            "decoder.layers.mlp.router.weight": (spec.num_experts, H),
            "decoder.layers.mlp.experts.experts.linear_fc1.weight": (2 * f, H),
            "decoder.layers.mlp.experts.experts.linear_fc2.weight": (H, f),
        })
    return shapes


def slice_indices(m: Mapping, spec: ModelSpec) -> list[tuple[int, ...]]:
    if m.scope == GLOBAL:
        return [()]
    if m.scope == LAYER:
        return [(layer,) for layer in range(spec.num_layers)]
    return [(layer, e) for layer in range(spec.num_layers) for e in range(spec.num_experts)]


def hf_names_at(m: Mapping, index: tuple[int, ...]) -> list[str]:
    layer = index[0] if index else None
    expert = index[1] if len(index) > 1 else None
    return m.hf_names(layer, expert)


@contextmanager
def staged_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; rename it to `out` only if the body finishes."""
    out = out.resolve()
    if out.exists() and not force:
        raise ConversionError(f"output {out} exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def _progress(total: int, desc: str, quiet: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet, leave=False)


# ---------------------------------------------------------------- HF -> Megatron


def plan_from_hf(reader: HFReader, spec: ModelSpec, amap: ArchitectureMap, ctx: Ctx, dtype: torch.dtype | None
                 ) -> tuple[list[torch_dist.PlannedTensor], int]:
    """Check coverage and shapes from one probe slice per mapping; return the streaming plan and its bytes."""
    used: set[str] = set()
    planned = []
    total = 0
    shapes = expected_shapes(spec, ctx.padded_vocab)
    for m in amap.mappings:
        indices = slice_indices(m, spec)
        for index in indices:
            used.update(hf_names_at(m, index))
        try:
            probe = m.to_mcore([reader.get(n) for n in hf_names_at(m, indices[0])], ctx)
        except RuntimeError as e:
            raise ConversionError(f"{m.mcore}: HF tensors {hf_names_at(m, indices[0])} do not fit the config ({e})") from None
        want = shapes.get(m.mcore)
        if want is not None and tuple(probe.shape) != want:
            raise ConversionError(
                f"{m.mcore}: the weights give shape {tuple(probe.shape)} but config.json implies {want} "
                f"(from {hf_names_at(m, indices[0])}); the config disagrees with the weights"
            )
        out_dtype = dtype or probe.dtype
        lead = () if m.scope == GLOBAL else (spec.num_layers,) if m.scope == LAYER else (spec.num_layers, spec.num_experts)
        chunks = []
        for index in indices:
            def produce(m: Mapping = m, index: tuple[int, ...] = index) -> torch.Tensor:
                t = m.to_mcore([reader.get(n) for n in hf_names_at(m, index)], ctx).to(out_dtype)
                return t.reshape((1,) * len(index) + tuple(t.shape))
            chunks.append(torch_dist.ChunkSource(index + (0,) * probe.dim(), (1,) * len(index) + tuple(probe.shape), produce))
        planned.append(torch_dist.PlannedTensor(m.mcore, lead + tuple(probe.shape), out_dtype, chunks, m.scope))
        total += probe.numel() * torch.empty((), dtype=out_dtype).element_size() * len(indices)
    unmapped = sorted(n for n in reader.names() if n not in used and not n.endswith(IGNORED_HF))
    if spec.tie_word_embeddings and "lm_head.weight" in unmapped:
        unmapped.remove("lm_head.weight")  # a tied copy; Megatron reuses the embedding
    if unmapped:
        raise ConversionError(
            f"{len(unmapped)} HF tensors have no Megatron counterpart (e.g. {unmapped[:3]}): the checkpoint has features "
            f"the {spec.architecture} mapping does not cover; nothing was written"
        )
    return planned, total


def extra_state_blobs(amap: ArchitectureMap, spec: ModelSpec) -> dict[str, bytes]:
    empty = torch_dist.empty_extra_state()
    blobs = {"common_state/shard_0_1": torch_dist.common_state()}
    L, E = spec.num_layers, spec.num_experts
    for te in amap.te_modules:
        if te.scope == GLOBAL:
            blobs[torch_dist.extra_state_key(te.name)] = empty
        elif te.scope == LAYER:
            for layer in range(L):
                blobs[torch_dist.extra_state_key(te.name, layer, L)] = empty
        else:
            for layer in range(L):
                for e in range(E):
                    blobs[torch_dist.extra_state_key(te.name, layer, L, e, E)] = empty
    return blobs


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, fmt: str = "torch_dist", dtype: str | None = None,
                vocab_divisible_by: int = 128, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1, vpp: int | None = None,
                force: bool = False, quiet: bool = False) -> Summary:
    start = time.monotonic()
    reader = HFReader(hf_dir)
    spec = spec_for(reader.config)
    ctx = Ctx(spec, padded_vocab_size(spec.vocab_size, vocab_divisible_by))
    amap = architecture_map(spec)
    torch_dtype = DTYPES[dtype] if dtype else None
    planned, total = plan_from_hf(reader, spec, amap, ctx, torch_dtype)
    summary = Summary()
    with staged_output(Path(out_dir), force) as tmp:
        bar = _progress(total, f"hf -> mcore ({fmt})", quiet)

        def tick(n: int) -> None:
            summary.tensors += 1
            summary.bytes += n
            bar.update(n)

        from mcorekit.convert import legacy

        legacy.check_layout(spec, ctx, tp, pp, ep, etp, vpp)  # torch_dist has no layout, but it must load at this one
        if fmt == "torch_dist":
            torch_dist.write(tmp / RELEASE, planned, extra_state_blobs(amap, spec), on_chunk=tick)
        elif fmt == "torch":
            legacy.write(tmp / RELEASE, planned, spec, ctx, tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp,
                         te_modules=[(te.name, te.scope) for te in amap.te_modules], on_tensor=tick)
        else:
            raise ConversionError(f"unknown format {fmt!r}; supported: torch_dist, torch")
        bar.close()
        (tmp / TRACKER).write_text(RELEASE)
        (tmp / "hf").mkdir()
        copy_assets(reader.path, tmp / "hf")
        sidecar = {"format": fmt, "model": spec.to_dict(), "padded_vocab_size": ctx.padded_vocab,
                   "layout": {"tp": tp, "pp": pp, "ep": ep, "etp": etp, "vpp": vpp} if fmt == "torch" else None,
                   "source": str(reader.path)}
        (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=2) + "\n")
    reader.close()
    summary.seconds = time.monotonic() - start
    return summary


# ---------------------------------------------------------------- Megatron -> HF


def find_iteration_dir(path: Path) -> Path:
    """A checkpoint root (with latest_checkpointed_iteration.txt) or an iteration directory itself."""
    if (path / "metadata.json").is_file() or any(path.glob("mp_rank_*")):
        return path
    found = tracked(path)
    if found is None:
        raise ConversionError(f"{path}: neither a checkpoint root ({TRACKER}) nor an iteration directory (metadata.json)")
    return found


def hf_config_for(ckpt_root: Path, hf_config: str | None) -> tuple[dict[str, Any], Path | None]:
    if hf_config:
        cfg_path = Path(hf_config)
        return load_hf_config(cfg_path), (cfg_path if cfg_path.is_dir() else cfg_path.parent)
    for candidate in (ckpt_root / "hf", ckpt_root.parent / "hf"):
        if (candidate / "config.json").is_file():
            return load_hf_config(candidate), candidate
    raise ConversionError(f"{ckpt_root}: no HF config stored with the checkpoint; pass --hf-config HF_DIR_OR_CONFIG")


MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def mcore_to_hf(ckpt: str | Path, out_dir: str | Path, hf_config: str | None = None, dtype: str | None = None,
                max_shard_bytes: int = 5 * 1024**3, force: bool = False, quiet: bool = False) -> Summary:
    start = time.monotonic()
    root = Path(ckpt)
    iter_dir = find_iteration_dir(root)
    config, assets = hf_config_for(root if iter_dir != root else root.parent, hf_config)
    spec = spec_for(config)
    amap = architecture_map(spec)
    if any(iter_dir.glob("mp_rank_*")):
        from mcorekit.convert import legacy

        source: Any = legacy.LegacyReader(iter_dir, spec)
    else:
        source = torch_dist.TorchDistReader(iter_dir)
    stored = {k: tuple(v.size) for k, v in source.tensor_keys().items() if k.startswith(MODEL_PREFIXES)}
    wanted = {m.mcore for m in amap.mappings}
    missing, extra = sorted(wanted - set(stored)), sorted(set(stored) - wanted)
    if missing or extra:
        raise ConversionError(
            f"{iter_dir}: checkpoint and config.json disagree: missing {missing[:4]}, unexpected {extra[:4]} "
            f"(wrong --hf-config, or tied embeddings differ?)"
        )
    padded = stored["embedding.word_embeddings.weight"][0]
    if padded < spec.vocab_size:
        raise ConversionError(f"embedding has {padded} rows but config.json says vocab_size={spec.vocab_size}")
    ctx = Ctx(spec, padded)
    shapes = expected_shapes(spec, padded)
    for m in amap.mappings:
        lead = {GLOBAL: 0, LAYER: 1, EXPERT: 2}[m.scope]
        if m.mcore in shapes and stored[m.mcore][lead:] != shapes[m.mcore]:
            raise ConversionError(f"{m.mcore}: stored shape {stored[m.mcore]} does not match config.json ({shapes[m.mcore]} per slice)")
    out_dtype = DTYPES.get(dtype) if dtype else _config_dtype(config)
    summary = Summary()
    total = sum(int(torch.Size(s).numel()) for s in stored.values()) * torch.empty((), dtype=out_dtype or torch.float32).element_size()
    with staged_output(Path(out_dir), force) as tmp:
        writer = HFWriter(tmp, max_shard_bytes)
        bar = _progress(total, "mcore -> hf", quiet)
        # Layer by layer, so HF shards come out in the usual order (embeddings, layer 0, 1, ..., norm, head).
        order = ([m for m in amap.mappings if m.scope == GLOBAL and m.mcore.startswith("embedding")]
                 + [(m, layer) for layer in range(spec.num_layers) for m in amap.mappings if m.scope != GLOBAL]
                 + [m for m in amap.mappings if m.scope == GLOBAL and not m.mcore.startswith("embedding")])
        for item in order:
            m, layer = item if isinstance(item, tuple) else (item, None)
            indices = [()] if layer is None else [(layer,)] if m.scope == LAYER else [(layer, e) for e in range(spec.num_experts)]
            for index in indices:
                tensors = m.to_hf(source.read(m.mcore, index), ctx)
                for name, t in zip(hf_names_at(m, index), tensors):
                    t = t.to(out_dtype) if out_dtype else t
                    writer.add(name, t)
                    n = t.numel() * t.element_size()
                    summary.tensors += 1
                    summary.bytes += n
                    bar.update(n)
        writer.finish()
        bar.close()
        if assets is not None:
            copy_assets(assets, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    summary.seconds = time.monotonic() - start
    return summary


def _config_dtype(config: dict[str, Any]) -> torch.dtype | None:
    name = config.get("dtype") or config.get("torch_dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(name)
