"""The folders mcorekit keeps per-user caches in ($XDG_CACHE_HOME/mcorekit/..., else ~/.cache/mcorekit/...), and the
bytecode cache: where Python keeps what it compiles when the heavy packages come without bytecode."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

# the packages whose imports make most of a process's start (torch, Megatron-Core and TE: 14 s without bytecode)
BYTECODE_PACKAGES = ("torch", "transformers", "megatron.core", "transformer_engine")


def cache_folder(env: Mapping[str, str], name: str) -> Path | None:
    """$XDG_CACHE_HOME/mcorekit/<name> (~/.cache/...); None where no home folder is known."""
    base = env.get("XDG_CACHE_HOME") or (env.get("HOME") and str(Path(env["HOME"]) / ".cache"))
    return Path(base) / "mcorekit" / name if base else None


def user_cache(env: Mapping[str, str], name: str) -> Path | None:
    """cache_folder, created; None where there is none or it cannot be created and written."""
    folder = cache_folder(env, name)
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK | os.X_OK) else None


def compiles_on_import(package: str) -> bool:
    """Whether importing `package` compiles its modules from source: its __init__.py has no bytecode beside it, and
    this process may not write it there (PYTHONDONTWRITEBYTECODE, or a folder it cannot write). Installs without .pyc
    files are uv's default and pip's --no-compile; containers often set PYTHONDONTWRITEBYTECODE. False for what
    Python never compiles on import: a package that is missing, a namespace, an extension or bytecode only, in a zip."""
    try:
        spec = importlib.util.find_spec(package)  # runs its parents' __init__ (megatron's is empty)
    except Exception:  # noqa: BLE001 - a parent that fails to import: not ours to report here
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py") or not os.path.isfile(spec.origin):
        return False
    cached = Path(importlib.util.cache_from_source(spec.origin))
    if cached.exists():
        return False
    folder = cached.parent if cached.parent.exists() else cached.parent.parent
    return sys.dont_write_bytecode or not os.access(folder, os.W_OK | os.X_OK)


def use_bytecode_cache(env: MutableMapping[str, str] | None = None, children: bool = False) -> Path | None:
    """Where Python keeps the bytecode of the modules it compiles, when torch, transformers, Megatron-Core or TE would
    otherwise be compiled from source by every process: $XDG_CACHE_HOME/mcorekit/pycache (~/.cache/...), written
    even under PYTHONDONTWRITEBYTECODE (which keeps bytecode out of the installed packages; this folder is ours). On
    one H200 (2026-12-03, bench/startup_probe.py; torch installed by uv, PYTHONDONTWRITEBYTECODE=1) importing torch,
    TE and Megatron-Core took 14.2 s each time; with the cache 18.0 s once, then 5.9 s.
    With the folder in use Python reads no bytecode beside any source, the standard library's included: each module
    is compiled into the folder once. It checks each cached file against its source's size and modification time
    (whole seconds), as it does beside the sources; an install that changes a file while keeping both (timestamps
    normalised in an image at the same path) would need the folder removed.
    Sets sys.pycache_prefix (and writing on); with `children` (a training process: torch's compile workers, data
    workers) also PYTHONPYCACHEPREFIX in `env` (os.environ), without PYTHONDONTWRITEBYTECODE, so they read and write it
    too. A process that inherits this folder writes to it; one whose environment names another is left alone, as is
    one where none of the four packages would compile. Returns the folder in use, else None."""
    env = os.environ if env is None else env
    if sys.pycache_prefix:
        ours = cache_folder(env, "pycache")
        if ours is None or Path(sys.pycache_prefix) != ours:
            return None  # the environment's own choice
        sys.dont_write_bytecode = False
        return ours
    if not any(compiles_on_import(p) for p in BYTECODE_PACKAGES):
        return None
    folder = user_cache(env, "pycache")
    if folder is None:
        return None
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    if children:
        env["PYTHONPYCACHEPREFIX"] = str(folder)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder
