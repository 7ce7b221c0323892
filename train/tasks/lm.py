"""Language modelling: next-token cross entropy, averaged over the tokens whose loss mask is 1 (all of them for
pretraining data). Context parallelism and packed sequences are handled here, where the batch is cut."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from mcorekit.train.tasks.base import LossFunc, Task


class LanguageModelling(Task):
    name = "lm"
    perplexity = True

    def dataset(self, validation: bool = False) -> Any:
        from mcorekit.train.data import build_dataset

        return build_dataset(self.exp, self.spec, self.run_dir, validation=validation)

    def forward_step(self, data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[torch.Tensor, LossFunc]:
        batch = next(data_iterator)
        per_token, mask, cp_group = next_token_losses(batch, model)
        share = batch.get("token_share")  # SFT: a mean over the step's response tokens (tasks/sft.py)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = masked_mean(output, mask, cp_group, share)
            return loss, {"loss": loss.detach().clone()}

        return per_token, loss_func


def next_token_losses(batch: dict[str, Any], model: Any,
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The model's per-token loss on this rank's part of the batch, the loss mask of that part, and the CP group
    (None without context parallelism) over which a mean must be taken. With a temperature (GRPO sampling at one),
    the loss of the tempered distribution, softmax(logits / temperature): the one the rollouts were drawn from."""
    from megatron.core import parallel_state as ps

    packed = None
    if "cu_seqlens" in batch:  # packed SFT: attention stays within each example
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, n = batch["cu_seqlens"], batch["max_seqlen"]
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)
    cp_group = None
    if ps.get_context_parallel_world_size() > 1:  # this rank's two of the 2*CP sequence chunks (load-balanced)
        from megatron.core.utils import get_batch_on_this_cp_rank

        cp_group = ps.get_context_parallel_group()
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    if temperature != 1.0:
        return tempered_losses(batch, model, temperature, packed), batch["loss_mask"], cp_group
    per_token = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"],
                      loss_mask=batch["loss_mask"], packed_seq_params=packed)  # loss_mask: read by the MTP loss only
    return per_token, batch["loss_mask"], cp_group


def tempered_losses(batch: dict[str, Any], model: Any, temperature: float, packed: Any) -> torch.Tensor:
    """-log softmax(logits / temperature)[label] per token: the model's logits (its vocabulary-parallel shards under
    TP) scaled, then Megatron's vocabulary-parallel cross entropy, as the model computes its own loss. A pipeline
    stage before the last returns its activations unchanged."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from mcorekit.train.checkpoint import unwrap

    out = model(batch["tokens"], batch["position_ids"], attention_mask=None, packed_seq_params=packed)
    if not unwrap(model).post_process:
        return out
    return vocab_parallel_cross_entropy(out.float() / temperature, batch["labels"])  # logits [b, s, v]: labels [b, s]


def masked_mean(per_token: torch.Tensor, mask: torch.Tensor, cp_group: Any = None,
                share: torch.Tensor | None = None) -> torch.Tensor:
    """Mean loss over the masked tokens of the whole sequence (all CP ranks' chunks), or their sum over `share`
    (base.step_share: the step's mean over all its masked tokens). Returned unscaled: Megatron's schedule divides it
    by the number of micro-batches and multiplies it by the CP size in place (DDP averages gradients over DP x CP
    ranks while each CP rank holds only its chunks' part of the gradient)."""
    total = torch.stack([(per_token.float() * mask).sum(), mask.sum()])
    if cp_group is not None:  # no gradient flows through the all-reduce
        torch.distributed.all_reduce(total, group=cp_group)
    return total[0] / (total[1].clamp(min=1) if share is None else share)
