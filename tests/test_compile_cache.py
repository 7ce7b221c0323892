"""Where torch.compile's cache goes for a training process (runtime/env.use_compile_cache): a persistent per-user
folder unless the environment names one, so later and requeued jobs load compiled kernels instead of compiling."""

from __future__ import annotations

from pathlib import Path

from mcorekit.runtime.env import COMPILE_CACHE, use_compile_cache


def test_default_is_the_users_cache_folder(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    assert use_compile_cache(env) == tmp_path / ".cache" / "mcorekit" / "torchinductor"
    assert env[COMPILE_CACHE] == str(tmp_path / ".cache" / "mcorekit" / "torchinductor")


def test_xdg_cache_home_is_followed(tmp_path: Path) -> None:
    env = {"HOME": "/nonexistent", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert use_compile_cache(env) == tmp_path / "xdg" / "mcorekit" / "torchinductor"


def test_a_folder_the_environment_names_is_kept(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), COMPILE_CACHE: "/shared/inductor", "XDG_CACHE_HOME": str(tmp_path)}
    assert use_compile_cache(env) == Path("/shared/inductor")
    assert env[COMPILE_CACHE] == "/shared/inductor"


def test_torch_reads_the_folder_it_was_given(tmp_path: Path, monkeypatch) -> None:
    """torch's inductor reads the variable when it compiles, not when it is imported: setting it in build() (after
    torch is imported) still moves the cache."""
    import torch._inductor.runtime.cache_dir_utils as cache_dir_utils

    monkeypatch.delenv(COMPILE_CACHE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = use_compile_cache()
    assert Path(cache_dir_utils.cache_dir()) == folder == tmp_path / "mcorekit" / "torchinductor"
