"""Where the host time of a resume's load goes (issue "Speed", part 3: load at >= 60% of the disk's read): the
records of a torch_dist checkpoint in file order, as train/checkpoint_reader.ReadAheadReader handles them, each step
timed alone and summed: `pread` of the record into new memory (the read-ahead thread's part); finding its tensor in
it (`saved_tensor`, a view, the consumer's part) and, for comparison, `torch.load` of the same bytes (weights_only,
which copies the tensor out of them: the reader's way before 2026-12-05); the copy of the view into a fresh target
of the same shape (on the GPU machine the consumer copies into the GPU instead). Run it twice: the first pass reads
the disk (after dropping the page cache, as root), the second the page cache, which leaves the host work.

    python bench/load_probe.py CHECKPOINT_ITERATION_DIR [--drop-cache] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from mcorekit.train.checkpoint_reader import checked_metadata, read_exactly, saved_tensor, torch_loaded


def probe(path: Path, device: str = "cpu") -> dict[str, float]:
    reader = FileSystemReader(str(path))
    reader.set_up_storage_reader(checked_metadata(path), True)  # .metadata through the restricted unpickler
    records = sorted(reader.storage_data.values(), key=lambda r: (r.relative_path, r.offset))
    seconds = {"pread": 0.0, "view": 0.0, "torch_load": 0.0, "copy": 0.0}
    fds: dict[str, int] = {}
    try:
        for r in records:
            fd = fds.get(r.relative_path)
            if fd is None:
                fd = fds[r.relative_path] = os.open(path / r.relative_path, os.O_RDONLY)
            start = time.perf_counter()
            record = read_exactly(fd, r.length, r.offset, r.relative_path)
            read = time.perf_counter()
            value = saved_tensor(record)
            viewed = time.perf_counter()
            torch_loaded(record)
            loaded = time.perf_counter()
            if isinstance(value, torch.Tensor):
                torch.empty(value.shape, dtype=value.dtype, device=device).copy_(value)
                if device != "cpu":
                    torch.cuda.synchronize()
            end = time.perf_counter()
            seconds["pread"] += read - start
            seconds["view"] += viewed - read
            seconds["torch_load"] += loaded - viewed
            seconds["copy"] += end - loaded
    finally:
        for fd in fds.values():
            os.close(fd)
    total = sum(r.length for r in records)
    gb = total / 1e9
    return {"records": len(records), "bytes": total, "gb": round(gb, 3), "device": device,
            **{f"{k}_s": round(v, 3) for k, v in seconds.items()},
            **{f"{k}_gb_per_s": round(gb / v, 2) if v else None for k, v in seconds.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="an iteration (or release) folder of a torch_dist checkpoint")
    p.add_argument("--drop-cache", action="store_true", help="drop the page cache first (root only)")
    p.add_argument("--device", default="cpu", help="where the targets live (cuda on the GPU machine)")
    a = p.parse_args(argv)
    if a.drop_cache:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    got = probe(Path(a.checkpoint), a.device)
    print(f"{got['records']} records, {got['gb']} GB: pread {got['pread_s']} s ({got['pread_gb_per_s']} GB/s), "
          f"view {got['view_s']} s, torch.load (not used) {got['torch_load_s']} s ({got['torch_load_gb_per_s']} "
          f"GB/s), copy into a fresh {a.device} target {got['copy_s']} s ({got['copy_gb_per_s']} GB/s)")
    print("RESULT " + json.dumps(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
