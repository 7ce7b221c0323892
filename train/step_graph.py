"""A training step's forward and backward passes as one CUDA graph (schedule.cuda_graph; rules.use_full_graph says
where it applies). The first WARMUP_STEPS steps run eagerly (lazy initialisation, kernel choices), the next is
captured, and from then on the GPU replays the recorded kernels: the host no longer launches each of the ~20k
kernels of a MoE step one by one, which set the pace on one H200 (docs/train.md). The optimizer step stays outside
the graph.

Megatron-Core's FullCudaGraphWrapper does the capture and copies each step's micro-batches into static buffers
the graph reads. Its state lives on the class (one graph per process); StepGraph starts it afresh and releases
the eager steps' cached memory before the capture, since the graph allocates from a pool of its own."""

from __future__ import annotations

from typing import Any

import torch

WARMUP_STEPS = 2


class StepGraph:
    def __init__(self, forward_backward: Any) -> None:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader

        StaticBufferLoader.static_buffers = {"training": [], "validation": []}
        self.wrapper = FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=WARMUP_STEPS)
        self.wrapper.reset_cuda_graph()

    def __call__(self, **kwargs: Any) -> Any:
        if kwargs["forward_only"]:  # validation runs eagerly
            return self.wrapper.forward_backward_func(**kwargs)
        if self.wrapper.curr_iter("training") == WARMUP_STEPS:
            torch.cuda.empty_cache()
        return self.wrapper(**kwargs)

    @property
    def captured(self) -> bool:
        return self.wrapper.cuda_graph["training"] is not None


def forward_backward(full_graph: bool) -> Any:
    """Megatron-Core's schedule for this layout, captured as one graph per step when `full_graph`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    schedule = get_forward_backward_func()
    return StepGraph(schedule) if full_graph else schedule
