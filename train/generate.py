"""Generate from the training model itself: same processes, same parallel layout, same weights (no copy, no second
engine). Used by GRPO (train/tasks/grpo.py) for its rollouts and by examples/grpo/evaluate.py for greedy accuracy.

generate(chunks, prompts, sampling) switches the model chunks to eval mode with DDP's forward pre-hooks off (with
overlap_param_gather that first gathers every weight the optimizer just updated, as validation does), generates,
frees what generation allocated and switches back. Three backends, one result:

  dynamic  Megatron-Core's DynamicInferenceEngine (megatron.core.inference: paged KV cache, in-flight batching) on
           the GPTModel inside DDP/Float16Module, its DynamicInferenceContext built per call (grpo.kv_cache_gb) and
           dropped afterwards. Its attention kernel needs flash-attn >= 2.7.3 (or FA3/FA4).
  static   Megatron-Core's static-batch engine (TextGenerationController over GPTInferenceWrapper with a
           StaticInferenceContext: KV cache of this call's batch and length, prefill then one token per step), as
           StaticInferenceEngine(legacy=True) runs it. Needs no flash-attn.
  plain    a sampling loop over the training forward with no KV cache (each step recomputes the whole prefix),
           through Megatron's forward-only schedule: works at every layout GRPO trains (PP, SP, EP, FP8).
Virtual pipeline stages are refused by every backend: the engines take one model chunk, and the interleaved schedule
does not take the one micro-batch a generation step is (the rules refuse parallel.vpp with GRPO).
auto picks static (the engine whose output has been checked against a hand-written greedy loop, tests/test_grpo.py),
and plain where the engines do not apply: expert parallelism (direct-mode engines step each data-parallel rank on
its own, while the experts' all-to-all needs every rank of the expert group in each step), sequence parallelism
(the static engine refuses it for dense models), FP8 (the engines convert the model for FP8 inference). dynamic is
chosen explicitly (grpo.generation: dynamic).

Sampling is the same on every rank of a model-parallel group (TP ranks sample from the same gathered logits with
the same seed; PP stages receive the last stage's logits or tokens), and seeded per call (Sampling.seed), so a
resumed run generates what the uninterrupted one did. The global CPU and CUDA random states are left as they were.
"""

from __future__ import annotations

import time
import types
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from mcorekit.errors import ConfigError

BACKENDS = ("auto", "dynamic", "static", "plain")


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0  # 1.0: no nucleus filtering
    greedy: bool = False  # argmax (temperature and top_p ignored)
    seed: int = 0  # the same on every rank of a model-parallel group; vary it per step and per DP rank


@dataclass
class Generated:
    completions: list[list[int]]  # per prompt: the generated tokens, ending with eos where the model stopped
    finished: list[bool]  # whether the model emitted eos within max_new_tokens
    seconds: float
    backend: str
    peak_mem_gb: float  # peak GPU memory allocated during the call

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.completions)


def flash_attn_ok() -> bool:
    """Whether Megatron-Core's dynamic-batching attention kernel is available (flash-attn >= 2.7.3, or FA3/FA4)."""
    try:
        from megatron.core.transformer import attention as a
    except ImportError:
        return False
    try:
        return bool(getattr(a, "HAVE_FA4", False) or getattr(a, "HAVE_FA3", False)
                    or (a.flash_attn_varlen_func is not None and a.is_fa_min_version("2.7.3")))
    except Exception:  # noqa: BLE001  (is_fa_min_version reads package metadata)
        return False


def why_not_engine(chunks: list[Any]) -> str | None:
    """Why Megatron-Core's engines cannot run this model as built (None: they can)."""
    config = unwrap(chunks[0]).config
    if config.expert_model_parallel_size > 1:
        return "expert parallelism (direct-mode engines step each data-parallel rank on its own)"
    if config.sequence_parallel:
        return "sequence parallelism (the static engine refuses it for dense models)"
    if config.fp8:
        return "FP8 (the engines convert the model for FP8 inference)"
    return None


def choose_backend(chunks: list[Any], asked: str) -> str:
    if asked not in BACKENDS:
        raise ConfigError(f"generation backend {asked!r}: choose one of {', '.join(BACKENDS)}")
    if len(chunks) > 1:
        raise ConfigError("generation with virtual pipeline stages is not built (the engines take one model chunk; "
                          "the interleaved schedule does not take one micro-batch); drop parallel.vpp")
    reason = why_not_engine(chunks)
    if asked == "auto":
        return "plain" if reason else "static"
    if asked in ("dynamic", "static") and reason:
        raise ConfigError(f"grpo.generation={asked}: Megatron-Core's engines do not run {reason}; use auto or plain")
    if asked == "dynamic" and not flash_attn_ok():
        raise ConfigError("grpo.generation=dynamic needs flash-attn >= 2.7.3 (Megatron-Core's dynamic-batching "
                          "attention kernel); install it, or use static or auto")
    return asked


def unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP and Float16Module."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def without_ddp(chunk: Any) -> Any:
    """The chunk without its DDP wrapper (Float16Module kept: it casts inputs and outputs as training does)."""
    from megatron.core.distributed import DistributedDataParallel

    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def generate(chunks: list[Any], prompts: list[list[int]], sampling: Sampling, eos_id: int, vocab_size: int,
             backend: str = "auto", kv_cache_gb: float = 2.0) -> Generated:
    """Completions of `prompts` (token ids) from the model chunks as they are now. Every rank of a model-parallel
    group must call it with the same prompts; data-parallel ranks call it with their own. `vocab_size`: the
    tokenizer's, so the padded vocabulary rows are never sampled (plain) and never decoded."""
    name = choose_backend(chunks, backend)
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with generation_mode(chunks, inference=name != "plain"):
        if not prompts:
            completions: list[list[int]] = []
        elif name == "plain":
            completions = _plain(chunks, prompts, sampling, eos_id, vocab_size)
        elif name == "static":
            completions = _static(without_ddp(chunks[0]), prompts, sampling, eos_id, vocab_size)
        else:
            completions = _dynamic(without_ddp(chunks[0]), prompts, sampling, eos_id, vocab_size, kv_cache_gb)
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 1e9 if gpu else 0.0
    return Generated(completions, [bool(c) and c[-1] == eos_id for c in completions], seconds, name, peak)


@contextmanager
def generation_mode(chunks: list[Any], inference: bool) -> Iterator[None]:
    """eval() (no dropout), no autograd, DDP's forward pre-hooks off (which gathers every weight first), Megatron's
    inference flag on for the engines; everything as it was afterwards, random states included, and no RoPE table
    made during generation left in Megatron's cache."""
    from megatron.core.inference.utils import InferenceMode

    modes = [c.training for c in chunks]
    hooked = [c for c in chunks
              if getattr(c, "use_forward_hook", False) and getattr(c, "remove_forward_pre_hook_handles", None)]
    with random_states_kept():  # whatever generation draws or reseeds, training's streams go on as if it never ran
        for c in hooked:
            c.disable_forward_pre_hook()
        for c in chunks:
            c.eval()
            # FP8 layers (TE's, and the FP8 experts) cache their weights' FP8 copies until told a new step began; the
            # schedule tells them each training step, generation calls the model directly: recast after the update
            model = unwrap(c)
            if hasattr(model, "set_is_first_microbatch"):
                model.set_is_first_microbatch()
        if inference:
            InferenceMode.set_active()
        try:
            with torch.no_grad():
                yield
        finally:
            clear_rope_caches(chunks)
            InferenceMode.unset_active()
            for c, mode in zip(chunks, modes):
                c.train(mode)
            for c in hooked:
                c.enable_forward_pre_hook()


