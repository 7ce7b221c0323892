"""Group relative policy optimisation (data.kind=grpo): rollouts from the policy being trained, in the same processes
and at the same parallel layout (train/generate.py: Megatron-Core's inference engine on the training model, no
weight copy), scored by Python reward functions (train/rewards.py), trained on with the clipped policy-gradient loss.

One step (prepare_step, before the loop's training pass):
  1. this step's prompts: prompts_per_step of them by global sample index (a seeded permutation per epoch, so a
     resumed run continues the order); each data-parallel rank takes prompts_per_step / DP whole prompts
  2. generate group_size samples per prompt (temperature, top_p, max_new_tokens), seeded by step and DP rank
  3. rewards: the weighted sum of grpo.rewards on the decoded completion (computed on the first rank of each
     model-parallel group and broadcast, so every rank trains on the same numbers)
  4. advantages per group: A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4), std unbiased as torch.std (TRL's);
     a group whose rewards are all equal gets A = 0 (it teaches nothing); scale_rewards=false drops the division
  5. the training batch: each rollout (prompt + completion, eos included where the model stopped) is one row of
     data.seq_length, loss mask 1 on the completion's tokens; the reference's log-probs when kl_coeff > 0
Then the loop runs the pass through Megatron's (pipeline) schedule and one optimizer step: schedule.global_batch_size
is prompts_per_step x group_size rollouts, so there is ONE optimizer step per generation batch, and the "old" policy
that generated the rollouts is the one being differentiated: old log-probs = the policy's own log-probs, detached, in
the same forward. The ratio is exactly 1 in value (its gradient is the policy gradient), clip_fraction is 0 by
construction; the clipping matters only for schemes that reuse a batch for several steps, which this task does not.

The loss per completion token t of rollout i (pure functions below, CPU-tested against the formulas):
  ratio = exp(logp - old_logp);  pg = -min(ratio * A_i, clip(ratio, 1 - clip_low, 1 + clip_high) * A_i)
  kl = exp(ref_logp - logp) - (ref_logp - logp) - 1   (the k3 estimator, as in GRPO);  l = pg + kl_coeff * kl
  token aggregation (default, DAPO): sum of l over every completion token of the global batch / their number
  sequence aggregation (the original GRPO): mean over completions of (mean of l over the completion's tokens)
Log-probs (the policy's and the reference's) are those of the distribution the rollouts were sampled from,
softmax(logits / grpo.temperature), as TRL takes them (top_p's truncation is not applied to them, as in TRL).

The reference (kl_coeff > 0) is DPO's (train/tasks/dpo.py Reference): a frozen copy of the starting weights
(checkpoint.load, weights only) on the same GPUs, or with LoRA the policy with its adapters off.

Metrics (averaged over micro-batches and data-parallel ranks by the loop; step-level values are the same in each
micro-batch): reward_mean, reward_std (over the step's rollouts), groups_all_equal (fraction of groups whose
rewards are all equal), kl, clip_fraction, response_length (tokens, eos included), gen_seconds, gen_tokens_per_s
(completion tokens of all DP ranks / time), gen_mem_gb (peak during generation), and the previous step's training
pass (the time from the end of its generation to the start of this one: pass, optimizer, logging):
prev_train_seconds, prev_train_tokens_per_s (rollout tokens / time), prev_gen_share (generation's share of that
step); these are 0 on the first step of a process. mem_gb of the loop's line is the step's peak (generation
resets the peak counter).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from mcorekit.errors import ConfigError
from mcorekit.runtime.ranks import any_rank
from mcorekit.train.data.jsonl import records, refuse_lone_surrogates
from mcorekit.train.data.packing import EpochOrder, Example, pad_one
from mcorekit.train.data.tokenizer import bos_ids, load_tokenizer
from mcorekit.train.rewards import RewardError, Rewards
from mcorekit.train.tasks.base import LossFunc, Task, read_step
from mcorekit.train.tasks.lm import next_token_losses

if TYPE_CHECKING:
    from mcorekit.config.experiment import Experiment
    from mcorekit.models.spec import ModelSpec
    from mcorekit.train.build import Trainer

log = logging.getLogger("mcorekit.train")

METRICS = ("loss", "reward_mean", "reward_std", "groups_all_equal", "kl", "clip_fraction", "response_length",
           "gen_seconds", "gen_tokens_per_s", "gen_mem_gb", "prev_train_seconds", "prev_train_tokens_per_s",
           "prev_gen_share")
STEP_METRICS = METRICS[1:4] + METRICS[6:]  # the same for every micro-batch of a step
ADVANTAGE_EPS = 1e-4


# ---------------------------------------------------------------- the math (pure: tensors in, tensors out)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True,
                     eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps), groups being consecutive runs of group_size; the std is
    unbiased (torch.std). A group with all-equal rewards gets exactly 0. Returns the shape of `rewards`."""
    r = rewards.reshape(-1, group_size).float()
    centred = r - r.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(equal, torch.zeros_like(centred), centred).reshape(rewards.shape)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate, k3 (Schulman): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float, clip_high: float, ref_logp: torch.Tensor | None = None, kl_coeff: float = 0.0,
              aggregation: str = "token", token_total: torch.Tensor | float | None = None,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy-gradient loss with the k3 KL penalty. logp, old_logp, ref_logp, mask: [rows, tokens];
    advantages: [rows]. token aggregation divides the masked sum by `token_total` (default: this batch's masked
    tokens; the task passes the share of the global batch's count that makes the micro-batch losses add up to the
    global token mean); sequence aggregation averages each row over its tokens, then over rows.
    Metrics: kl (masked token mean of the k3 term, 0 without a reference), clip_fraction (masked tokens where the
    clipped side of the min is taken: ratio < 1 - clip_low with A < 0, or ratio > 1 + clip_high with A > 0)."""
    mask = mask.float()
    adv = advantages.float().unsqueeze(-1)
    ratio = torch.exp(logp.float() - old_logp.float())
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    kl = torch.zeros_like(per_token)
    if ref_logp is not None:
        kl = k3_kl(logp.float(), ref_logp.float())
        per_token = per_token + kl_coeff * kl
    tokens = mask.sum().clamp(min=1)
    if aggregation == "token":
        loss = (per_token * mask).sum() / (tokens if token_total is None else token_total)
    elif aggregation == "sequence":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    else:
        raise ValueError(f"aggregation {aggregation!r}: token or sequence")
    low = (ratio < 1.0 - clip_low) & (adv < 0)
    high = (ratio > 1.0 + clip_high) & (adv > 0)
    metrics = {"kl": ((kl * mask).sum() / tokens).detach(),
               "clip_fraction": (((low | high).float() * mask).sum() / tokens).detach()}
    return loss, metrics


# ---------------------------------------------------------------- the prompts


@dataclass
class Prompt:
    text: str  # what the reward functions receive as `prompt`
    ids: list[int]
    fields: dict[str, Any]  # the record's other fields (e.g. answer), passed to the rewards


class PromptDataset:
    """Prompts from jsonl: {"prompt": "..."} or {"messages": [...]} (rendered with the tokenizer's chat template and
    its generation prompt), any other fields kept for the rewards. Prompt k of step s is global sample
    s * prompts_per_step + k of a seeded permutation per epoch."""

    def __init__(self, paths: list[str], tokenizer: Any, seq_length: int, max_new_tokens: int, seed: int) -> None:
        self.prompts: list[Prompt] = []
        bos = bos_ids(tokenizer)  # a plain prompt starts as SFT's and DPO's plain text does
        for path in paths:
            if not Path(path).is_file():
                raise ConfigError(f"GRPO prompts not found: {path}")
            for n, record in records(Path(path)):
                self.prompts.append(self._prompt(tokenizer, record, f"{path}:{n}", seq_length, max_new_tokens, bos))
        if not self.prompts:
            raise ConfigError(f"no prompts in {', '.join(paths)}")
        self.index = EpochOrder(seed, len(self.prompts))  # global sample number -> prompt, reshuffled each epoch

    @staticmethod
    def _prompt(tok: Any, record: dict[str, Any], where: str, seq_length: int, max_new: int,
                bos: list[int]) -> Prompt:
        refuse_lone_surrogates([record.get("messages"), record.get("prompt")], where)
        if isinstance(record.get("messages"), list):
            if not tok.chat_template:
                raise ConfigError(f"{where}: chat prompts need a tokenizer with a chat template")
            try:
                text = tok.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001  (templates raise their own errors)
                raise ConfigError(f"{where}: the chat template failed on these messages: {str(e).splitlines()[0]}") from None
        elif isinstance(record.get("prompt"), str):
            text = record["prompt"]
        else:
            raise ConfigError(f"{where}: expected a 'prompt' string or 'messages' (got keys {sorted(record)[:8]})")
        chat = isinstance(record.get("messages"), list)  # a chat template holds its own BOS
        ids = ([] if chat else bos) + list(tok(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise ConfigError(f"{where}: the prompt is empty once tokenized")
        if len(ids) + max_new - 1 > seq_length:
            raise ConfigError(f"{where}: a prompt of {len(ids)} tokens plus grpo.max_new_tokens={max_new} does not fit "
                              f"data.seq_length={seq_length}; raise data.seq_length or shorten the prompt")
        return Prompt(text, ids, {k: v for k, v in record.items() if k not in ("prompt", "messages")})

    def __len__(self) -> int:
        return len(self.prompts)

    def step_prompts(self, step: int, per_step: int, dp_rank: int, dp_size: int) -> list[int]:
        """The prompt indices data-parallel rank `dp_rank` generates for at `step`."""
        share = per_step // dp_size
        first = step * per_step + dp_rank * share
        return [self.index(first + k) for k in range(share)]


def rollout_row(prompt: list[int], completion: list[int], seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One training row: tokens/labels/position_ids of prompt + completion, loss mask 1 on the completion's tokens."""
    ids = list(prompt) + list(completion)
    return pad_one(Example(ids, [0] * len(prompt) + [1] * len(completion)), seq_length, pad_id)


