"""Where metrics go (stdout, <run>/metrics.jsonl, TensorBoard, Weights & Biases) and the MoE expert-load statistics."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def process_start() -> float:
    """When this process started, on time.time()'s clock: the kernel's start tick of the process (/proc, 10 ms), so
    that start-up includes the interpreter's own start and every import; the current time where /proc is missing."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class Startup:
    """Seconds from process start to the end of each start-up phase (imports, checks: the rules against this node,
    which import Megatron-Core and TE, distributed init, model built, optimizer built, resume, first step); reported
    once, at this process's first step: rank 0 prints it as one line and writes <run>/startup.json (the issue: 33 s
    from start to step 1 on the 3B shape)."""

    FILE = "startup.json"

    def __init__(self) -> None:
        self.start = process_start()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        self.phases[phase] = round(time.time() - self.start, 2)

    def report(self, run_dir: Path) -> None:
        self.mark("step1")
        if dist.get_rank() == 0:
            (run_dir / self.FILE).write_text(json.dumps(self.phases, indent=1) + "\n")
            print("mcorekit.train: startup " + json.dumps(self.phases), flush=True)


startup = Startup()  # one per process: __main__, build and the loop mark their phases on it

WANDB_ID_FILE = "wandb-run-id"  # in the run folder: a requeued or resumed job continues the same W&B run


