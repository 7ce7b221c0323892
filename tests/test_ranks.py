"""runtime/ranks with two real gloo ranks on this machine (processes, a file store): the checkpoint every rank
resumes is the one rank 0 found, even where another rank's view of the folder differs (a stale NFS listing is
simulated by giving each rank its own folder), and a failure on rank 0 reaches every rank instead of a hang."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from mcorekit.errors import MCoreKitError
from mcorekit.runtime.ranks import any_rank, rank_zero_choice
from mcorekit.train import checkpoint


def _checkpoints(root: Path, *steps: int) -> None:
    for step in steps:
        d = checkpoint.iter_dir(root, step)
        d.mkdir(parents=True)
        (d / "metadata.json").write_text("{}")


class Unpicklable(ValueError):
    def __reduce__(self) -> tuple:
        raise TypeError("cannot be pickled")


def _fail_on_rank_zero() -> str:
    raise Unpicklable("rank 0 could not read the folder")


def _rank(rank: int, tmp: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2)
    try:
        seen = checkpoint.latest(tmp / f"view{rank}")
        try:
            rank_zero_choice(_fail_on_rank_zero if rank == 0 else lambda: "unused")
            raised = "nothing"
        except (ValueError, MCoreKitError) as e:  # rank 0 its own error, the others its text
            raised = f"{type(e).__name__}: {e}"
        flags = [any_rank(rank == 1), any_rank(False)]
        (tmp / f"rank{rank}.txt").write_text(f"{seen}\n{raised}\n{flags}")
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_rank_zeros_checkpoint_and_its_failure(tmp_path: Path) -> None:
    _checkpoints(tmp_path / "view0", 10, 20)
    _checkpoints(tmp_path / "view1", 10)  # rank 1 does not see iter 20 yet
    (tmp_path / "view1" / checkpoint.TRACKER).write_text("10")
    mp.spawn(_rank, args=(tmp_path,), nprocs=2)
    seen = checkpoint.iter_dir(tmp_path / "view0", 20)
    assert (tmp_path / "rank0.txt").read_text() == (f"{seen}\nUnpicklable: rank 0 could not read the folder"
                                                    f"\n[True, False]")
    assert (tmp_path / "rank1.txt").read_text() == (f"{seen}\nMCoreKitError: rank 0: rank 0 could not read the folder"
                                                    f"\n[True, False]")


def test_one_process_chooses_for_itself(tmp_path: Path) -> None:
    _checkpoints(tmp_path, 10, 20)
    assert checkpoint.latest(tmp_path) == checkpoint.iter_dir(tmp_path, 20)
    assert rank_zero_choice(lambda: 7) == 7 and any_rank(True) and not any_rank(False)


def test_a_process_without_torch_decides_without_importing_it() -> None:
    """A payload that never imported torch (the Slurm tests' counting job) decided its stop on TERM through any_rank,
    which imported torch (seconds) inside Slurm's KillWait: the job was killed before saying why it stopped."""
    import subprocess
    import sys

    code = ("import sys; from mcorekit.runtime.ranks import any_rank, rank_zero_choice; "
            "print(any_rank(True), rank_zero_choice(lambda: 7), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "7", "False"]
