"""`make train` and `make sweep` start the embedded dev cluster only for CLUSTER=local: for a real cluster's profile
it would install and start Slurm daemons on the login node."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("target", ["train", "sweep"])
def test_only_the_local_cluster_is_brought_up(target: str) -> None:
    def planned(*args: str) -> str:  # make -n: what would run, nothing runs
        return subprocess.run(["make", "-n", target, *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout

    assert "slurm/cluster.sh up" in planned()
    assert "slurm/cluster.sh up" in planned("CLUSTER=local")
    remote = planned("CLUSTER=example-h100", "GRID=optimizer.lr=1e-4,3e-4")
    assert "slurm/cluster.sh up" not in remote and "--cluster example-h100" in remote
