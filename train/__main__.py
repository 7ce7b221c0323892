"""python -m mcorekit.train --config EXP.yaml [--run-dir DIR] [key=value ...]

What the launcher runs under srun (one process per GPU; ranks from SLURM_*), or by hand with torchrun. Without
--run-dir, a launched run's config.yaml (cluster.yaml beside it) trains in its own run folder; any other config in
<run root>/<name>-local (the run root `mcorekit launch` uses: $MCOREKIT_RUN_ROOT, else
~/.local/state/mcorekit/runs), never next to the config file; a second start there resumes from its checkpoint."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from mcorekit import quiet
from mcorekit.errors import MCoreKitError, one_line
from mcorekit.options import positive_float
from mcorekit.config.experiment import Experiment, load_experiment
from mcorekit.runtime.env import prepare_training_process
from mcorekit.train.shutdown import exit_with, shut_down


def default_run_dir(config: Path, name: str) -> Path:
    """The folder of a launched run's config.yaml (it holds cluster.yaml too), else <run root>/<name>-local."""
    config = config.resolve()
    if config.name == "config.yaml" and (config.parent / "cluster.yaml").is_file():
        return config.parent
    from mcorekit.config.cluster import default_run_root

    return default_run_root() / f"{name}-local"


def check_layout(exp: Experiment) -> None:
    """The layout against the ranks started (torchrun's or Slurm's environment, else one process), before anything
    else: a TP2 run started as one process is told so, on a GPU node or not."""
    from mcorekit.config.experiment import layout_of
    from mcorekit.config.rules import layout_problems, listed, model_of
    from mcorekit.errors import LayoutError
    from mcorekit.runtime.env import from_environ

    world = from_environ().world_size
    if bad := layout_problems(model_of(exp), layout_of(exp), world):
        raise LayoutError(listed(f"cannot train on {world} ranks", bad))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m mcorekit.train", description=__doc__)
    p.add_argument("--config", required=True, help="experiment YAML")
    p.add_argument("--run-dir", default=None, help="where metrics and (by default) checkpoints go (default: the "
                   "config's run folder if `mcorekit launch` wrote it, else <run root>/<name>-local)")
    p.add_argument("--peak-tflops", type=positive_float, default=None,
                   help="per-GPU peak for MFU (default: the run folder's cluster profile's gpu_peak_tflops_bf16, "
                        "else 989, an H100/H200's bf16)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    prepare_training_process()  # before torch and Megatron-Core are imported (see there)
    quiet.install()
    try:
        exp = load_experiment(a.config, a.overrides)
        check_layout(exp)
    except (MCoreKitError, OSError, RuntimeError) as e:  # a bad config, before any GPU work
        return _error(e)
    import torch

    if not torch.cuda.is_available():
        print("mcorekit.train: error: no CUDA GPU on this machine: training runs on GPUs (Megatron-Core has no CPU "
              "forward pass); run it on a GPU node, or submit it with `mcorekit launch --config EXP.yaml` "
              "(--dry-run shows the job)", file=sys.stderr)
        return 2
    from mcorekit.runtime.env import from_environ

    # beside the imports below, not after them (the thread imports nothing: torch is in already)
    threading.Thread(target=_init_cuda, args=(from_environ().local_rank,), daemon=True).start()
    try:
        run_dir = Path(a.run_dir) if a.run_dir else default_run_dir(Path(a.config), exp.name)
        run_dir.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError) as e:  # a file where the folder goes, a read-only disk, a symlink loop
        return _error(e)
    from mcorekit.train.loop import train
    from mcorekit.train.metrics import startup

    startup.mark("imports")
    try:
        train(exp, run_dir, a.peak_tflops)
    except (MCoreKitError, OSError) as e:
        return _error(e)  # a build problem (layout vs ranks, backend, FP8 vs GPU), or a full or read-only disk
    shut_down()
    return 0


def _error(e: BaseException) -> int:
    """One line and exit code 2 for bad input (mcorekit.errors.one_line); anything else is a bug: re-raised."""
    if (line := one_line(e)) is None:
        raise e
    print(f"mcorekit.train: error: {line}", file=sys.stderr)
    return 2


def _init_cuda(local_rank: int) -> None:
    """CUDA's initialisation and this rank's context, on a thread while the main thread imports Megatron-Core and TE:
    it waits on the driver, not the interpreter. bench/startup_probe.py on one H200 (2026-12-02): imports then CUDA
    17.3 s, both at once 15.1 s. A failure is left to the main thread's first CUDA call, which says it in one line."""
    import torch

    try:
        torch.cuda.set_device(local_rank)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def main_or_damaged_cache() -> int:
    """main; a bytecode file cut short in mcorekit's cache folder (mcorekit.caches.damaged_cache_line) is one line."""
    from mcorekit.caches import damaged_cache_line

    try:
        return main()
    except (EOFError, ValueError) as e:
        if (line := damaged_cache_line(e)) is None:
            raise
        print(f"mcorekit.train: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_with(main_or_damaged_cache())
