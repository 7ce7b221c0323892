"""Direct preference optimisation (data.kind=dpo): the sigmoid DPO loss on the margin between the policy's and the
reference model's log-probs of a chosen and a rejected response, optionally plus the NLL of the chosen response.

A sample is a whole pair, so `schedule.micro_batch_size` and `global_batch_size` count PAIRS: the model sees 2 x
micro_batch_size sequences per micro-batch (the chosen ones, then the rejected ones: `rows_per_sample` = 2), and a
pair is never split between micro-batches, pipeline paths or context-parallel groups. With data.packing a sample is
one packed row of whole pairs (both sequences of a pair in the same row, attention kept within each sequence), so
the batch sizes count packed rows, as they do for packed SFT.

Per sequence: logp = sum over its response tokens of log p(token) (Megatron's model returns the per-token cross
entropy when given labels: logp = -loss), summed over the context-parallel ranks' chunks. With
m = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected):
    loss = mean over the step's pairs of -(1 - label_smoothing) * logsigmoid(beta * m)
                                         - label_smoothing * logsigmoid(-beta * m)
           + sft_weight * (NLL of the chosen responses, mean over the step's chosen response tokens)
(each micro-batch sums its pairs and divides by the step's count over micro-batches x DP ranks: tasks/base.step_share)
Metrics, with TRL's names and definitions, means over the step's pairs: rewards/chosen = beta * (pi_chosen -
ref_chosen), rewards/rejected likewise, rewards/accuracies = fraction of pairs with rewards/chosen > rewards/rejected,
rewards/margins = mean of their difference, logps/chosen and logps/rejected = the policy's summed log-probs,
nll_loss (with sft_weight).

Reference log-probs (dpo.reference):
  live         the default: a frozen copy of the starting weights on the same GPUs (same layout, no optimizer, no
               DDP; bf16 weights: ~2 of the ~18 bytes per parameter that training holds), run forward-only through
               Megatron's (pipeline) schedule over each step's micro-batches before the training pass. With LoRA the
               reference is the policy itself with its adapters off: no copy at all.
  precomputed  one forward-only pass of that same reference over every pair before the first step, stored in
               <run dir>/reference_logps/{train,valid}.safetensors (with a fingerprint of the data, the pairs'
               tokens, sequence length, packing, model and the iteration checkpoint.load resolves to) and read
               back by pair index; the copy is freed afterwards. A resumed run reads the file; a changed
               fingerprint recomputes it.
The starting weights are those of checkpoint.load (weights only) or, without it, the initial weights: rebuilt
from the seeds train/build.py initialises the policy with.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from contextlib import contextmanager, nullcontext
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from mcorekit.errors import ConfigError
from mcorekit.runtime.ranks import any_rank
from mcorekit.train.data.preference import TOKEN_KEYS, collate, pair_batches
from mcorekit.train.tasks.base import LossFunc, Task, share_of, weighted_mean
from mcorekit.train.tasks.lm import next_token_losses

if TYPE_CHECKING:
    from mcorekit.config.experiment import Experiment
    from mcorekit.models.spec import ModelSpec
    from mcorekit.train.build import Trainer
    from mcorekit.train.data.preference import PreferenceDataset

log = logging.getLogger("mcorekit.train")
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


# ---------------------------------------------------------------- the loss (pure: tensors in, tensors out)


def sum_over_ranks(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x summed over the group's ranks, with the gradient of this rank's own part: each context-parallel rank
    back-propagates the loss of the whole sequence through its own chunks only (Megatron's schedule then scales the
    loss by the CP size, and DDP averages over DP x CP ranks, as for lm.masked_mean)."""
    total = x.detach().clone()
    torch.distributed.all_reduce(total, group=group)
    return x + (total - x.detach())


