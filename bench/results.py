"""What the benchmark scripts share: a fresh work folder; a worker snippet run in its own Python process that
reports one `RESULT ...` line; each run timed and printed as a JSON line as soon as it ends; results.json and the
Markdown table at the end, with an exit code that says whether any run failed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


def timed(run: Callable[[], dict]) -> dict:
    start = time.perf_counter()
    result = run()
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result), flush=True)
    return result


def finish(results: list[dict], out: Path, table: Callable[[list[dict]], str]) -> int:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0 if all("error" not in r for r in results) else 1


def fresh_dir(path: str | Path) -> Path:
    work = Path(path)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def run_worker(code: str, *args: str, env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """`python -c CODE ARGS` in its own process: (what follows its last `RESULT ` line, or None when it failed
    or printed none; the tail of its output, for the error message)."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    payload = lines[-1][len("RESULT "):] if lines and proc.returncode == 0 else None
    return payload, (proc.stdout + proc.stderr)[-2000:]
