"""Markers: `slurm` tests need the dev cluster (make test starts it); `gpu` tests need CUDA."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

# submitit's logger configures logging on import (logging.config.dictConfig), which closes every existing handler:
# absl's handler (Megatron-Core imports absl) would then close the stream it was given, which inside a test is
# pytest's capture of that test; a later test then fails on "I/O operation on closed file". Imported first, it
# finds no handler to close. (Outside tests absl holds the real sys.stderr, which it never closes.)
import submitit  # noqa: F401,E402

try:  # Transformer Engine's cuDNN first: loaded after torch's, it fails to link (GPU machine; absent on CPU)
    import transformer_engine.pytorch  # noqa: F401
except (ImportError, OSError):
    pass


@pytest.fixture(autouse=True, scope="session")
def _run_root_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Launches that name no run_root go to $MCOREKIT_RUN_ROOT: a tmp folder here, never the real home."""
    os.environ["MCOREKIT_RUN_ROOT"] = str(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory: pytest.TempPathFactory):
    """One gloo rank: Megatron's modules look up their TP group. A group an in-process GPU test left behind
    (convert/logits.init_single_gpu keeps its NCCL group for the next check in the process) is destroyed first: a
    process has one default group, and a pytest-xdist worker on the GPU machine ran such a test before this fixture
    ('trying to initialize the default process group twice', 2026-12-03). init_single_gpu makes a new one after."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    # a file store, not MASTER_PORT in os.environ: that would leak into the Slurm jobs later tests submit
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _slurm_ready() -> str | None:
    if shutil.which("sinfo") is None:
        return "no Slurm client on PATH (make cluster-up installs and starts the dev cluster)"
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    if out.returncode != 0 or not any(s.startswith(("idle", "mixed", "allocated")) for s in out.stdout.split()):
        return f"the dev cluster is not up (sinfo: {out.stdout.strip() or out.stderr.strip()}); run make cluster-up"
    return None


def _cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "no CUDA device here; gpu tests run on the GPU machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slurm_reason = _slurm_ready() if any("slurm" in i.keywords for i in items) else None
    gpu_reason = _cuda() if any("gpu" in i.keywords for i in items) else None
    for item in items:
        if "slurm" in item.keywords and slurm_reason:
            # `make test` exports MCOREKIT_REQUIRE_SLURM=1: there a missing cluster fails the run, never skips.
            if os.environ.get("MCOREKIT_REQUIRE_SLURM") == "1":
                raise pytest.UsageError(f"slurm tests must run but {slurm_reason}")
            item.add_marker(pytest.mark.skip(reason=slurm_reason))
        if "gpu" in item.keywords and gpu_reason:
            item.add_marker(pytest.mark.skip(reason=gpu_reason))