def sequence_logps(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor | None,
                   num_seqs: int, cp_group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob, number of response tokens) of each of the micro-batch's sequences. Sequence k is row k
    (unpacked), or the tokens whose seq_ids is k (packed rows); loss_mask selects the response tokens."""
    mask = loss_mask.float()
    if seq_ids is None:
        seq_ids = torch.arange(mask.shape[0], device=mask.device).unsqueeze(1).expand_as(mask)
    ids = seq_ids.reshape(-1)
    logps = mask.new_zeros(num_seqs).index_add(0, ids, (-per_token_loss.float() * mask).reshape(-1))
    tokens = mask.new_zeros(num_seqs).index_add(0, ids, mask.reshape(-1))
    if cp_group is not None:
        logps = sum_over_ranks(logps, cp_group)
        torch.distributed.all_reduce(tokens, group=cp_group)
    return logps, tokens


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, label_smoothing: float = 0.0, sft_weight: float = 0.0,
             chosen_tokens: torch.Tensor | None = None,
             share: torch.Tensor | None = None,
             token_share: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's loss (mean over its pairs, or their sum over `share`: base.step_share, the step's mean over
    all its pairs) and its metrics (TRL's names, taken the same way). Inputs: per-pair summed log-probs [pairs];
    chosen_tokens: the chosen responses' token counts (for sft_weight's per-token NLL: their mean, or their sum over
    `token_share`, the step's mean over every chosen response token)."""
    def mean(x: torch.Tensor) -> torch.Tensor:
        return x.mean() if share is None else x.sum() / share

    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    losses = -(1 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    loss = mean(losses)
    nll = None
    if sft_weight:
        assert chosen_tokens is not None, "sft_weight needs the chosen responses' token counts"
        nll = -policy_chosen.sum() / (chosen_tokens.sum().clamp(min=1) if token_share is None else token_share)
        loss = loss + sft_weight * nll
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    metrics = {
        "loss": loss.detach().clone(),
        "rewards/chosen": mean(chosen_rewards),
        "rewards/rejected": mean(rejected_rewards),
        "rewards/accuracies": mean((chosen_rewards > rejected_rewards).float()),
        "rewards/margins": mean(chosen_rewards - rejected_rewards),
        "logps/chosen": mean(policy_chosen.detach()),
        "logps/rejected": mean(policy_rejected.detach()),
    }
    if nll is not None:
        metrics["nll_loss"] = nll.detach()
    return loss, metrics


def micro_batch_loss(per_token_loss: torch.Tensor, batch: dict[str, Any], loss_mask: torch.Tensor, beta: float,
                     label_smoothing: float = 0.0, sft_weight: float = 0.0,
                     cp_group: Any = None,
                     share: torch.Tensor | None = None,
                     token_share: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """dpo_loss of one micro-batch from the model's per-token losses: its sequences are [chosen of its pairs...,
    rejected of its pairs...] (preference.collate), the reference's in batch["ref_logps"] in the same order."""
    pairs = batch["pair_ids"].numel()
    logps, tokens = sequence_logps(per_token_loss, loss_mask, batch.get("seq_ids"), 2 * pairs, cp_group)
    ref = batch["ref_logps"]
    return dpo_loss(logps[:pairs], logps[pairs:], ref[:pairs], ref[pairs:], beta, label_smoothing, sft_weight,
                    tokens[:pairs], share, token_share)


def chosen_tokens(batch: dict[str, Any]) -> torch.Tensor:
    """The number of chosen-response tokens in a micro-batch: its first `pairs` rows, or in a packed row the tokens
    of sequences 0..pairs-1 (seq_ids, as sequence_logps counts them)."""
    pairs, mask = batch["pair_ids"].numel(), batch["loss_mask"]
    return mask[batch["seq_ids"] < pairs].sum() if "seq_ids" in batch else mask[:pairs].sum()


def step_totals(counts: list[list[Any]], device: Any) -> torch.Tensor:
    """base.step_total of several counts at once: one row per micro-batch, one column per count (pairs, tokens),
    each column summed over the step and the data-parallel ranks in one all-reduce over the DP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    rows = [torch.stack([torch.as_tensor(c, dtype=torch.float32, device=device) for c in row]) for row in counts]
    total = torch.stack(rows).sum(dim=0)  # whole counts in float32: the same sums as step_total's, column by column
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return total


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """What next_token_losses cuts for context parallelism and feeds the model: the per-token tensors (and a packed
    row's boundaries), not the per-pair values."""
    return {k: batch[k] for k in (*TOKEN_KEYS, "cu_seqlens", "max_seqlen") if k in batch}


# ---------------------------------------------------------------- the task


class DirectPreferenceOptimization(Task):
    name = "dpo"
    padded = True

    def __init__(self, exp: Experiment, spec: ModelSpec, run_dir: Path) -> None:
        super().__init__(exp, spec, run_dir)
        self.rows_per_sample = 1 if exp.data.packing else 2  # a pair: its chosen and its rejected sequence
        self.metrics = METRICS + (("nll_loss",) if exp.dpo.sft_weight else ())
        self.datasets: dict[str, PreferenceDataset] = {}
        self.reference: Reference | None = None

    def dataset(self, validation: bool = False) -> Any:
        from mcorekit.train.data import build_dataset

        data = build_dataset(self.exp, self.spec, self.run_dir, validation=validation)
        self.datasets["valid" if validation else "train"] = data
        return data

    def batches(self, dataset: Any, first_sample: int, dp_rank: int, dp_size: int) -> Iterator[dict[str, Any]]:
        return pair_batches(dataset, self.exp.schedule.micro_batch_size, first_sample, dp_rank, dp_size)

    def prepare_step(self, t: Trainer, data: list[Iterator[dict[str, Any]]],
                     num_microbatches: int) -> list[Iterator[dict[str, Any]]]:
        """live: this step's micro-batches with the reference's log-probs attached (one forward-only pass of the
        reference through the same schedule first). precomputed: the data as it is (its samples carry them); the
        first call computes or reads them for every dataset."""
        if self.reference is None:
            self.reference = Reference(t, self)
            if self.exp.dpo.reference == "precomputed":
                for name, data_set in sorted(self.datasets.items()):
                    self._precompute(t, name, data_set, num_microbatches)
                self.reference.release()
        step = self.read_counted_step(t, data, num_microbatches)
        if self.exp.dpo.reference == "live":
            for batch, logps in zip(step, self.reference.logps(step)):  # the last pipeline stage gets them
                batch["ref_logps"] = logps
        # a mean over the step's pairs: packed rows hold different numbers of pairs; with sft_weight the NLL's over
        # the step's chosen response tokens, counted in the same all-reduce
        sft = bool(self.exp.dpo.sft_weight)
        counts = [[b["pair_ids"].numel(), chosen_tokens(b)] if sft else [b["pair_ids"].numel()] for b in step]
        totals = step_totals(counts, step[0]["tokens"].device)
        pairs = totals[0]
        share = share_of(pairs, len(step))
        self.step_counts = {name: pairs for name in self.metrics}  # validation: means over all its batches' pairs
        token_share = None
        if sft:
            token_share = share_of(totals[1], len(step))
            self.step_counts["nll_loss"] = totals[1]  # over all their chosen response tokens
        for batch in step:
            batch["pair_share"], batch["chosen_share"] = share, token_share
        return [iter(step) for _ in data]

    def mean_over_steps(self, values: list[dict[str, float]],
                        counts: list[dict[str, float]]) -> dict[str, float]:
        """Task.mean_over_steps; with sft_weight the loss is, as a step's, the DPO term's mean over all the pairs plus
        sft_weight x the NLL's mean over all the chosen response tokens: each part weighed by its own count."""
        out = super().mean_over_steps(values, counts)
        w = self.exp.dpo.sft_weight
        if w:
            term = weighted_mean([v["loss"] - w * v["nll_loss"] for v in values], [c.get("loss") for c in counts])
            out["loss"] = term + w * out["nll_loss"]
        return out

    def forward_step(self, data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[torch.Tensor, LossFunc]:
        batch = next(data_iterator)
        per_token, mask, cp_group = next_token_losses(model_inputs(batch), model)
        d = self.exp.dpo

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return micro_batch_loss(output, batch, mask, d.beta, d.label_smoothing, d.sft_weight, cp_group,
                                    batch.get("pair_share"), batch.get("chosen_share"))

        return per_token, loss_func

    def logps_step(self, data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[torch.Tensor, LossFunc]:
        """The reference's forward: each micro-batch's per-sequence log-probs, as the schedule's output data."""
        batch = next(data_iterator)
        per_token, mask, cp_group = next_token_losses(model_inputs(batch), model)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            logps, _ = sequence_logps(output, mask, batch.get("seq_ids"), 2 * batch["pair_ids"].numel(), cp_group)
            return torch.zeros((), device=output.device), {"logps": logps}

        return per_token, loss_func

    # ------------------------------------------------------------ precomputed reference log-probs

    def _precompute(self, t: Trainer, name: str, data: PreferenceDataset, num_microbatches: int) -> None:
        import torch.distributed as dist

        path = self.run_dir / "reference_logps" / f"{name}.safetensors"
        key = self._fingerprint(name, data)
        stored = read_reference(path, key, len(data.pairs))
        if any_rank(stored is None):  # every rank computes, or none: the pass is collective
            if path.is_file() and dist.get_rank() == 0:  # its data, model or reference changed since it was stored
                log.warning("%s was computed for other data, another model or another reference: computing the "
                            "reference log-probs again", path)
            stored = self._reference_of_every_pair(t, data, num_microbatches)
            if dist.get_rank() == 0:
                write_reference(path, stored, key)
            dist.barrier()
        data.reference = stored

    def _reference_of_every_pair(self, t: Trainer, data: PreferenceDataset, num_microbatches: int) -> np.ndarray:
        """[pairs, 2] (chosen, rejected): the data in order, split over data-parallel ranks like a global batch;
        the last call is filled up with repeated samples whose results are dropped."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        assert self.reference is not None
        mbs = self.exp.schedule.micro_batch_size
        per_call = num_microbatches * mbs * t.dp_size
        values = torch.zeros(len(data.pairs), 2, device="cuda")
        last = ps.is_pipeline_last_stage()
        for start in range(0, len(data), per_call):
            samples = [[start + k * mbs * t.dp_size + t.dp_rank * mbs + i for i in range(mbs)]
                       for k in range(num_microbatches)]
            step = [collate([data.sample(j % len(data)) for j in idx]) for idx in samples]
            for idx, batch, logps in zip(samples, step, self.reference.logps(step)):
                if not last:
                    continue
                real = torch.tensor([j < len(data) for j in idx for _ in data.bins[j % len(data)]], device="cuda")
                pairs = batch["pair_ids"].to("cuda")[real]
                n = real.numel()
                values[pairs] = torch.stack([logps[:n][real], logps[n:][real]], dim=1)
        dist.all_reduce(values, group=ps.get_data_parallel_group())  # each pair was computed by one rank
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
        return values.cpu().numpy()

    @cached_property
    def start(self) -> Path | None:
        """The checkpoint the reference's weights come from (checkpoint.load's latest iteration, or the folder
        itself: an iteration, a release), None without checkpoint.load. Resolved once, at first use (on every rank
        at the same point: latest is collective); train() pinned it, so frozen_copy names the same one. A
        checkpoint.load folder that gained a newer iteration since the log-probs were stored gives another
        reference."""
        from mcorekit.train import checkpoint

        load = self.exp.checkpoint.load
        return checkpoint.start_of(load) if load else None

    def _fingerprint(self, name: str, data: PreferenceDataset) -> str:
        """What the stored log-probs depend on: the data files' names, the tokens (and masks) made of them, how pairs
        were cut and packed, the model and its starting weights, the precision."""
        e = self.exp
        paths = e.data.valid_paths if name == "valid" else e.data.paths
        # the files by name only: their content is in the tokens (a stat would differ for data copied to each
        # node's disk at every start, and from rank to rank)
        files = [str(Path(p).resolve()) for p in paths]
        tokens = hashlib.sha256()  # the tokens themselves: a tokenizer or chat template changed in place
        for pair in data.pairs:
            for ex in pair:
                tokens.update(np.asarray(ex.ids, dtype=np.int64).tobytes() + np.asarray(ex.mask, np.int8).tobytes())
        what = {"files": files, "tokenizer": e.data.tokenizer, "tokens": tokens.hexdigest(),
                "seq_length": e.data.seq_length, "packing": e.data.packing, "pairs": len(data.pairs),
                "model": e.model.model_dump(mode="json"),
                "load": None if self.start is None else str(self.start), "dtype": e.precision.dtype,
                "fp8": e.precision.fp8, "lora": e.peft.lora is not None}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def read_reference(path: Path, key: str, pairs: int) -> np.ndarray | None:
    """The stored [pairs, 2] log-probs when the file is there and was computed for this fingerprint; a file that
    does not read (damaged, or not ours) is computed again, as a stale one is."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="numpy") as f:
            if (f.metadata() or {}).get("fingerprint") != key:
                return None
            values = f.get_tensor("logps")
    except (SafetensorError, OSError) as e:
        log.warning("%s does not read (%s): the reference log-probs are computed again", path,
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
    return values if values.shape == (pairs, 2) and values.dtype == np.float32 else None


def write_reference(path: Path, values: np.ndarray, key: str) -> None:
    """safetensors (no pickle), written to a temporary name and renamed: a file that exists is whole."""
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"logps": np.ascontiguousarray(values, dtype=np.float32)}, str(tmp), metadata={"fingerprint": key})
    os.replace(tmp, path)


# ---------------------------------------------------------------- the reference model


class Reference:
    """The reference model's forward: a frozen copy of the starting weights built like the policy's chunks, or with
    LoRA the policy's own chunks with their adapters off."""

    def __init__(self, t: Trainer, task: Task) -> None:  # DPO's, or GRPO's for its KL term
        self.t, self.task = t, task
        self.lora = task.exp.peft.lora is not None
        self.chunks: list[Any] | None = None  # the frozen copy, built on first use (never with LoRA)

    def logps(self, batches: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each micro-batch's per-sequence log-probs under the reference (on the last pipeline stage; an empty list
        on the others), through the same (pipeline) schedule as training, forward only."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if self.chunks is None and not self.lora:
            self.chunks = frozen_copy(self.t)  # GRPO's KL term uses it too
        chunks = self.t.model if self.lora else self.chunks
        data = [iter(batches) for _ in chunks]
        with torch.no_grad(), self._adapters_off(), evaluation(chunks):
            out = get_forward_backward_func()(
                forward_step_func=self.task.logps_step, data_iterator=data if len(data) > 1 else data[0],
                model=chunks, num_microbatches=len(batches), seq_length=self.task.exp.data.seq_length,
                micro_batch_size=self.task.exp.schedule.micro_batch_size * self.task.rows_per_sample,
                forward_only=True)
        return [o["logps"] for o in out]

    def _adapters_off(self) -> Any:
        if not self.lora:
            return nullcontext()
        try:
            from mcorekit.train.lora import adapters_disabled
        except ImportError:
            raise ConfigError("dpo with peft.lora takes the base model with adapters off as its reference "
                              "(mcorekit.train.lora.adapters_disabled), which is not built yet") from None
        return adapters_disabled(self.t.model)

    def release(self) -> None:
        """precomputed: the copy is not needed once the log-probs are stored."""
        self.chunks = None
        torch.cuda.empty_cache()


@contextmanager
def evaluation(chunks: list[Any]) -> Iterator[None]:
    """eval() mode (no dropout, no MoE token counting), and DDP's forward pre-hooks off where they are on (with
    overlap_param_gather they would start the next bucket's all-gather meant for the training forward; switching
    them off first gathers every weight, as validation does); the previous state afterwards."""
    modes = [c.training for c in chunks]
    hooked = [c for c in chunks if getattr(c, "use_forward_hook", False) and c.remove_forward_pre_hook_handles]
    for c in chunks:
        c.eval()
    for c in hooked:
        c.disable_forward_pre_hook()
    try:
        yield
    finally:
        for c in hooked:
            c.enable_forward_pre_hook()
        for c, mode in zip(chunks, modes):
            c.train(mode)


def frozen_copy(t: Trainer) -> list[Any]:
    """The starting weights in the policy's layout: one chunk per virtual pipeline stage built as train/build.py
    builds the policy's (models.megatron.build_gpt, Float16Module), without DDP or an optimizer, gradients off.
    Weights: checkpoint.load's (weights only; the iteration build pinned and checked), else the initial ones,
    rebuilt from build.init_distributed's seeds.
    The schedule reads its sync hooks from the model's config: the copy gets a config without the policy's."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mcorekit.config.rules import Nodes, uses_te
    from mcorekit.train import checkpoint
    from mcorekit.train.generate import random_states_kept

    exp = t.exp
    config = copy.copy(checkpoint.unwrap(t.model[0]).config)
    for hook in ("no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func", "grad_scale_func"):
        setattr(config, hook, None)
    nodes = Nodes.here(t.env.local_rank)
    use_te = uses_te(exp, nodes)
    seed = exp.data.seed + 100 * ps.get_pipeline_model_parallel_rank()  # as build.init_distributed seeds the policy
    # the copy is built from the policy's seeds mid-run: reseeding would restart the policy's dropout streams at
    # this step (a resumed run then no longer follows the one that was not interrupted)
    with random_states_kept(tracker=True):
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        chunks = _chunks(t, config, use_te, nodes)
    if exp.checkpoint.load:
        checkpoint.load_weights(checkpoint.start_of(exp.checkpoint.load), chunks)
    return chunks


def _chunks(t: Trainer, config: Any, use_te: bool, nodes: Any) -> list[Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from mcorekit.config.rules import use_torch_expert_gemm
    from mcorekit.models.megatron import build_gpt

    exp, chunks = t.exp, []
    for vp in range(exp.parallel.vpp or 1):
        vp_stage = vp if exp.parallel.vpp else None
        chunk = build_gpt(t.spec, config, t.padded_vocab, use_te=use_te, grouped_gemm=config.moe_grouped_gemm,
                          pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                          post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                          vp_stage=vp_stage,
                          torch_expert_gemm=use_torch_expert_gemm(exp, use_te, nodes.capability)).cuda()
        if config.params_dtype != torch.float32:
            chunk = Float16Module(config, chunk)
        chunk.requires_grad_(False)
        chunks.append(chunk.eval())
    return chunks