@contextmanager
def random_states_kept(tracker: bool = False) -> Iterator[None]:
    """torch's CPU and CUDA generators as they were before the block, and with `tracker` Megatron-Core's CUDA RNG
    tracker too (dropout's streams: dpo.frozen_copy reseeds it to rebuild the policy's initial weights mid-run).
    generation_mode keeps the global generators only: in eval mode nothing draws from the tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    states = get_cuda_rng_tracker().get_states() if tracker else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        if states is not None:
            get_cuda_rng_tracker().set_states(states)


def clear_rope_caches(chunks: list[Any]) -> None:
    """Megatron's rotary embeddings memoise their tables per sequence length (functools.lru_cache on forward). Tables
    made under the engines' torch.inference_mode are inference tensors, which autograd refuses to save (TE's fused
    RoPE saves them) if a training forward of the same length found them in the cache: drop them all."""
    for chunk in chunks:
        for module in chunk.modules():
            forward = getattr(type(module), "forward", None)
            if hasattr(forward, "cache_clear") and "rotary" in type(module).__module__:
                forward.cache_clear()


def _tokenizer_shim(eos_id: int, vocab_size: int) -> Any:
    """What the engines' controller asks of a tokenizer when given token ids: eod (padding and termination) and a
    detokenize we do not need (completions are decoded by the caller with the real tokenizer)."""
    return types.SimpleNamespace(eod=eos_id, bos=None, vocab_size=vocab_size, detokenize=lambda tokens: "")


def _controller(wrapper: Any, eos_id: int, vocab_size: int) -> Any:
    """Megatron-Core's TextGenerationController, sampling only the tokenizer's tokens: the rows Megatron pads the
    vocabulary with are set to -inf before its sampler sees them (greedy would otherwise pick an untrained row)."""
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class Controller(TextGenerationController):
        def sample_from_logits(self, last_token_logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            last_token_logits = last_token_logits.clone()
            last_token_logits[..., vocab_size:] = float("-inf")
            return super().sample_from_logits(last_token_logits, *args, **kwargs)

        def detokenize_generations(self, *args: Any, **kwargs: Any) -> tuple[str, None]:
            # the static loop detokenizes every request once it is done (a device-to-host copy and a signature
            # inspection each); the caller decodes completions itself with the real tokenizer
            return "", None

        def _dynamic_step_sample_logits(self) -> Any:
            if self._all_logits_cuda is not None:
                self._all_logits_cuda[..., vocab_size:] = float("-inf")
            return super()._dynamic_step_sample_logits()

    return Controller(inference_wrapped_model=wrapper, tokenizer=_tokenizer_shim(eos_id, vocab_size))


def _params(sampling: Sampling, eos_id: int) -> Any:
    from megatron.core.inference.sampling_params import SamplingParams

    if sampling.greedy:
        return SamplingParams(temperature=1.0, top_k=1, top_p=0.0, num_tokens_to_generate=sampling.max_new_tokens,
                              termination_id=eos_id)
    return SamplingParams(temperature=float(sampling.temperature), top_k=0,
                          top_p=0.0 if sampling.top_p >= 1.0 else float(sampling.top_p),
                          num_tokens_to_generate=sampling.max_new_tokens, termination_id=eos_id)


def _finish(tokens: list[int], eos_id: int, max_new: int) -> list[int]:
    """The engines report generated tokens without the eos that ended them: a completion shorter than max_new
    stopped at eos, which is put back (the policy learns to stop)."""
    tokens = [int(t) for t in tokens]
    if tokens and tokens[-1] == eos_id:
        return tokens
    return tokens + [eos_id] if len(tokens) < max_new else tokens


def _static(model: Any, prompts: list[list[int]], sampling: Sampling, eos_id: int, vocab_size: int) -> list[list[int]]:
    """Megatron-Core's static-batch generation (what StaticInferenceEngine(legacy=True).generate runs per batch):
    one StaticInferenceContext for the whole batch, its KV cache freed with it."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    max_len = max(len(p) for p in prompts) + sampling.max_new_tokens
    context = StaticInferenceContext(max_batch_size=len(prompts), max_sequence_length=max_len)
    controller = _controller(GPTInferenceWrapper(model, context), eos_id, vocab_size)
    controller.sampling_rng.manual_seed(sampling.seed)
    params = _params(sampling, eos_id)
    requests = OrderedDict((i, InferenceRequest(request_id=i, prompt="", sampling_params=params, prompt_tokens=list(p)))
                           for i, p in enumerate(prompts))
    try:
        done = controller.generate_all_output_tokens_static_batch(requests)
        # one device-to-host copy for the batch, not one per request
        rows = [done[i].generated_tokens for i in range(len(prompts))]
        lengths = [int(done[i].generated_length) for i in range(len(prompts))]
        padded = torch.nn.utils.rnn.pad_sequence([r.reshape(-1) for r in rows], batch_first=True).tolist() \
            if any(lengths) else [[] for _ in rows]
        out = [_finish(row[:n], eos_id, sampling.max_new_tokens) for row, n in zip(padded, lengths)]
    finally:
        context.key_value_memory_dict.clear()  # the KV cache: freed now, not when the objects are collected
    return out


