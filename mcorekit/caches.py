"""The folders mcorekit keeps per-user caches in ($XDG_CACHE_HOME/mcorekit/..., else ~/.cache/mcorekit/...), and the
bytecode cache: where Python keeps what it compiles when the heavy packages come without bytecode."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import subprocess
import sys
import sysconfig
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


# compiled ahead as well: what importing torch and Megatron-Core pulls in besides the packages themselves (sympy 420
# modules, networkx 286, numpy 92 on the CPU machine, 2026-12-03); with the folder in use even bytecode installed
# beside their sources is compiled again into it, the standard library's included
ALSO_PRECOMPILED = ("sympy", "networkx", "numpy", "triton")
# folders no training process imports from, in the packages and in the standard library (whose folder holds the
# installed packages too)
NOT_PRECOMPILED = re.compile(r"[/\\](tests?|testing[/\\]_internal)[/\\]")
NOT_PRECOMPILED_STDLIB = re.compile(r"[/\\](tests?|site-packages|dist-packages|idlelib|tkinter|turtledemo|lib2to3|"
                                    r"ensurepip|pydoc_data)[/\\]")
MIN_CPUS_TO_PRECOMPILE = 4


def bytecode_is_current(source: str) -> bool:
    """Whether the folder in use (sys.pycache_prefix, else beside the source) holds bytecode that Python will take for
    `source`: its header names this Python's magic number, timestamp checking, and the source's mtime and size."""
    try:
        with open(importlib.util.cache_from_source(source), "rb") as f:
            head = f.read(16)
        st = os.stat(source)
    except OSError:
        return False
    fields = [int.from_bytes(head[i:i + 4], "little") for i in (4, 8, 12)]
    return head[:4] == importlib.util.MAGIC_NUMBER and fields == [0, int(st.st_mtime) & 0xFFFFFFFF,
                                                                   st.st_size & 0xFFFFFFFF]


def precompile_in_background(folder: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen | None:
    """A user's first training process compiles every module it imports, one after another (on one H200, 2026-12-03,
    imports and checks took 11-18 s where later runs took 3-5 s). Where the cache folder lacks current bytecode of
    one of the heavy packages and the process has MIN_CPUS_TO_PRECOMPILE CPUs or more, this starts one low-priority
    process that compiles those packages, what they pull in (ALSO_PRECOMPILED) and the standard library into the
    folder on the other CPUs, while this process imports: its imports then mostly read. One per node and folder at a
    time (a lock the child holds); what the child has not reached when a module is imported compiles on import, as
    before (both write atomically). Returns the child, else None."""
    env = os.environ if env is None else env
    cpus = len(os.sched_getaffinity(0))
    if cpus < MIN_CPUS_TO_PRECOMPILE:
        return None
    heavy = [r for r in map(_package_root, BYTECODE_PACKAGES) if r is not None]
    if all(bytecode_is_current(str(Path(r) / "__init__.py")) for r in heavy):
        return None
    roots = heavy + [r for r in map(_package_root, ALSO_PRECOMPILED) if r is not None]
    lock = os.open(folder / "precompile.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by the child from here on
    except OSError:
        os.close(lock)
        return None  # another process of this node is at it
    child_env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    child_env["PYTHONPYCACHEPREFIX"] = str(folder)
    stdlib = sysconfig.get_paths()["stdlib"]
    code = f"from mcorekit.caches import compile_trees; compile_trees({roots!r}, {stdlib!r}, {cpus - 1})"
    try:
        return subprocess.Popen([sys.executable, "-c", code], env=child_env, pass_fds=(lock,),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None
    finally:
        os.close(lock)


def compile_trees(packages: list[str], stdlib: str, workers: int) -> None:
    """The background compile of precompile_in_background, at low priority: each package in turn (the heavy ones
    first), then the standard library, on `workers` processes, into sys.pycache_prefix, with the timestamps Python
    checks on import."""
    import compileall
    import py_compile

    os.nice(10)
    for root, skip in [(p, NOT_PRECOMPILED) for p in packages] + [(stdlib, NOT_PRECOMPILED_STDLIB)]:
        compileall.compile_dir(root, quiet=2, workers=workers, rx=skip,
                               invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)


def _package_root(package: str) -> str | None:
    """The folder of an installed regular package, found without importing it (a parent's __init__ runs)."""
    try:
        spec = importlib.util.find_spec(package)
    except Exception:  # noqa: BLE001 - as in compiles_on_import
        return None
    if spec is None or not spec.origin or not spec.origin.endswith("__init__.py"):
        return None
    return str(Path(spec.origin).parent)
