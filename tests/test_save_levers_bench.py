"""bench/save_levers.py on the CPU (one gloo rank, a tiny state): each load lever, the reader before `38af619`
(torch.load of every record) among them, loads back what was saved, bitwise. Its timings are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_load_lever_loads_the_saved_state(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH / "save_levers.py"), "--device", "cpu", "--gb", "0.05",
                           "--dd-gb", "1", "--levers", "defaults", "--load-repeats", "1", "--out", str(tmp_path / "sl"),
                           "--load-levers", "torch,read-ahead-torch-load,read-ahead"],
                          capture_output=True, text=True, timeout=600, cwd=BENCH)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "sl" / "results.json").read_text())
    loads = [r for r in rows if "load_lever" in r]
    assert [r["load_lever"] for r in loads] == ["torch", "read-ahead-torch-load", "read-ahead"]
    assert all(r["loaded"] == "equal" and r["gb"] > 0.04 for r in loads), loads