def _dynamic(model: Any, prompts: list[list[int]], sampling: Sampling, eos_id: int, vocab_size: int,
             kv_cache_gb: float) -> list[list[int]]:
    """Megatron-Core's DynamicInferenceEngine in direct mode (no coordinator): this rank's prompts as requests,
    stepped until all finish; the context (the paged KV cache of kv_cache_gb) is dropped afterwards."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    tp = ps.get_tensor_model_parallel_world_size()
    step = 4 * tp  # the context rounds request counts to multiples of 4 and of TP
    max_requests = -(-len(prompts) // step) * step
    config = InferenceConfig(max_sequence_length=max(len(p) for p in prompts) + sampling.max_new_tokens,
                             buffer_size_gb=kv_cache_gb, max_requests=max_requests,
                             max_tokens=max(DynamicInferenceContext.DEFAULT_MAX_TOKENS, max_requests),
                             materialize_only_last_token_logits=True, unified_memory_level=0)
    context = DynamicInferenceContext(unwrap(model).config, config)
    controller = _controller(GPTInferenceWrapper(model, context), eos_id, vocab_size)
    engine = DynamicInferenceEngine(controller, context)
    controller.sampling_rng.manual_seed(sampling.seed)
    records = engine.generate([list(p) for p in prompts], _params(sampling, eos_id))
    out = [_finish(list(r.merge().generated_tokens), eos_id, sampling.max_new_tokens) for r in records]
    del engine, controller, context, records
    return out


def _plain(chunks: list[Any], prompts: list[list[int]], sampling: Sampling, eos_id: int,
           vocab_size: int) -> list[list[int]]:
    """Sampling over the training forward, no KV cache: each step runs the model on every row's whole prefix
    (right-padded; causal attention keeps padding out of the positions that matter) through Megatron's forward-only
    schedule (pipeline stages; one model chunk: choose_backend refuses more), samples on the last stage and
    broadcasts the tokens to the other stages. Every rank takes the same number of steps (an all-reduce of "anyone
    still generating"), so expert-parallel all-to-alls always find their peers."""
    from megatron.core import parallel_state as ps

    config = unwrap(chunks[0]).config
    tp = ps.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
    device = here()
    rows, max_new = len(prompts), sampling.max_new_tokens
    start = torch.tensor([len(p) for p in prompts], device=device)
    width = int(start.max()) + max_new
    width += -width % tp
    buf = torch.full((rows, width), eos_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    length, done = start.clone(), torch.zeros(rows, dtype=torch.bool, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(sampling.seed)
    for _ in range(max_new):
        running = (~done).any().to(torch.int32).reshape(1)
        dist.all_reduce(running, op=dist.ReduceOp.MAX)
        if not running.item():
            break
        span = int(length.max())
        span += -span % tp
        tokens, positions = buf[:, :span], torch.arange(span, device=device).expand(rows, span)
        if ps.get_pipeline_model_parallel_world_size() == 1:
            logits = chunks[0](tokens, positions, None, runtime_gather_output=True)
            nxt = sample(logits[torch.arange(rows, device=device), length - 1].float(), sampling, vocab_size, gen)
        else:
            nxt = _pipelined_next(chunks, tokens, positions, length - 1, sampling, vocab_size, gen)
        nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
        live = ~done
        buf[live, length[live]] = nxt[live]
        length = length + live.long()
        done = done | (nxt == eos_id) | (length - start >= max_new)
    return [buf[i, len(p): int(length[i])].tolist() for i, p in enumerate(prompts)]


def _pipelined_next(chunks: list[Any], tokens: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                    sampling: Sampling, vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """The next token of every row with pipeline stages: one forward-only pass of Megatron's
    schedule, sampled on the last stage and broadcast to the others."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows, span = tokens.shape
    batch = {"tokens": tokens, "position_ids": positions}

    def forward(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None, runtime_gather_output=True)

        def pick(logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            nxt = sample(logits[torch.arange(rows, device=logits.device), last].float(), sampling, vocab_size, gen)
            return torch.zeros((), device=logits.device), {"next": nxt}

        return out, pick

    result = get_forward_backward_func()(
        forward_step_func=forward, data_iterator=iter([batch]),
        model=chunks, num_microbatches=1, seq_length=span, micro_batch_size=rows, forward_only=True)
    on_last_stage = ps.is_pipeline_last_stage()
    nxt = result[0]["next"] if on_last_stage else torch.empty(rows, dtype=torch.long, device=tokens.device)
    dist.broadcast(nxt, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return nxt


def here() -> torch.device:
    """This rank's GPU (the CPU where there is none: tests run the plain loop and the static engine on CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def sample(logits: torch.Tensor, sampling: Sampling, vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """One token per row of [rows, padded vocab] logits: rows beyond the tokenizer's vocabulary never chosen;
    greedy, or temperature then nucleus (top_p) sampling."""
    logits = logits.clone()
    logits[:, vocab_size:] = float("-inf")
    if sampling.greedy:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= sampling.top_p  # keep the smallest set reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)
