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
        self.batch_layout: dict[str, Any] | None = None

    def __call__(self, **kwargs: Any) -> Any:
        if kwargs["forward_only"]:  # validation runs eagerly
            return self.wrapper.forward_backward_func(**kwargs)
        if self.wrapper.curr_iter("training") == WARMUP_STEPS:
            torch.cuda.empty_cache()
        kwargs["data_iterator"] = self._same_layout(kwargs["data_iterator"])
        return self.wrapper(**kwargs)

    def _same_layout(self, batches: Any) -> Any:
        """The micro-batches, each checked to have the keys, shapes and dtypes of the first: the graph's input
        buffers are copied into, and a batch of another shape would be broadcast or cut without a word."""
        for batch in batches:
            layout = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for k, v in batch.items()}
            if self.batch_layout is None:
                self.batch_layout = layout
            elif layout != self.batch_layout:
                raise RuntimeError(f"mcorekit: a micro-batch of {layout} differs from the {self.batch_layout} that each "
                                   f"step's CUDA graph reads; set schedule.cuda_graph=false for data of varying shape")
            yield batch


def use_capture_stream() -> None:
    """Run this process's GPU work on the stream the step is captured on, from before the model is built. DDP makes
    each weight's gradient accumulator when it wraps the model, and autograd remembers the stream that was current
    then; left on the legacy default stream, the captured backward must wait on that stream, which CUDA refuses
    (cudaErrorStreamCaptureImplicit, seen on an H200 with torch 2.11, whose autograd lacks
    set_override_stale_capture_stream)."""
    from megatron.core.full_cuda_graph import get_shared_capture_stream

    torch.cuda.set_stream(get_shared_capture_stream())


def forward_backward(full_graph: bool) -> Any:
    """Megatron-Core's schedule for this layout, captured as one graph per step when `full_graph`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    schedule = get_forward_backward_func()
    return StepGraph(schedule) if full_graph else schedule
