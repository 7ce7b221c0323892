"""Wrapping one model chunk for data parallelism: Megatron-Core's DistributedDataParallel, or with parallel.fsdp its
Megatron-FSDP (megatron.core.distributed.fsdp.FullyShardedDataParallel), which shards optimizer state, gradients and
(optim_grads_params) weights over the data-parallel ranks. The DDP config for both comes from config/megatron.py;
what does not combine with FSDP is refused before anything starts (config/rules.py: fsdp_problems).

Both wrappers give the loop the same interface (no_sync, start_param_sync, zero_grad_buffer, finish_grad_sync) and
Megatron-Core's schedule, finalize_model_grads and get_megatron_optimizer take either."""

from __future__ import annotations

import os
from typing import Any

from mcorekit.errors import ConfigError


def wrap_chunk(config: Any, ddp_config: Any, chunk: Any, first: bool) -> Any:
    """`chunk` (a GPTModel, in Float16Module for 16-bit training) wrapped for data parallelism. `first`: the first
    virtual pipeline chunk; only its buffers are bucketed for overlap (as Megatron-LM does), the others' grads are
    ready only at the end of the interleaved schedule anyway."""
    if not ddp_config.use_megatron_fsdp:
        from megatron.core.distributed import DistributedDataParallel

        return DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=not first)
    from megatron.core.distributed.fsdp import FullyShardedDataParallel

    require_parallel_streams()
    # fsdp_unit_modules: Megatron-FSDP's default, one transformer layer per all-gather unit for optim_grads_params
    # (none for the strategies that keep whole weights). The weights exist on every rank before wrapping (built on
    # the GPU from the same seed), so Megatron-FSDP copies them into its buffers and keeps its shard.
    return FullyShardedDataParallel(config, ddp_config, chunk, disable_bucketing=not first)


def require_parallel_streams() -> None:
    """Megatron-FSDP overlaps its all-gathers and reduce-scatters on side streams; with one hardware queue per
    device (CUDA_DEVICE_MAX_CONNECTIONS=1, which TP/SP overlap wants) those serialise with compute, and Megatron-LM
    refuses the combination. Checked before the first collective rather than found as a hang."""
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ConfigError("parallel.fsdp runs Megatron-FSDP, which needs CUDA_DEVICE_MAX_CONNECTIONS unset or > 1 "
                          "(it is 1 here); unset it for this run (e.g. export CUDA_DEVICE_MAX_CONNECTIONS=8)")


def is_fsdp(chunks: list[Any]) -> bool:
    """Whether the chunks are Megatron-FSDP-wrapped (their checkpoints need the FSDP path)."""
    return any(getattr(getattr(c, "ddp_config", None), "use_megatron_fsdp", False) for c in chunks)
