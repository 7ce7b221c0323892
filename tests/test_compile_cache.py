"""Where torch.compile's cache goes for a training process (runtime/env.use_compile_cache): a persistent per-user
folder unless the environment names one, so later and requeued jobs load compiled kernels instead of compiling; set
by both training entries before Megatron-Core is imported (importing it makes torch write its own default)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mcorekit.runtime.env import COMPILE_CACHE, use_compile_cache

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "llama-tiny.yaml"


def test_default_is_the_users_cache_folder(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    folder = tmp_path / ".cache" / "mcorekit" / "torchinductor"
    assert use_compile_cache(env) == folder
    assert env[COMPILE_CACHE] == str(folder) and folder.is_dir()


def test_xdg_cache_home_is_followed(tmp_path: Path) -> None:
    env = {"HOME": "/nonexistent", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert use_compile_cache(env) == tmp_path / "xdg" / "mcorekit" / "torchinductor"


def test_a_folder_the_environment_names_is_kept(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), COMPILE_CACHE: "/shared/inductor", "XDG_CACHE_HOME": str(tmp_path)}
    assert use_compile_cache(env) == Path("/shared/inductor")
    assert env[COMPILE_CACHE] == "/shared/inductor"


def test_torchs_default_stays_without_a_usable_home(tmp_path: Path) -> None:
    """No home known, or one where the folder cannot be made (here a file in the way): torch's own default."""
    assert use_compile_cache({}) is None
    (tmp_path / ".cache").write_text("not a folder")
    env = {"HOME": str(tmp_path)}
    assert use_compile_cache(env) is None and COMPILE_CACHE not in env


def test_both_training_entries_set_it_before_megatron_is_imported(tmp_path: Path) -> None:
    """`python -m mcorekit.train`'s main (which stops at 'no CUDA GPU' here) and the launcher's payload (which fails
    on a missing config here) set the folder first: after them, importing Megatron-Core leaves it, and torch's
    inductor compiles into it. Without them torch's import writes /tmp/torchinductor_$USER into the environment."""
    script = tmp_path / "entries.py"
    script.write_text(
        "import os, sys\n"
        "entry = sys.argv[1]\n"
        "if entry == 'main':\n"
        "    from mcorekit.train.__main__ import main\n"
        f"    assert main(['--config', {str(TINY)!r}]) == 2\n"
        "elif entry == 'job':\n"
        "    from mcorekit.train.job import TrainJob\n"
        "    try:\n"
        f"        TrainJob({str(tmp_path / 'missing.yaml')!r}, {str(tmp_path / 'run')!r})()\n"
        "    except Exception:\n"
        "        pass\n"
        "from megatron.core import parallel_state\n"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        "print(cache_dir())\n")
    env = {k: v for k, v in os.environ.items() if k not in (COMPILE_CACHE, "XDG_CACHE_HOME")}
    env.update(HOME=str(tmp_path / "home"), CUDA_VISIBLE_DEVICES="", MCOREKIT_RUN_ROOT=str(tmp_path / "runs"))
    want = tmp_path / "home" / ".cache" / "mcorekit" / "torchinductor"
    for entry in ("main", "job", "none"):
        proc = subprocess.run([sys.executable, str(script), entry], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got = Path(proc.stdout.strip().splitlines()[-1])
        assert (got == want) == (entry != "none"), (entry, got)
