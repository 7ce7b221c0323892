"""Where the "checks" phase of start-up goes: CUDA's initialisation and Megatron-Core/TE's imports, alone, one after
the other, and overlapped (CUDA initialised on a thread while the main thread imports). One fresh process each.

    python bench/startup_probe.py [--repeats 2] [--cases imports,overlapped]

The bytecode is as the environment has it: with PYTHONDONTWRITEBYTECODE set and packages installed without their
.pyc files (uv's default, pip --no-compile), every process compiles each module it imports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CASES = {
    "torch": "import torch",
    "cuda_init": "import torch; torch.cuda.init(); torch.cuda.get_device_capability(0)",
    "imports": "import torch, transformer_engine.pytorch, megatron.core.models.gpt, megatron.core.optimizer",
    "sequential": "import torch, transformer_engine.pytorch, megatron.core.models.gpt, megatron.core.optimizer; "
                  "torch.cuda.init(); torch.cuda.get_device_capability(0)",
    "cuda_first": "import torch; torch.cuda.init(); torch.cuda.get_device_capability(0); "
                  "import transformer_engine.pytorch, megatron.core.models.gpt, megatron.core.optimizer",
    "overlapped": "import torch, threading; t = threading.Thread(target=torch.cuda.init); t.start(); "
                  "import transformer_engine.pytorch, megatron.core.models.gpt, megatron.core.optimizer; "
                  "t.join(); torch.cuda.get_device_capability(0)",
}
TIMED = "import time; _t = time.perf_counter(); {body}; print('SECONDS', time.perf_counter() - _t)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES))
    a = p.parse_args()
    if bad := [c for c in a.cases.split(",") if c not in CASES]:
        p.error(f"unknown cases {bad}")
    rows: dict[str, list[float]] = {}
    for r in range(a.repeats):
        for name in a.cases.split(","):
            body = CASES[name]
            out = subprocess.run([sys.executable, "-c", TIMED.format(body=body)], capture_output=True, text=True)
            line = [x for x in out.stdout.splitlines() if x.startswith("SECONDS")]
            rows.setdefault(name, []).append(float(line[0].split()[1]) if line else float("nan"))
            if not line:
                print(name, out.stderr[-2000:], file=sys.stderr)
    for name, s in rows.items():
        print(json.dumps({"case": name, "seconds": [round(x, 2) for x in s], "median": round(statistics.median(s), 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