# ---------------------------------------------------------------- the task


class GroupRelativePolicyOptimization(Task):
    name = "grpo"
    loop_rates = False  # a step is mostly generation: it logs its own gen_ and prev_train_ rates

    def __init__(self, exp: Experiment, spec: ModelSpec, run_dir: Path) -> None:
        super().__init__(exp, spec, run_dir)
        g = exp.grpo
        self.rewards = Rewards.of(g.rewards)  # import errors now, before the first generation
        self.metrics = METRICS
        if len(self.rewards.rewards) > 1:
            self.metrics = METRICS + tuple(f"reward_{i}_{n}" for i, n in enumerate(self.rewards.names))
        if not exp.data.tokenizer:
            raise ConfigError("data.kind=grpo needs data.tokenizer")
        self.tok = load_tokenizer(exp.data.tokenizer, spec.vocab_size)  # generation stops at its eos token
        self.eos = int(self.tok.eos_token_id)
        self.pad = int(self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos)
        self.reference: Any = None
        self.prompts: PromptDataset | None = None
        # the previous step, as seen from this one: (end of its preparation, its rollout tokens (all DP ranks),
        # its generation seconds, its preparation seconds: generation, rewards, reference)
        self.previous: tuple[float, float, float, float] | None = None

    def dataset(self, validation: bool = False) -> Any:
        if validation:
            raise ConfigError("data.kind=grpo has no validation loss; set schedule.eval_interval=0")
        d = self.exp.data
        if not d.paths:
            raise ConfigError("data.kind=grpo needs data.paths (.jsonl prompts)")
        self.prompts = PromptDataset(d.paths, self.tok, d.seq_length, self.exp.grpo.max_new_tokens, d.seed)
        return self.prompts

    def batches(self, dataset: Any, first_sample: int, dp_rank: int, dp_size: int) -> Iterator[dict[str, Any]]:
        """Per step, this rank's prompt indices: the step is first_sample / global_batch_size (the loop starts the
        iterator at step * global_batch_size)."""
        g = self.exp.grpo
        step = first_sample // self.exp.schedule.global_batch_size
        while True:
            yield {"step": step, "prompts": dataset.step_prompts(step, g.prompts_per_step, dp_rank, dp_size)}
            step += 1

    # ------------------------------------------------------------ one step's rollouts

    def prepare_step(self, t: Trainer, data: list[Iterator[dict[str, Any]]],
                     num_microbatches: int) -> list[Iterator[dict[str, Any]]]:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from mcorekit.train.generate import Sampling, generate, here

        assert self.prompts is not None, "dataset() first"
        work = read_step(data, 1)[0]
        g = self.exp.grpo
        dev = here()
        _sync()
        started = time.perf_counter()
        end, prev_tokens, prev_gen, prev_prepare = self.previous or (started, 0.0, 0.0, 0.0)
        prev_train = started - end

        prompts = [self.prompts.prompts[i] for i in work["prompts"]]
        inputs = [p.ids for p in prompts for _ in range(g.group_size)]
        out = generate(t.model, inputs, Sampling(g.max_new_tokens, g.temperature, g.top_p,
                                                 seed=g.seed + 1009 * work["step"] + t.dp_rank),
                       self.eos, len(self.tok), g.generation, g.kv_cache_gb)
        rewards, parts = self._score(prompts, out.completions)
        adv = group_advantages(rewards, g.group_size, g.scale_rewards)

        # step statistics over every data-parallel rank: sums, then derived values
        lengths = torch.tensor([len(c) for c in out.completions], dtype=torch.float64)
        grouped = rewards.reshape(-1, g.group_size)
        sums = torch.tensor([rewards.sum(), (rewards.double() ** 2).sum(), rewards.numel(),
                             float((grouped == grouped[:, :1]).all(1).sum()), grouped.shape[0], lengths.sum(),
                             lengths.sum() + sum(len(p.ids) for p in prompts) * g.group_size,
                             *[sum(p[k] for p in parts) for k in range(len(self.rewards.rewards))]],
                            dtype=torch.float64, device=dev)
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
        n = sums[2].item()
        mean = sums[0].item() / n
        std = max(sums[1].item() / n - mean * mean, 0.0) ** 0.5 * (n / max(n - 1, 1)) ** 0.5
        completion_tokens, rollout_tokens = sums[5].item(), sums[6].item()
        step_values = {"reward_mean": mean, "reward_std": std, "groups_all_equal": sums[3].item() / sums[4].item(),
                       "response_length": completion_tokens / n, "gen_seconds": out.seconds,
                       "gen_tokens_per_s": completion_tokens / max(out.seconds, 1e-9), "gen_mem_gb": out.peak_mem_gb,
                       "prev_train_seconds": prev_train,
                       "prev_train_tokens_per_s": prev_tokens / prev_train if prev_train else 0.0,
                       "prev_gen_share": prev_gen / (prev_prepare + prev_train) if prev_train else 0.0}
        for k, name in enumerate(self.metrics[len(METRICS):]):
            step_values[name] = sums[7 + k].item() / n

        batches = self._micro_batches(prompts, out.completions, adv, completion_tokens, num_microbatches, t.dp_size,
                                      step_values, dev)
        if g.kl_coeff > 0:
            if self.reference is None:
                from mcorekit.train.tasks.dpo import Reference

                self.reference = Reference(t, self)
            for batch, logps in zip(batches, self.reference.logps(batches)):  # the last pipeline stage gets them
                batch["ref_logps"] = logps
        if dist.get_rank() == 0 and work["step"] == 0:
            log.warning("grpo: generating with the %s backend (train/generate.py)", out.backend)
        _sync()
        now = time.perf_counter()
        self.previous = (now, rollout_tokens, out.seconds, now - started)
        return [iter(batches) for _ in data]

    def _score(self, prompts: list[Prompt], completions: list[list[int]]) -> tuple[torch.Tensor, list[list[float]]]:
        """Rewards of every rollout (prompt-major, group_size per prompt), computed on the first rank of the
        model-parallel group and broadcast to its other ranks; a failing reward stops every rank."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from mcorekit.train.generate import here

        g = self.exp.grpo
        k = len(self.rewards.rewards)
        group = ps.get_model_parallel_group()
        first = dist.get_global_rank(group, 0)
        values = torch.zeros(len(completions), k + 1, dtype=torch.float64)
        error: Exception | None = None
        if dist.get_rank() == first:
            try:
                for i, ids in enumerate(completions):
                    p = prompts[i // g.group_size]
                    text = self.tok.decode([x for x in ids if x != self.eos], skip_special_tokens=True)
                    total, parts = self.rewards.score(p.text, text, p.fields)
                    values[i, 0], values[i, 1:] = total, torch.tensor(parts, dtype=torch.float64)
            except Exception as e:  # noqa: BLE001 - any failure: the group's other ranks must stop too, not wait
                error = e
        failed = any_rank(error is not None, group)
        if error is not None:
            raise error
        if failed:
            raise RewardError("a reward function failed on the first rank of this model-parallel group (its log has "
                              "the message)")
        shared = values.to(here())
        dist.broadcast(shared, src=first, group=group)
        values = shared.cpu()
        return values[:, 0].float(), values[:, 1:].tolist()

    def _micro_batches(self, prompts: list[Prompt], completions: list[list[int]], adv: torch.Tensor,
                       completion_tokens: float, num_microbatches: int, dp_size: int, step_values: dict[str, float],
                       dev: torch.device) -> list[dict[str, Any]]:
        g, s, seq = self.exp.grpo, self.exp.schedule, self.exp.data.seq_length
        rows = [rollout_row(prompts[i // g.group_size].ids, c, seq, self.pad) for i, c in enumerate(completions)]
        mbs = s.micro_batch_size
        assert len(rows) == num_microbatches * mbs, (len(rows), num_microbatches, mbs)
        # token aggregation: each micro-batch's loss is its masked sum x (micro-batches x DP) / the global token
        # count, so that the schedule's mean over micro-batches and DDP's over DP ranks give the global token mean
        token_total = completion_tokens / (num_microbatches * dp_size)
        constants = {k: torch.tensor(v, dtype=torch.float32, device=dev) for k, v in step_values.items()}
        out = []
        for m in range(num_microbatches):
            chunk = rows[m * mbs:(m + 1) * mbs]
            batch: dict[str, Any] = {k: torch.stack([r[k] for r in chunk]).to(dev) for k in chunk[0]}
            batch["advantages"] = adv[m * mbs:(m + 1) * mbs].to(dev)
            batch["token_total"] = token_total
            batch["step_metrics"] = constants
            out.append(batch)
        return out

    # ------------------------------------------------------------ the training pass

    def forward_step(self, data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[torch.Tensor, LossFunc]:
        batch = next(data_iterator)
        g = self.exp.grpo
        per_token, mask, _ = next_token_losses(model_inputs(batch), model, g.temperature)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            logp = -output.float()
            loss, metrics = grpo_loss(logp, logp.detach(), batch["advantages"], mask, g.clip_low, g.clip_high,
                                      batch.get("ref_logps"), g.kl_coeff, g.loss_aggregation, batch["token_total"])
            return loss, {"loss": loss.detach().clone(), **metrics, **batch["step_metrics"]}

        return per_token, loss_func

    def logps_step(self, data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[torch.Tensor, LossFunc]:
        """The reference's forward (dpo.Reference runs it): each micro-batch's per-token log-probs [rows, tokens]."""
        batch = next(data_iterator)
        per_token, _, _ = next_token_losses(model_inputs(batch), model, self.exp.grpo.temperature)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return torch.zeros((), device=output.device), {"logps": -output.float().detach()}

        return per_token, loss_func


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")}
