"""What a training process sets in its environment before torch is imported (runtime/env.prepare_training_process):
where torch.compile's cache goes (use_compile_cache: a persistent per-user folder unless the environment names one,
so later and requeued jobs load compiled kernels instead of compiling; set before Megatron-Core is imported, whose
import makes torch write its own default), and pinned host memory through cudaHostRegister (use_registered_pinning:
an async save's first staging 22 s -> 5 s on one H200), and where Python keeps the bytecode it compiles when the
packages have none and may not get it beside them (mcorekit/caches.use_bytecode_cache: 14.2 s of imports -> 5.9 s
on one H200). Both training entries call it first."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcorekit import caches
from mcorekit.caches import compiles_on_import, use_bytecode_cache
from mcorekit.runtime.env import COMPILE_CACHE, REGISTERED_PINNING, use_compile_cache, use_registered_pinning

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


def test_registered_pinning_is_added_to_the_allocator_settings() -> None:
    env: dict[str, str] = {}
    assert use_registered_pinning(env) == REGISTERED_PINNING == env["PYTORCH_CUDA_ALLOC_CONF"]
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    use_registered_pinning(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:True,{REGISTERED_PINNING}"}
    # the newer name, where only it is set, is the one extended; with both set torch reads the older
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    use_registered_pinning(env)
    assert env == {"PYTORCH_ALLOC_CONF": f"expandable_segments:True,{REGISTERED_PINNING}"}
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    use_registered_pinning(env)
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
                   "PYTORCH_CUDA_ALLOC_CONF": f"max_split_size_mb:512,{REGISTERED_PINNING}"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}  # set, if empty
    use_registered_pinning(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": REGISTERED_PINNING, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}


def test_the_users_pinning_settings_are_kept() -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}
    use_registered_pinning(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "pinned_num_register_threads:4"}  # the thread count stays theirs
    use_registered_pinning(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "pinned_num_register_threads:4,pinned_use_cuda_host_register:True"}


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
        "print(sys.pycache_prefix)\n"
        "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))\n"
        "print(cache_dir())\n")
    env = {k: v for k, v in os.environ.items()
           if k not in (COMPILE_CACHE, "XDG_CACHE_HOME", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env.update(HOME=str(tmp_path / "home"), CUDA_VISIBLE_DEVICES="", MCOREKIT_RUN_ROOT=str(tmp_path / "runs"))
    want = tmp_path / "home" / ".cache" / "mcorekit" / "torchinductor"
    pycache = tmp_path / "home" / ".cache" / "mcorekit" / "pycache"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTHONPYCACHEPREFIX", None)
    ask = ("import sys; from mcorekit.caches import BYTECODE_PACKAGES, compiles_on_import; "
           "sys.exit(0 if any(compiles_on_import(p) for p in BYTECODE_PACKAGES) else 1)")
    compiled = subprocess.run([sys.executable, "-c", ask], env=env, timeout=120).returncode == 0
    for entry in ("main", "job", "none"):
        proc = subprocess.run([sys.executable, str(script), entry], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        prefix, alloc_conf, got = proc.stdout.strip().splitlines()[-3:]
        assert (Path(got) == want) == (entry != "none"), (entry, got)
        # this environment's torch, transformers, Megatron-Core have no bytecode and PYTHONDONTWRITEBYTECODE is set
        assert prefix == (str(pycache) if entry != "none" and compiled else "None"), (entry, prefix)
        assert (alloc_conf == REGISTERED_PINNING) == (entry != "none"), (entry, alloc_conf)


# a module that Python warns about when it compiles it (an invalid escape), and only then: read from bytecode it is
# silent, so the warning tells a compile from a cache hit
WARNS_WHEN_COMPILED = 'PATTERN = "\\d+"\n'


def fake_package(root: Path, name: str = "heavypkg") -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(WARNS_WHEN_COMPILED)
    return root / name


def test_a_package_without_bytecode_is_compiled_on_import_where_none_may_be_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert compiles_on_import("heavypkg")
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # Python writes it beside the source itself
    assert not compiles_on_import("heavypkg")
    real_access = os.access  # ... unless it cannot (asked of the system: root may write anywhere, CI runs as root)
    monkeypatch.setattr(caches.os, "access", lambda path, mode: False if "heavypkg" in str(path)
                        else real_access(path, mode))
    assert compiles_on_import("heavypkg")
    monkeypatch.setattr(caches.os, "access", real_access)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    import py_compile
    import warnings

    with warnings.catch_warnings():  # the invalid escape, on purpose
        warnings.simplefilter("ignore")
        py_compile.compile(str(tmp_path / "heavypkg" / "__init__.py"), doraise=True)  # bytecode there: nothing to do
    assert not compiles_on_import("heavypkg")
    assert not compiles_on_import("no_such_package") and not compiles_on_import("no_such.child")
    (tmp_path / "brokenparent").mkdir()  # a parent whose import fails: no answer, not a crash of the entry
    (tmp_path / "brokenparent" / "__init__.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "brokenparent" / "child.py").write_text("")
    assert not compiles_on_import("brokenparent.child")
    import zipfile

    with zipfile.ZipFile(tmp_path / "zipped.zip", "w") as z:  # zipimport never writes bytecode: nothing to do
        z.writestr("zippedpkg/__init__.py", "")
    monkeypatch.syspath_prepend(str(tmp_path / "zipped.zip"))
    assert not compiles_on_import("zippedpkg")


BYTECODE_RUN = """
import sys, warnings
warnings.simplefilter("always")
from mcorekit import caches as env
env.BYTECODE_PACKAGES = ("heavypkg",)
print("folder", env.use_bytecode_cache())
import heavypkg
"""


def test_bytecode_is_cached_for_the_next_process(tmp_path: Path) -> None:
    """Under PYTHONDONTWRITEBYTECODE, a package without bytecode: the first process compiles it (Python warns) and
    writes the bytecode under the cache folder, mirrored by source path; the next reads it (no warning). A process
    whose environment names a folder already keeps it."""
    fake_package(tmp_path / "site")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "XDG_CACHE_HOME")}
    env.update(PYTHONDONTWRITEBYTECODE="1", HOME=str(tmp_path / "home"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")]))
    folder = tmp_path / "home" / ".cache" / "mcorekit" / "pycache"
    runs = [subprocess.run([sys.executable, "-c", BYTECODE_RUN], capture_output=True, text=True, env=env,
                           timeout=120) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
        assert f"folder {folder}" in run.stdout
    assert "SyntaxWarning" in runs[0].stderr and "SyntaxWarning" not in runs[1].stderr
    source = (tmp_path / "site" / "heavypkg" / "__init__.py").resolve()
    assert list((folder / source.parent.relative_to("/")).glob("__init__.*.pyc"))
    assert not (tmp_path / "site" / "heavypkg" / "__pycache__").exists()  # nothing written into the install
    named = subprocess.run([sys.executable, "-c", BYTECODE_RUN], capture_output=True, text=True, timeout=120,
                           env={**env, "PYTHONPYCACHEPREFIX": str(tmp_path / "theirs")})
    assert "folder None" in named.stdout and list((tmp_path / "theirs").rglob("__init__.*.pyc")) == []


def test_the_bytecode_cache_is_left_alone_where_it_is_not_needed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(caches, "BYTECODE_PACKAGES", ("no_such_package",))
    env = {"HOME": str(tmp_path)}
    assert use_bytecode_cache(env) is None and env == {"HOME": str(tmp_path)} and sys.pycache_prefix is None
    fake_package(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(caches, "BYTECODE_PACKAGES", ("heavypkg",))
    assert use_bytecode_cache({}) is None and sys.pycache_prefix is None  # no home folder known
    (tmp_path / ".cache").write_text("not a folder")
    assert use_bytecode_cache(env) is None and sys.pycache_prefix is None and sys.dont_write_bytecode


CHILDREN_RUN = """
import subprocess, sys, warnings
from mcorekit import caches as env
env.BYTECODE_PACKAGES = ("heavypkg",)
print("folder", env.use_bytecode_cache(children=True))
code = "import warnings; warnings.simplefilter('always'); import childpkg"
sys.exit(subprocess.run([sys.executable, "-c", code]).returncode)
"""


def test_a_training_process_hands_the_cache_to_its_children(tmp_path: Path) -> None:
    """With `children` (what prepare_training_process asks), a child process started by the training process (torch's
    compile workers) reads and writes the same folder: the second child finds what the first compiled."""
    site = tmp_path / "site"
    fake_package(site)
    fake_package(site, "childpkg")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "XDG_CACHE_HOME")}
    env.update(PYTHONDONTWRITEBYTECODE="1", HOME=str(tmp_path / "home"),
               PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]))
    runs = [subprocess.run([sys.executable, "-c", CHILDREN_RUN], capture_output=True, text=True, env=env,
                           timeout=120) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert "SyntaxWarning" in runs[0].stderr and "SyntaxWarning" not in runs[1].stderr
    folder = tmp_path / "home" / ".cache" / "mcorekit" / "pycache"
    assert list((folder / (site / "childpkg").resolve().relative_to("/")).glob("__init__.*.pyc"))


def test_the_mcorekit_command_uses_the_cache_for_itself_only(tmp_path: Path) -> None:
    """`mcorekit` (main without argv) uses the folder but exports nothing: the jobs it submits get the environment as
    the user has it. A process that inherits the folder (from a training process) writes to it."""
    fake_package(tmp_path / "site")
    code = ("import os, sys\n"
            "from mcorekit import caches as env\n"
            "env.BYTECODE_PACKAGES = ('heavypkg',)\n"
            "from mcorekit.cli import main\n"
            "sys.argv = ['mcorekit', '--version']\n"
            "assert main() == 0\n"
            "print('prefix', sys.pycache_prefix, 'exported', os.environ.get('PYTHONPYCACHEPREFIX'),\n"
            "      'writes', not sys.dont_write_bytecode)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "XDG_CACHE_HOME")}
    env.update(PYTHONDONTWRITEBYTECODE="1", HOME=str(tmp_path / "home"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")]))
    folder = tmp_path / "home" / ".cache" / "mcorekit" / "pycache"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"prefix {folder} exported None writes True" in run.stdout
    inherited = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                               env={**env, "PYTHONPYCACHEPREFIX": str(folder)})
    assert f"prefix {folder} exported {folder} writes True" in inherited.stdout, inherited.stderr[-2000:]


@pytest.fixture
def first_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """An install for precompile_in_background: a heavy package (a folder left out, tests, 300 modules so that the
    child runs a while), one it pulls in, a standard library holding installed packages, an empty cache folder in
    use; 4 CPUs. All under a folder named `tests`: only folders inside a package are left out."""
    root = tmp_path / "tests"
    site, stdlib, folder = root / "site", root / "stdlib", root / "cache"
    heavy = fake_package(site)
    for sub in ("deep", "tests", "skipped"):
        (heavy / sub).mkdir()
        (heavy / sub / "__init__.py").write_text(WARNS_WHEN_COMPILED)
    for i in range(300):
        (heavy / f"module{i}.py").write_text(f"VALUE = {i}\n")
    fake_package(site, "pulledin")
    (stdlib / "site-packages").mkdir(parents=True)
    (stdlib / "textwrapish.py").write_text("")
    (stdlib / "site-packages" / "installed.py").write_text("")
    folder.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(caches, "BYTECODE_PACKAGES", ("heavypkg",))
    monkeypatch.setattr(caches, "ALSO_PRECOMPILED", ("pulledin", "not_installed"))
    monkeypatch.setattr(caches, "NOT_PRECOMPILED", {"heavypkg": ("skipped",), caches.STDLIB: ("site-packages",)})
    monkeypatch.setattr(caches.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib)})
    monkeypatch.setattr(caches.os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setattr(sys, "pycache_prefix", str(folder))
    return {"site": site, "heavy": heavy, "stdlib": stdlib, "folder": folder}


def child_env(**extra: str) -> dict[str, str]:
    # with SOURCE_DATE_EPOCH set compileall writes hash-checked bytecode unless told otherwise: `cached` then fails
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}, "SOURCE_DATE_EPOCH": "1", **extra}


def cached(source: Path) -> bool:
    return caches.bytecode_is_current(str(source))


def lock_is_free(folder: Path) -> bool:
    import fcntl

    with open(folder / caches.LOCK_NAME) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            return False


def test_a_first_training_process_compiles_the_packages_ahead(first_run: dict[str, Path]) -> None:
    """Where the cache lacks the heavy packages' bytecode, one child compiles them, what they pull in and the standard
    library into it (test folders, the folders NOT_PRECOMPILED names and the installed packages under the standard
    library's folder left out), as Python itself would write them: an import in a process that may not write
    bytecode then reads them (no compile warning). The child holds the lock while it runs, and only the child."""
    site, heavy, stdlib, folder = first_run["site"], first_run["heavy"], first_run["stdlib"], first_run["folder"]
    env = child_env()
    child = caches.precompile_in_background(folder, env)
    assert child is not None and not lock_is_free(folder)
    assert child.wait(timeout=120) == 0 and lock_is_free(folder)
    assert cached(heavy / "__init__.py") and cached(heavy / "deep" / "__init__.py") and cached(heavy / "module299.py")
    assert cached(site / "pulledin" / "__init__.py") and cached(stdlib / "textwrapish.py")
    assert not cached(heavy / "tests" / "__init__.py") and not cached(heavy / "skipped" / "__init__.py")
    assert not cached(stdlib / "site-packages" / "installed.py")
    reader = subprocess.run([sys.executable, "-W", "always", "-c", "import heavypkg.deep, pulledin"],
                            capture_output=True, text=True, timeout=120,
                            env={**env, "PYTHONPATH": str(site), "PYTHONPYCACHEPREFIX": str(folder),
                                 "PYTHONDONTWRITEBYTECODE": "1"})
    assert reader.returncode == 0 and "SyntaxWarning" not in reader.stderr, reader.stderr[-2000:]


def test_no_precompile_where_it_is_not_needed_or_cannot_run(first_run: dict[str, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing starts once the cache is current, while another process holds the lock, with fewer than
    MIN_CPUS_TO_PRECOMPILE CPUs, or where the lock cannot be made (the folder gone); a changed package starts it
    again."""
    import fcntl

    heavy, folder, env = first_run["heavy"], first_run["folder"], child_env()
    child = caches.precompile_in_background(folder, env)
    assert child is not None and child.wait(timeout=120) == 0
    assert caches.precompile_in_background(folder, env) is None  # current: nothing to do
    os.utime(heavy / "__init__.py", (1, 1))  # the package changed: the cache is stale again
    assert not cached(heavy / "__init__.py")
    with open(folder / caches.LOCK_NAME) as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process is compiling
        assert caches.precompile_in_background(folder, env) is None
    assert caches.precompile_in_background(folder.parent / "gone", env) is None
    monkeypatch.setattr(caches.os, "sched_getaffinity", lambda pid: set(range(3)))
    assert caches.precompile_in_background(folder, env) is None
    monkeypatch.setattr(caches.os, "sched_getaffinity", lambda pid: set(range(4)))
    child = caches.precompile_in_background(folder, env)
    assert child is not None and child.wait(timeout=120) == 0 and cached(heavy / "__init__.py")


PARENT_THAT_ENDS = """
import os, sys, time
from mcorekit import caches
caches.BYTECODE_PACKAGES, caches.ALSO_PRECOMPILED = ("heavypkg",), ()
caches.os.sched_getaffinity = lambda pid: set(range(4))
caches.sysconfig.get_paths = lambda: {"stdlib": sys.argv[2]}
sys.pycache_prefix = sys.argv[1]
child = caches.precompile_in_background(caches.Path(sys.argv[1]))
print(child.pid, flush=True)
while not any(caches.Path(sys.argv[1]).rglob("slow*.pyc")):  # its workers are compiling
    time.sleep(0.01)
os._exit(0)
"""


def test_the_precompile_ends_with_its_process(first_run: dict[str, Path]) -> None:
    """A training process that ends (even through os._exit) while the child's workers compile takes the child and its
    workers with it."""
    site, folder = first_run["site"], first_run["folder"]
    for i in range(3000):  # long enough that the child is still compiling when its parent ends
        (first_run["heavy"] / f"slow{i}.py").write_text("\n".join(f"def f{j}(): return {j}" for j in range(50)))
    marker = str(first_run["stdlib"])  # in the command line of the child and of its forked workers

    def ours() -> list[int]:
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and marker in (proc / "cmdline").read_text() \
                        and (proc / "stat").read_text().split()[2] != "Z":
                    pids.append(int(proc.name))
            except OSError:
                continue
        return pids

    run = subprocess.run([sys.executable, "-c", PARENT_THAT_ENDS, str(folder), marker], capture_output=True,
                         text=True, timeout=120, env=child_env(PYTHONPATH=str(site)))
    assert run.returncode == 0 and run.stdout.strip().isdigit(), run.stderr[-2000:]
    for _ in range(200):
        if not ours():
            break
        time.sleep(0.05)
    assert ours() == []
    assert not cached(first_run["heavy"] / "slow2999.py")  # it was stopped, not finished


def test_a_training_process_starts_the_precompile_where_it_uses_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_training_process hands the folder use_bytecode_cache chose to precompile_in_background (tested above),
    and starts nothing where no folder is in use."""
    from mcorekit.runtime import env as runtime_env

    started: list[Path] = []
    monkeypatch.setattr(runtime_env, "precompile_in_background", lambda folder, env: started.append(folder))
    for folder in (tmp_path / "pycache", None):
        monkeypatch.setattr(runtime_env, "use_bytecode_cache", lambda env, children, f=folder: f)
        runtime_env.prepare_training_process({"HOME": str(tmp_path)})
    assert started == [tmp_path / "pycache"]
