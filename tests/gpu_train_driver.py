"""Run one training in its own process(es) (Megatron's global state is per process).
usage: gpu_train_driver.py CONFIG RUN_DIR [STOP_AT_STEP] [key=value ...]
With STOP_AT_STEP > 0 the process sends itself SIGUSR2 after that step, as Slurm does before a time limit:
the loop saves a checkpoint at the next step boundary and exits for requeue.

Each rank also writes RUN_DIR/grads.rank<R>.json: the squared norm of every parameter's gradient at the first step
(DDP's main_grad after the schedule finalised it, before the optimizer clips it), under its GLOBAL name (layer
numbers across pipeline stages and virtual chunks), so a test can say which parameters' gradients differ between
layouts. With data (or context) parallelism the distributed optimizer reduces only this rank's shard: those write none.
It prints whether the model fused its weight gradients into main_grad; GPU_TEST_GAF=off in the environment switches
that off (there is no experiment key for it), so a test can compare the two. GPU_TEST_STEP_SEED=off leaves the
random streams unseeded at each step (train/build.seed_step), as before it existed."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from single_rank import single_rank_env  # noqa: E402  (this folder is on sys.path: the driver runs as a script)

if "SLURM_PROCID" not in os.environ:  # a single process; under srun (tests/slurm_shim) ranks come from SLURM_*
    os.environ.update(single_rank_env())

import json  # noqa: E402

from mcorekit.config.experiment import load_experiment  # noqa: E402
from mcorekit.train import loop  # noqa: E402
from mcorekit.train.checkpoint import unwrap  # noqa: E402


def global_grad_norms(chunks: list) -> dict[str, list]:
    """{global parameter name: [squared gradient norm, split over TP ranks]} for this rank's model chunks."""
    out = {}
    for chunk in chunks:
        model = unwrap(chunk)
        numbers = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
                   for i, layer in enumerate(model.decoder.layers)}
        for name, param in model.named_parameters():
            grad = getattr(param, "main_grad", None)
            if grad is None:
                continue
            for local, glob in numbers.items():
                if name.startswith(local):
                    name = glob + name[len(local):]
                    break
            out[name] = [float(grad.float().pow(2).sum()), bool(getattr(param, "tensor_model_parallel", False))]
    return out


def probe_first_step(run_dir: Path) -> None:
    """Wrap the trainer's optimizer step: before the first one, write this rank's gradient norms."""
    build = loop.build

    def build_and_probe(exp, **kw):  # noqa: ANN001, ANN003, ANN202
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        t = build(exp, **kw)
        fused = {getattr(getattr(unwrap(chunk), "config", None), "gradient_accumulation_fusion", None)
                 for chunk in t.model}  # getattr: a wrapper this driver does not know must not fail the run
        print(f"gpu_train_driver: gradient_accumulation_fusion={sorted(fused, key=str)}", flush=True)
        whole = ps.get_data_parallel_world_size(with_context_parallel=True) == 1  # else only a reduced shard
        step = t.optimizer.step

        def probed_step():  # noqa: ANN202
            if not getattr(probed_step, "done", False) and whole:
                norms = global_grad_norms(t.model)
                (run_dir / f"grads.rank{dist.get_rank()}.json").write_text(json.dumps(norms))
            probed_step.done = True
            return step()

        t.optimizer.step = probed_step
        return t

    loop.build = build_and_probe


def plain_weight_gradients() -> None:
    """gradient_accumulation_fusion off, whatever mcorekit's default (config/megatron.transformer_kwargs)."""
    import mcorekit.config.megatron as margs

    kwargs = margs.transformer_kwargs

    def without_fusion(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        return {**kwargs(*args, **kw), "gradient_accumulation_fusion": False}

    margs.transformer_kwargs = without_fusion


def main() -> int:
    config, run_dir, stop_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0
    exp = load_experiment(config, sys.argv[4:])
    run_dir.mkdir(parents=True, exist_ok=True)

    def on_step(metrics: dict) -> None:
        if stop_at and metrics["step"] == stop_at:
            os.kill(os.getpid(), signal.SIGUSR2)

    probe_first_step(run_dir)
    if os.environ.get("GPU_TEST_GAF") == "off":
        plain_weight_gradients()
    if os.environ.get("GPU_TEST_STEP_SEED") == "off":
        loop.seed_step = lambda t, step: None
    try:
        loop.train(exp, run_dir, on_step=on_step)
    except SystemExit as e:
        print(f"EXITED_FOR_REQUEUE {e.code}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
