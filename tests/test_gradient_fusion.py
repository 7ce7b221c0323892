"""gradient_accumulation_fusion is on wherever a dense model has TE's layers (MoE models keep it only with APEX,
Megatron-FSDP never): TE's layers write weight gradients into DDP's main_grad themselves, while Megatron's own linear
layers (the output layer, and every layer of the local spec), which refuse the flag without APEX's kernel, are built
anyway and set to the plain weight gradient. On CPU, with Megatron-Core's real modules (no APEX here, as on our GPU
machines); the GPU suite trains with it (tests/test_gpu_train.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def exp(*overrides: str) -> Any:
    from mcorekit.config.experiment import load_experiment

    return load_experiment("examples/llama-tiny.yaml", list(overrides))


def test_fusion_is_on_with_te_layers_apex_or_not() -> None:
    from mcorekit.config.megatron import transformer_kwargs
    from mcorekit.models.megatron import apex_wgrad_available
    from mcorekit.models.spec import resolve

    spec = resolve("llama-tiny", None, {})
    assert not apex_wgrad_available()
    assert transformer_kwargs(exp(), spec, use_te=True)["gradient_accumulation_fusion"] is True
    assert transformer_kwargs(exp(), spec, use_te=False)["gradient_accumulation_fusion"] is False
    assert transformer_kwargs(exp(), spec, use_te=True, fusions=False)["gradient_accumulation_fusion"] is False
    fsdp = exp("parallel.fsdp=optim_grads_params")
    assert transformer_kwargs(fsdp, spec, use_te=True)["gradient_accumulation_fusion"] is False
    moe = resolve("mixtral-tiny", None, {})
    assert moe.is_moe and transformer_kwargs(exp(), moe, use_te=True)["gradient_accumulation_fusion"] is False


def test_moe_models_fuse_where_apex_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import mcorekit.config.megatron as margs
    from mcorekit.models.spec import resolve

    monkeypatch.setattr(margs, "apex_wgrad_available", lambda: True)  # APEX's kernel, as if installed
    moe = resolve("mixtral-tiny", None, {})
    assert margs.transformer_kwargs(exp(), moe, use_te=True)["gradient_accumulation_fusion"] is True
    fsdp = exp("parallel.fsdp=optim_grads_params")
    assert margs.transformer_kwargs(fsdp, moe, use_te=True)["gradient_accumulation_fusion"] is False


def test_own_layers_built_with_the_flag_take_the_plain_weight_gradient(model_parallel: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, layers

    from mcorekit.models.megatron import apex_wgrad_available, build_gpt, transformer_config
    from mcorekit.models.spec import resolve

    assert not apex_wgrad_available()  # what this test is about
    spec = resolve("llama-tiny", None, {})
    config = transformer_config(spec, cpu_init=True, gradient_accumulation_fusion=True)
    with pytest.raises(RuntimeError, match="gradient_accumulation_fusion"):  # Megatron's own refusal, unpatched
        ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.zeros_, gather_output=True)
    torch.manual_seed(0)
    model = build_gpt(spec, config, 256, use_te=False)
    assert layers._grad_accum_fusion_available is False  # the check is back for everything built later
    own = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert own and model.output_layer in own
    assert all(m.gradient_accumulation_fusion is False for m in own)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # the rotary embedding's device, on CPU
    tokens = torch.randint(0, spec.vocab_size, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    model(tokens, positions, None, labels=tokens).float().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.output_layer.weight.grad.abs().sum() > 0
