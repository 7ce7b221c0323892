"""The folders mcorekit keeps per-user caches in ($XDG_CACHE_HOME/mcorekit/..., else ~/.cache/mcorekit/...), and the
bytecode cache: where Python keeps what it compiles when the heavy packages come without bytecode."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
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
    source = _source_of(package)
    if source is None:
        return False
    cached = Path(importlib.util.cache_from_source(source))
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


def removed_if_damaged(error: BaseException) -> Path | None:
    """The bytecode folder of use_bytecode_cache, removed, when `error` is marshal's on a file in it that was cut
    short: Python writes bytecode without checking that the whole of it was written, and a full disk, a quota or a
    file-size limit cuts it; every later import of that module then fails. It is only a cache: the next process
    compiles again. None (nothing removed) for any other error, or a folder that is not ours."""
    # marshal's messages for data cut short: "marshal data too short", "bad marshal data (...)", "EOF read where ..."
    if not isinstance(error, (EOFError, ValueError)) or not ("marshal" in str(error) or "EOF read where" in str(error)):
        return None
    ours = cache_folder(os.environ, "pycache")
    if not sys.pycache_prefix or ours is None or Path(sys.pycache_prefix) != ours:
        return None
    shutil.rmtree(ours, ignore_errors=True)
    return ours


def damaged_cache_line(error: BaseException) -> str | None:
    """removed_if_damaged, said in one line for the error message; None where it removed nothing."""
    folder = removed_if_damaged(error)
    if folder is None:
        return None
    return (f"a bytecode file in {folder} was cut short when it was written (a full disk, a quota or a file-size "
            f"limit?): {error}; that cache folder is removed, run the command again")


# compiled ahead as well: what importing torch and Megatron-Core pulls in besides the packages themselves (sympy 420
# modules, networkx 286, numpy 92 on the CPU machine, 2026-12-03); with the folder in use even bytecode installed
# beside their sources is compiled again into it, the standard library's included
ALSO_PRECOMPILED = ("sympy", "networkx", "numpy", "triton")
STDLIB = "stdlib"
# folders a training process does not import from, by package, relative to its folder (transformers' models: a third
# of the files, of which a run imports a tokenizer or none); test folders are left out everywhere
NOT_PRECOMPILED = {"torch": ("testing/_internal",), "transformers": ("models",),
                   STDLIB: ("site-packages", "dist-packages", "idlelib", "tkinter", "turtledemo", "lib2to3",
                            "ensurepip", "pydoc_data")}
MIN_CPUS_TO_PRECOMPILE = 4
MAX_PRECOMPILE_WORKERS = 16  # as measured: 7,605 files in 3.0 s on 15 (one H200 machine, 2026-12-03)
LOCK_NAME = "precompile.lock"
_children: list[subprocess.Popen[bytes]] = []  # kept, so that none is reported as still running when dropped


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


def precompile_in_background(folder: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes] | None:
    """A user's first training process compiles every module it imports, one after another (on one H200, 2026-12-03,
    imports and checks took 11-18 s where later runs took 3-5 s). Where the cache folder (sys.pycache_prefix) lacks
    current bytecode of one of the heavy packages and the process has MIN_CPUS_TO_PRECOMPILE CPUs or more, this
    starts one low-priority process that compiles those packages, what they pull in (ALSO_PRECOMPILED) and the
    standard library into the folder on the other CPUs, while this process imports: its imports then mostly read.
    One at a time per folder (a lock the child holds; where the file system has no locks, none starts); what the
    child has not reached when a module is imported compiles on import, as before (both write atomically). The child
    ends with this process. Returns the child, else None."""
    env = os.environ if env is None else env
    cpus = len(os.sched_getaffinity(0))
    if cpus < MIN_CPUS_TO_PRECOMPILE:
        return None
    heavy = {p.split(".")[0]: r for p in BYTECODE_PACKAGES if (r := _package_root(p)) is not None}
    if all(bytecode_is_current(str(Path(r) / "__init__.py")) for r in heavy.values()):
        return None
    try:
        lock = os.open(folder / LOCK_NAME, os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError:
        return None  # the folder is gone or not ours to write: imports compile as before
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by the child from here on
        named = [*heavy.items(), *((p, r) for p in ALSO_PRECOMPILED if (r := _package_root(p)) is not None),
                 (STDLIB, sysconfig.get_paths()["stdlib"])]
        roots = [(root, NOT_PRECOMPILED.get(name, ())) for name, root in named]
        workers = min(cpus - 1, MAX_PRECOMPILE_WORKERS)
        code = (f"from mcorekit.caches import compile_trees; "
                f"compile_trees({roots!r}, {workers}, {sys.flags.optimize}, {os.getpid()})")
        child_env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
        child_env["PYTHONPYCACHEPREFIX"] = str(folder)
        child = subprocess.Popen([sys.executable, "-c", code], env=child_env, pass_fds=(lock,),
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None  # another process is at it, or the file system has no locks, or no child could start
    finally:
        os.close(lock)
    _children.append(child)
    return child


def compile_trees(roots: list[tuple[str, tuple[str, ...]]], workers: int, optimize: int, parent: int) -> None:
    """The background compile of precompile_in_background, at low priority: each (folder, subfolders left out) in
    turn, the heavy packages first, on `workers` processes, into sys.pycache_prefix, with the timestamps and the
    optimization level the parent's imports look for. Ends when `parent` does."""
    import compileall
    import functools
    import multiprocessing
    import py_compile
    from concurrent.futures import ProcessPoolExecutor

    end_with(parent)
    os.nice(10)
    sources = [f for root, left_out in roots for f in python_sources(Path(root), left_out)]
    compile_one = functools.partial(compileall.compile_file, quiet=2, optimize=optimize,
                                    invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    # forked (this process has no threads), so that each worker's parent is this process, which it ends with
    fork = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=fork, initializer=end_with, initargs=(os.getpid(),)) as pool:
        for _ in pool.map(compile_one, sources, chunksize=64):
            pass


def end_with(parent: int) -> None:
    """This process ends when `parent` does (Linux's PR_SET_PDEATHSIG), and now if it already has."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(0)


def python_sources(root: Path, left_out: tuple[str, ...]) -> list[str]:
    """The .py files under `root`, without its test folders and the folders `left_out` (relative to root)."""
    found: list[str] = []
    for folder, subfolders, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        subfolders[:] = sorted(d for d in subfolders if d not in ("test", "tests", "__pycache__")
                               and (rel / d).as_posix() not in left_out)
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    return found


def _package_root(package: str) -> str | None:
    """The folder of an installed regular package, found without importing it (a parent's __init__ runs)."""
    source = _source_of(package)
    return str(Path(source).parent) if source is not None and source.endswith("__init__.py") else None


def _source_of(module: str) -> str | None:
    """The .py file `module` would be imported from, found without importing it (its parents' __init__ run:
    megatron's is empty); None for what is missing or not a source file, or where a parent fails to import (not
    ours to report here)."""
    try:
        spec = importlib.util.find_spec(module)
    except Exception:  # noqa: BLE001
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py") or not os.path.isfile(spec.origin):
        return None
    return spec.origin
