"""What every benchmark script does with its runs: time each, print it as a JSON line as soon as it ends, then
write results.json and print the Markdown table; the exit code says whether any run failed."""

from __future__ import annotations

import json
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
