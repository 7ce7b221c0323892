"""LoRA on Megatron-Core's GPTModel: low-rank adapters beside the attention and MLP linear layers, the base frozen.

    target  module                                  parallel kind    A (lora_a)             B (lora_b)
    qkv     self_attention.linear_qkv               column           replicated [3r, H]     split like the weight
    proj    self_attention.linear_proj              row              split on its input      replicated [H, r]
    fc1     mlp.linear_fc1 (and shared_experts.)    column (gated)   replicated [2r, H]     split like the weight
    fc2     mlp.linear_fc2 (and shared_experts.)    row              split on its input      replicated [H, r]

The adapters have PEFT's parameterisation exactly, so a PEFT adapter converts both ways bit for bit: the fused qkv
layer has one A block per HF projection (q, k, v) and the gated fc1 one per half (gate, up), stacked in A's rows;
B is one tensor in the base weight's own output order (per query group [q heads; k; v] for qkv, [gate; up] for fc1),
so it is split over tensor-parallel ranks exactly like the base weight and converts with the weight's own mapping
(models.mapping.QKV / GatedFC1). Output: base(x) + scaling * B_part(A_part(dropout(x))), scaling = alpha / rank.

Where the sums happen under tensor parallelism (tp ranks t; Megatron's autograd mappings do the communication):
  column  z = A x is computed where x lives and made whole: without sequence parallel copy_to (backward all-reduces
          dz, so A's gradient is whole on every rank); with it, an all-gather along the sequence (backward
          reduce-scatter; A's gradient covers this rank's tokens, so A is marked sequence_parallel and Megatron's
          finalize_model_grads sums it over TP). Each rank then applies its rows of B.
  row     z = A_t x_t is a partial sum over the split input; it is all-reduced (or, with sequence parallel,
          reduce-scattered along the sequence, like the base output), then B applied and added after the base
          layer's own reduction. With sequence parallel B's gradient covers this rank's tokens: sequence_parallel.
The rank-r tensors are what cross the wire, not the hidden states.

Transformer Engine's LayerNormColumnParallelLinear (qkv and a dense fc1 in the TE spec) normalises its input inside;
the adapter needs the normalised input as well: TE returns it (return_layernorm_output, set on the layer by
apply_lora; its gradient flows back through TE's norm backward), exactly what the layer's GEMM sees. Where a layer
cannot return it, the same norm is recomputed with the layer's (frozen) weight (_fused_norm; RMSNorm in fp32 as HF
does). The local spec has a separate norm module and the layer's input is normed.

The adapter is a child module `adapter` of the base linear layer (whose class is swapped for a subclass that adds
the adapter in forward and writes its tensors, correctly split, into the sharded state dict), so every base key is
unchanged and the adapter's are `<layer>.adapter.lora_a` / `.lora_b`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from mcorekit.errors import ConfigError, first_line
from mcorekit.models.mapping import COLUMN, GATED_COLUMN, REPLICATED, ROW
from mcorekit.models.spec import ModelSpec

ADAPTER = "adapter"  # the child module's name; its tensors are <base module>.adapter.lora_a / lora_b
A, B = "lora_a", "lora_b"
TARGETS = ("qkv", "proj", "fc1", "fc2")
MODULES = {"linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "fc1", "linear_fc2": "fc2"}
# Take the adapter input of TE's LayerNormLinear (qkv, dense fc1) from TE itself (return_layernorm_output) instead of
# recomputing the norm (_fused_norm): False goes back to the recomputation.
TE_NORM_OUTPUT = True


def is_lora(exp: Any) -> bool:
    return exp.peft.lora is not None


def is_adapter_key(key: str) -> bool:
    return f".{ADAPTER}." in key


def adapter_keys(weight_key: str) -> tuple[str, str]:
    """The A and B keys of the adapter beside Megatron weight `weight_key` (`....linear_qkv.weight`)."""
    base = weight_key.removesuffix("weight")
    return f"{base}{ADAPTER}.{A}", f"{base}{ADAPTER}.{B}"


def scaling(rank: int, alpha: float) -> float:
    return alpha / rank


# ---------------------------------------------------------------- shapes (pure: convert/ and the tests use them)


@dataclass(frozen=True)
class AdapterShape:
    """One adapted layer's A and B: global shapes, and how tensor parallelism splits each (models.mapping's names)."""

    target: str
    parts: int  # A blocks: 3 for qkv (q, k, v), 2 for a gated fc1 (gate, up), else 1
    in_features: int
    out_features: int
    a_split: str
    b_split: str

    def a_shape(self, rank: int) -> tuple[int, int]:
        return (self.parts * rank, self.in_features)

    def b_shape(self, rank: int) -> tuple[int, int]:
        return (self.out_features, rank)

    def local(self, rank: int, tp: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(A, B) shapes on one of `tp` tensor-parallel ranks."""
        a, b = self.a_shape(rank), self.b_shape(rank)
        a = (a[0], a[1] // tp) if self.a_split == ROW else a
        b = (b[0] // tp, b[1]) if self.b_split in (COLUMN, GATED_COLUMN) else b
        return a, b


def adapter_shape(spec: ModelSpec, target: str, ffn: int | None = None) -> AdapterShape:
    """`ffn`: the MLP's hidden size where it is not the dense one (a shared expert)."""
    H, d = spec.hidden_size, spec.kv_channels
    f = ffn or spec.ffn_hidden_size
    if target == "qkv":
        return AdapterShape(target, 3, H, (spec.num_attention_heads + 2 * spec.num_query_groups) * d, REPLICATED, COLUMN)
    if target == "proj":
        return AdapterShape(target, 1, spec.num_attention_heads * d, H, ROW, REPLICATED)
    if target == "fc1":
        return AdapterShape(target, 2, H, 2 * f, REPLICATED, GATED_COLUMN)
    if target == "fc2":
        return AdapterShape(target, 1, f, H, ROW, REPLICATED)
    raise ConfigError(f"unknown LoRA target {target!r}; choose from {', '.join(TARGETS)}")


# ---------------------------------------------------------------- the adapter


class LoraAdapter(torch.nn.Module):
    """A and B of one layer (this rank's parts) and the forward that adds scaling * B(A(x)) to the base output."""

    def __init__(self, shape: AdapterShape, rank: int, alpha: float, dropout: float, tp: int, tp_rank: int,
                 sequence_parallel: bool, query_groups: int, kv_channels: int, seed: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.shape, self.rank, self.scaling = shape, rank, scaling(rank, alpha)
        self.tp, self.sequence_parallel = tp, sequence_parallel and tp > 1
        self.query_groups = query_groups // tp if shape.target == "qkv" else 0  # this rank's groups
        self.kv_channels = kv_channels
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        self.enabled = True
        self._mask: torch.Tensor | None = None  # _b_full's block mask, made on first use in B's dtype and device
        self._mask_scaled = False
        # PEFT's initialisation: A kaiming-uniform (a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) per block, B zero, so the
        # model starts as the base. One generator per layer from the run's seed: every rank draws the same full A
        # and keeps its part, so the replicas agree without communication.
        g = torch.Generator().manual_seed(seed)
        full_a = (torch.rand(shape.a_shape(rank), generator=g, dtype=torch.float32) * 2 - 1) / math.sqrt(shape.in_features)
        a_local, b_local = shape.local(rank, tp)
        if shape.a_split == ROW:
            full_a = full_a.chunk(tp, dim=1)[tp_rank]
        self.lora_a = torch.nn.Parameter(full_a.to(dtype=dtype, device=device).contiguous())
        self.lora_b = torch.nn.Parameter(torch.zeros(b_local, dtype=dtype, device=device))
        assert tuple(self.lora_a.shape) == a_local
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(self.lora_a, shape.a_split == ROW and tp > 1, 1, 1)
        set_tensor_model_parallel_attributes(self.lora_b, shape.b_split != REPLICATED and tp > 1, 0, 1)
        # The replicated one of a pair sees only this rank's tokens under sequence parallel: Megatron sums it over TP.
        replicated = self.lora_a if shape.a_split == REPLICATED else self.lora_b
        replicated.sequence_parallel = self.sequence_parallel

    def forward(self, x: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
        """scaling * B(A(dropout(x))), added to `base` (the base layer's output) when given.

        Few and small kernels (at ~1B parameters and 2k tokens the LoRA step is bound by launches on the host): the
        scaling rides on B's GEMM (addmm's alpha, or folded into the block mask), the base output is its addend."""
        from megatron.core import tensor_parallel as tpm

        if self.dropout is not None:
            x = self._dropout(x)
        z = F.linear(x, self.lora_a)
        column = self.shape.a_split == REPLICATED
        if self.tp > 1:
            if column:
                z = (tpm.gather_from_sequence_parallel_region(z, tensor_parallel_output_grad=True)
                     if self.sequence_parallel else tpm.copy_to_tensor_model_parallel_region(z))
            else:
                z = (tpm.reduce_scatter_to_sequence_parallel_region(z) if self.sequence_parallel
                     else tpm.reduce_from_tensor_model_parallel_region(z))
        b, alpha = self._b_full()
        lead, n = z.shape[:-1], b.shape[0]
        z2 = z.reshape(-1, z.shape[-1])
        if base is not None and base.dtype == z.dtype:
            return torch.addmm(base.reshape(-1, n), z2, b.t(), alpha=alpha).view(*lead, n)
        delta = F.linear(z2, b).view(*lead, n)
        delta = delta * alpha if alpha != 1 else delta
        return delta if base is None else base + delta.to(base.dtype)

    def _b_full(self) -> tuple[torch.Tensor, float]:
        """B as one [out, parts * r] matrix for a single GEMM against z = [z_1 .. z_parts], and the scaling still to
        apply. With several parts (PEFT's separate q/k/v, gate/up) output row o must see only its own part's block
        of z: B's row is placed in that block and the other blocks are exact zeros (B * a one-hot mask; the extra
        zero products are free beside the launches they save). The mask carries the scaling where it is exact in
        B's dtype (2 for alpha = 2 r), so nothing else is scaled."""
        b = self.lora_b
        if self.shape.parts == 1:
            return b, self.scaling
        mask = self._mask
        if mask is None or mask.dtype != b.dtype or mask.device != b.device:
            mask = self._mask = self._block_mask(b.dtype, b.device)
        folded = self._mask_scaled
        return (b.unsqueeze(1) * mask).flatten(1), (1.0 if folded else self.scaling)

    def _block_mask(self, dtype: torch.dtype, device: Any) -> torch.Tensor:
        """[out, parts, 1]: 1 (or the scaling) at each local output row's part, in the base weight's row order:
        [gate_t; up_t] for fc1, per local query group [q heads; k; v] for qkv."""
        out, parts = self.lora_b.shape[0], self.shape.parts
        if self.shape.target == "fc1":
            part = torch.arange(parts).repeat_interleave(out // parts)
        else:
            g, d = self.query_groups, self.kv_channels
            part = torch.tensor([0] * (out // g - 2 * d) + [1] * d + [2] * d).repeat(g)
        scale = torch.tensor(self.scaling, dtype=dtype)
        self._mask_scaled = scale.item() == self.scaling  # exact in B's dtype: fold it in
        onehot = F.one_hot(part, parts).to(dtype) * (scale if self._mask_scaled else 1)
        return onehot.unsqueeze(-1).to(device)

    def _up(self, z: torch.Tensor) -> torch.Tensor:
        """B applied block by block (the reference the one-GEMM forward is checked against in the tests)."""
        r, b = self.rank, self.lora_b
        if self.shape.parts == 1:
            return F.linear(z, b)
        zs = z.split(r, dim=-1)
        if self.shape.target == "fc1":  # this rank's rows are [gate_t; up_t]
            gate, up = b.chunk(2, dim=0)
            return torch.cat([F.linear(zs[0], gate), F.linear(zs[1], up)], dim=-1)
        g, d = self.query_groups, self.kv_channels  # qkv: per local query group [q heads; k; v]
        bq, bk, bv = b.view(g, -1, r).split([b.shape[0] // g - 2 * d, d, d], dim=1)
        lead = z.shape[:-1]
        outs = [F.linear(zi, bi.reshape(-1, r)).view(*lead, g, -1) for zi, bi in zip(zs, (bq, bk, bv))]
        return torch.cat(outs, dim=-1).reshape(*lead, b.shape[0])

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """On an input split over TP ranks (row layers, or sequence parallel) each rank draws its own mask from
        Megatron's model-parallel RNG; a replicated input takes the default RNG, the same on every TP rank."""
        if self.tp > 1 and (self.shape.a_split == ROW or self.sequence_parallel):
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None,
                           tp_group: Any = None, dp_group: Any = None) -> dict[str, Any]:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {}
        if self.shape.a_split == ROW:
            axes[A] = 1
        if self.shape.b_split != REPLICATED:
            axes[B] = 0
        sd = make_sharded_tensors_for_checkpoint({A: self.lora_a, B: self.lora_b}, prefix, axes, sharded_offsets,
                                                 tp_group=tp_group, dp_cp_group=dp_group)
        if self.shape.b_split == GATED_COLUMN:  # stored [gate; up] over all ranks, like the fc1 weight
            singleton = (metadata or {}).get("singleton_local_shards", False)
            sd[f"{prefix}{B}"] = apply_swiglu_sharded_factory(sd[f"{prefix}{B}"], sharded_offsets, singleton,
                                                              tp_group=tp_group, dp_group=dp_group)
        return sd

    def extra_repr(self) -> str:
        return f"target={self.shape.target}, rank={self.rank}, scaling={self.scaling:g}, tp={self.tp}"


class LoraLayer:
    """Mixed into a base linear layer's class: the adapter's output is added to the base output (after the base
    layer's own reduction for row layers), and its tensors enter the sharded state dict with their own splits."""

    adapter: LoraAdapter

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(x, *args, **kwargs)  # type: ignore[misc]
        normed = None
        if getattr(self, "return_layernorm_output", False):  # TE LayerNormLinear set up by apply_lora
            if len(out) == 3:  # te_return_bias: TE's (out, bias, ln_out), passed on by Megatron
                output, bias, normed = out
            else:  # Megatron's (TE's (out, ln_out), None)
                (output, normed), bias = out
        else:
            output, bias = out
        if not self.adapter.enabled:
            return output, bias
        if normed is None:
            normed = _fused_norm(self, x) if getattr(self, "layer_norm_weight", None) is not None else x
        return self.adapter(normed, output), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)  # type: ignore[misc]
        sd = {k: v for k, v in sd.items() if not k.startswith(f"{prefix}{ADAPTER}.")}
        tp_group = getattr(self, "tp_group", None) or getattr(self, "_tp_group", None)
        sd.update(self.adapter.sharded_state_dict(f"{prefix}{ADAPTER}.", sharded_offsets, metadata,
                                                  tp_group=tp_group, dp_group=metadata["dp_cp_group"]))
        return sd


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lora{cls.__name__}", (LoraLayer, cls), {})
    return _CLASSES[cls]


def _te_norm_linear(module: Any) -> bool:
    """A Transformer Engine LayerNormLinear that can hand out its normalised input (this rank's tokens, not the
    sequence-parallel gathered ones, which is what the adapter's column path expects)."""
    return (getattr(module, "layer_norm_weight", None) is not None and hasattr(module, "return_layernorm_output")
            and not getattr(module, "return_layernorm_output_gathered", False))


def _fused_norm(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The norm Transformer Engine's LayerNormLinear applies inside, with its weight: what the linear part sees."""
    cfg = layer.config
    w = layer.layer_norm_weight
    w = w + 1 if cfg.layernorm_zero_centered_gamma else w
    h = x.float()
    if cfg.normalization == "RMSNorm":
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon)
        return w * h.to(x.dtype)
    bias = getattr(layer, "layer_norm_bias", None)
    return F.layer_norm(h, (h.shape[-1],), w.float(), None if bias is None else bias.float(),
                        cfg.layernorm_epsilon).to(x.dtype)


# ---------------------------------------------------------------- applying it to a model


def targets_in(model: torch.nn.Module, targets: list[str], experts: bool = False) -> list[tuple[str, Any, str]]:
    """(name, module, target) of every linear layer LoRA adapts: attention and dense or shared-expert MLP layers;
    routed experts only with `experts` (not built: config.rules refuses it). Not the multi-token prediction layers
    (model.mtp): PEFT and HF inference have none, so their adapters could not be exported; they stay frozen, and their
    loss still trains the adapters of the layers before them."""
    out = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        target = MODULES.get(leaf)
        if target is None or target not in targets or ".layers." not in f".{name}" or name.startswith("mtp."):
            continue
        if ".experts." in f"{name}." and not experts:
            continue
        out.append((name, module, target))
    return out


def _layer_number(model: torch.nn.Module, name: str) -> int:
    """The global (1-based) number of the transformer layer holding module `name`."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        m = model.get_submodule(".".join(parts[:i])) if i else model
        if hasattr(m, "layer_number") and hasattr(m, "self_attention"):
            return int(m.layer_number)
    raise ValueError(f"{name} is not inside a transformer layer")


def apply_lora(model: torch.nn.Module, lora: Any, spec: ModelSpec, seed: int = 0) -> int:
    """Freeze every parameter of `model` (one GPTModel chunk, before Float16Module/DDP) and give each target layer
    an adapter; returns the number of adapted layers. `lora` is the experiment's peft.lora (config.LoraConfig)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for p in model.parameters():
        p.requires_grad_(False)
    found = targets_in(model, list(lora.target_modules), lora.experts)
    for name, module, target in found:
        cfg = module.config
        ffn = spec.moe_shared_expert_ffn_hidden_size if ".shared_experts." in f".{name}." else None
        shape = adapter_shape(spec, target, ffn)
        if target == "fc1" and not cfg.gated_linear_unit:
            shape = AdapterShape("fc1", 1, shape.in_features, shape.out_features // 2, REPLICATED, COLUMN)
        layer = _layer_number(model, name)
        # a seed per layer and target: the same on every rank (TP/DP/PP), different for each layer
        layer_seed = (seed * 1_000_003 + layer * 64 + TARGETS.index(target) * 2 + (ffn is not None)) % 2**63
        weight = module.weight
        adapter = LoraAdapter(shape, lora.rank, lora.alpha, lora.dropout, tp, tp_rank, cfg.sequence_parallel,
                              spec.num_query_groups, spec.kv_channels, layer_seed, weight.dtype, weight.device)
        module.__class__ = _lora_class(type(module))
        module.add_module(ADAPTER, adapter)
        if TE_NORM_OUTPUT and _te_norm_linear(module):
            module.return_layernorm_output = True  # read by TE's forward on each call; LoraLayer.forward unpacks it
    return len(found)


def adapters(model_chunks: list[Any] | Any) -> list[LoraAdapter]:
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [m for c in chunks for m in c.modules() if isinstance(m, LoraAdapter)]


@contextmanager
def adapters_disabled(model_chunks: list[Any] | Any) -> Iterator[None]:
    """The base model: every adapter off inside the block (DPO's reference model with LoRA, no second copy)."""
    found = adapters(model_chunks)
    before = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, on in zip(found, before):
            a.enabled = on


def parameter_counts(model_chunks: list[Any] | Any) -> tuple[int, int]:
    """(trainable, frozen) parameters on this rank."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    params = {id(p): p for c in chunks for p in c.parameters()}.values()
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return trainable, sum(p.numel() for p in params) - trainable


def adapter_start(lora: Any) -> Path:
    """The iteration directory of peft.lora.load, once its lora.json shows adapters of the run's rank, alpha
    and targets (`lora`: the experiment's config.LoraConfig). The run scales them by its own alpha / rank (a PEFT r=8,
    alpha=8 adapter in a run with the default alpha 32 would be scaled 4x, and its checkpoints would record alpha 32)
    and loads only its own targets' tensors. Checked by the launcher before queueing too (launch/plan.check)."""
    import json

    from mcorekit.train import checkpoint  # it imports this module

    given = Path(str(lora.load))
    path = checkpoint.start_of(given)
    file = path / checkpoint.LORA_JSON
    if not file.is_file():
        raise ConfigError(f"peft.lora.load={given}: {path} has no {checkpoint.LORA_JSON}, so it holds no LoRA adapters "
                          f"(a peft.lora run writes one in each checkpoint; `mcorekit convert hf-to-mcore HF_DIR OUT "
                          f"--lora PEFT_DIR` converts a PEFT adapter)")
    try:
        info = json.loads(file.read_text())
        stored = {"rank": info["rank"], "alpha": float(info["alpha"]), "target_modules": list(info["target_modules"])}
    except (OSError, ValueError, KeyError, TypeError, ArithmeticError, RecursionError) as e:
        raise ConfigError(f"peft.lora.load={given}: {file} is unreadable or lacks rank, alpha or target_modules "
                          f"({type(e).__name__}: {first_line(e)})") from None
    ours = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}
    differ = [k for k in ours if (sorted(map(str, stored[k])) != sorted(ours[k]) if k == "target_modules"
                                  else stored[k] != ours[k])]
    if differ:
        theirs = ", ".join(f"{k} {_override(stored[k])}" for k in differ)
        run = ", ".join(f"peft.lora.{k}={_override(ours[k])}" for k in differ)
        fix = " ".join(f"peft.lora.{k}={_override(stored[k])}" for k in differ)
        raise ConfigError(f"peft.lora.load={given}: the adapters have {theirs} ({file}), but this run has {run}; set "
                          f"{fix} (the run scales the adapters by alpha / rank and loads its targets' tensors)")
    return path


def _override(value: Any) -> str:
    """A value as an override writes it (a list as [qkv,proj])."""
    return f"[{','.join(map(str, value))}]" if isinstance(value, list) else str(value)