def _wandb_run(run_dir: Path, config: Any, name: str) -> Any:
    """wandb.init for this run folder: offline runs are written under <run>/wandb (`wandb sync` uploads them)."""
    import os
    import secrets
    import string

    import wandb

    id_file = run_dir / WANDB_ID_FILE
    run_id = (id_file.read_text().strip() if id_file.is_file() else
              "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8)))
    id_file.write_text(run_id + "\n")
    os.environ.setdefault("WANDB_SILENT", "true")  # no banner lines in every rank-0 log
    return wandb.init(project=config.project, entity=config.entity, name=config.name or name, mode=config.mode,
                      dir=str(run_dir), id=run_id, resume="allow")


def end_lines(path: Path) -> None:
    """A process killed mid-write left a line without its newline: end it, so the next line starts its own."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    f.write(b"\n")
    except FileNotFoundError:
        pass


class MetricsWriter:
    """Rank 0 writes metrics.jsonl, and TensorBoard and W&B where asked (`wandb`: an experiment's logging.wandb;
    `name`: the run's W&B name when that names none); other ranks hold a no-op writer."""

    def __init__(self, run_dir: Path, tensorboard: bool, enabled: bool, wandb: Any = None,
                 name: str | None = None) -> None:
        self.enabled = enabled
        self.jsonl = run_dir / "metrics.jsonl"
        if enabled:
            end_lines(self.jsonl)
        self.tb = None
        self.wandb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if enabled and wandb is not None and wandb.mode != "disabled":
            self.wandb = _wandb_run(run_dir, wandb, name or run_dir.name)

    def write(self, step: int, total_steps: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        print(f"step {step}/{total_steps} " + " ".join(f"{k} {v:.4g}" for k, v in scalars.items()), flush=True)
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        with open(self.jsonl, "a") as f:  # NaN and inf as null: JSON has no such numbers
            f.write(json.dumps(finite) + "\n")
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            for layer, counts in (metrics.get("expert_tokens") or {}).items():
                self.tb.add_histogram(f"expert_tokens/layer_{layer}", torch.tensor(counts, dtype=torch.float32), step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            import wandb

            self.wandb.finish()
            # finish() can return before W&B's service has written the run file (an offline run's file held only its
            # 7-byte header in 1 of 4-8 tries on a loaded machine); teardown waits for the service to end.
            wandb.teardown()
            self.wandb = None


class ExpertLoad:
    """Tokens routed to each expert, per MoE layer, counted on the GPU by a hook on every router (no host sync
    until it is read). Read it at log time: summed over the data-parallel ranks (and expert-parallel ranks,
    which see other tokens), it gives per-layer counts and the imbalance max/mean (1.0 = perfectly even).
    With token dropping (moe.capacity_factor: Megatron-Core's moe_expert_capacity_factor) the router's routing map
    is the one after the capacity dropped token-slots: the counts are what was kept, and the slots routed (tokens x
    top-k) give the share dropped, per layer and over all of them. Padded to capacity (moe.pad_to_capacity:
    moe_pad_expert_input_to_capacity) the map is the capacity's own mask instead, every expert's column holding its
    capacity, padding slots included: a kept slot is then one whose routing prob is not 0 (Megatron-Core's
    apply_router_token_dropping zeroes the probs of dropped and of padding slots; a routed slot's prob is > 0)."""

    def __init__(self, model_chunks: list[Any], sequence_parallel: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.sequence_parallel = sequence_parallel
        self.counts: dict[str, torch.Tensor] = {}
        self.routed: dict[str, torch.Tensor] = {}  # token-slots routed before the capacity, where it drops any
        for chunk in model_chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, TopKRouter):
                    c = module.config
                    drops = c.moe_expert_capacity_factor is not None
                    padded = drops and c.moe_pad_expert_input_to_capacity
                    module.register_forward_hook(functools.partial(self._hook, router_label(name, module), drops,
                                                                   padded))

    def _hook(self, layer: str, drops: bool, padded: bool, module: Any, inputs: Any,
              output: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # validation, or the no-grad first pass of a recomputed region (its replay in backward counts)
        probs, routing_map = output
        if padded:  # the map is every expert's capacity, padding slots too: the kept slots are those with a prob
            routing_map = routing_map & (probs != 0)
        per_expert = routing_map.sum(dim=0)
        if layer not in self.counts:
            self.counts[layer] = torch.zeros_like(per_expert)  # int64: exact at any count
            if drops:
                self.routed[layer] = torch.zeros_like(per_expert[:1])
        # in place: a step captured as a CUDA graph replays this add into the same buffer (the hook itself runs
        # only while capturing)
        self.counts[layer].add_(per_expert)
        if drops:  # every token is routed to top-k experts; the map [tokens, experts] keeps those within capacity
            self.routed[layer].add_(routing_map.shape[0] * module.topk)

    def read_and_reset(self) -> dict[str, Any]:
        if not self.counts:
            return {}
        from megatron.core import parallel_state as ps

        layers = sorted(self.counts, key=label_order)
        none = torch.zeros_like(self.counts[layers[0]][:1])
        # one row per layer: its experts' counts, then its routed slots (0 where nothing is dropped)
        stacked = torch.stack([torch.cat([self.counts[layer], self.routed.get(layer, none)]) for layer in layers])
        # Sum over every rank that routes other tokens: data- and context-parallel peers (expert-parallel ranks
        # are among them), and tensor-parallel peers when sequence parallelism splits the tokens between them.
        dist.all_reduce(stacked, group=ps.get_data_parallel_group(with_context_parallel=True))
        if ps.get_tensor_model_parallel_world_size() > 1 and self.sequence_parallel:
            dist.all_reduce(stacked, group=ps.get_tensor_model_parallel_group())
        for counts in (*self.counts.values(), *self.routed.values()):
            counts.zero_()
        pairs = list(zip(layers, stacked.long().tolist()))
        if ps.get_pipeline_model_parallel_world_size() > 1:  # other stages hold the other layers
            gathered: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(gathered, pairs, group=ps.get_pipeline_model_parallel_group())
            pairs = sorted((p for part in gathered for p in part), key=lambda p: label_order(p[0]))
        layers = [layer for layer, _ in pairs]
        rows = [row[:-1] for _, row in pairs]
        routed = [row[-1] for _, row in pairs]
        counts = torch.tensor(rows, dtype=torch.float32)
        imbalance = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1)).tolist()
        out = {"expert_imbalance_max": max(imbalance),
               "expert_imbalance": {layer: round(v, 4) for layer, v in zip(layers, imbalance)},
               "expert_tokens": {layer: row for layer, row in zip(layers, rows)}}
        if any(routed):
            out.update(dropped_shares(layers, rows, routed))
        return out


def dropped_shares(layers: list[str], rows: list[list[int]], routed: list[int]) -> dict[str, Any]:
    """The share of routed token-slots the capacity dropped: `expert_dropped` over every MoE layer,
    `expert_dropped_max` the worst layer's, `expert_dropped_per_layer` each one's (the layers under a capacity)."""
    kept = {layer: sum(row) for layer, row, n in zip(layers, rows, routed) if n}
    total = {layer: n for layer, n in zip(layers, routed) if n}
    share = {layer: 1 - kept[layer] / total[layer] for layer in total}
    return {"expert_dropped": 1 - sum(kept.values()) / sum(total.values()),
            "expert_dropped_max": max(share.values()),
            "expert_dropped_per_layer": {layer: round(v, 4) for layer, v in share.items()}}


MTP_LAYER = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.")  # under the model's wrappers (DDP, Float16Module) too


def router_label(name: str, module: Any) -> str:
    """A router's layer as the metrics name it: the decoder layer's global number ("4"), or "mtp_<k>" for the k-th
    multi-token prediction layer, whose inner layer Megatron-Core numbers from 1 again (it would merge into layer 1)."""
    if m := MTP_LAYER.search(name):
        return f"mtp_{int(m.group(1)) + 1}"
    return str(int(module.layer_number))


def label_order(label: str) -> tuple[bool, int]:
    return label.startswith("mtp_"), int(label.removeprefix("mtp_"))


def mtp_losses(layers: int, micro_batches: int) -> dict[str, float]:
    """The step's multi-token-prediction loss from Megatron-Core's MTPLossLoggingHelper (each MTP layer's masked mean
    cross entropy, summed over the micro-batches on the last pipeline stage), averaged over micro-batches and
    data-parallel ranks and sent to every stage, then reset for the next step: `mtp_loss` (the mean over the MTP
    layers; unscaled by mtp_loss_scale), and `mtp_<k>_loss` per layer when there are several."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.reduce_metrics_in_tracker()  # the average over data-parallel ranks, where it was recorded
    recorded = MTPLossLoggingHelper.tracker.get("loss_values")
    values = recorded / micro_batches if recorded is not None else torch.zeros(layers, device="cuda")
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    if ps.get_pipeline_model_parallel_world_size() > 1:  # only the last stage recorded it
        dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
    out = {"mtp_loss": float(values.mean())}
    if layers > 1:
        out.update({f"mtp_{k + 1}_loss": float(v) for k, v in enumerate(values.tolist())})
    return out
