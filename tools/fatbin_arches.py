"""For which GPU architectures a shared library ships its CUDA kernels as machine code (SASS, an ELF entry of a
fatbin) and for which only as PTX, which the CUDA driver compiles at the kernel's first use (into its cache,
~/.nv/ComputeCache or $CUDA_CACHE_PATH). A user's first training run paid 3.2-3.3 s for such compiling on one H200
(2026-12-04, docs/train.md); this tells, without a GPU, which installed libraries can cause it.

    python3 tools/fatbin_arches.py LIB.so [LIB.so ...] [--arch 90]

Reads each file's embedded fatbins (magic 0xBA55ED50) and counts their entries by kind and architecture. With --arch,
exits 1 when some fatbin has no machine code that GPU runs but PTX it can compile (the driver then does), else 0.
"""

from __future__ import annotations

import argparse
import struct
import sys
from collections import Counter
from pathlib import Path

MAGIC = struct.pack("<I", 0xBA55ED50)
HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries that follow
KINDS = {1: "PTX", 2: "SASS"}


def fatbins(data: bytes) -> list[list[tuple[str, int]]]:
    """Each fatbin in `data` as its entries' (kind, architecture), e.g. ("SASS", 90) for sm_90."""
    found: list[list[tuple[str, int]]] = []
    pos = data.find(MAGIC)
    while pos >= 0:
        _, version, header_size, size = HEADER.unpack_from(data, pos)
        end = pos + header_size + size
        if version != 1 or header_size != HEADER.size or end > len(data):
            pos = data.find(MAGIC, pos + 4)  # the magic's bytes by chance, not a fatbin
            continue
        entries, off = [], pos + header_size
        while off + 32 <= end:
            # entry: kind u16, version u16, header size u32, padded payload size u32, ..., architecture u32 at 28
            kind, _, entry_header, payload = struct.unpack_from("<HHII", data, off)
            entries.append((KINDS.get(kind, f"kind {kind}"), struct.unpack_from("<I", data, off + 28)[0]))
            if entry_header == 0:
                break
            off += entry_header + payload
        found.append(entries)
        pos = data.find(MAGIC, end)
    return found


def driver_compiled(bins: list[list[tuple[str, int]]], arch: int) -> int:
    """How many fatbins the driver compiles from PTX on a GPU of compute capability `arch`: no machine code it can run
    (SASS of the same major version, not newer: sm_80 runs on sm_86, nothing but sm_90 on sm_90), and PTX of `arch`
    or older, which is forward-compatible. A fatbin with neither is for other GPUs: never loaded there."""
    def runs(entries: list[tuple[str, int]]) -> bool:
        return any(kind == "SASS" and a // 10 == arch // 10 and a <= arch for kind, a in entries)
    return sum(1 for entries in bins if not runs(entries) and any(k == "PTX" and a <= arch for k, a in entries))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("libraries", nargs="+", type=Path)
    p.add_argument("--arch", type=int, help="the GPU's compute capability as one number: 90 for sm_90 (H100/H200)")
    a = p.parse_args(argv)
    compiled = 0
    for lib in a.libraries:
        bins = fatbins(lib.read_bytes())
        counts = Counter(entry for entries in bins for entry in entries)
        by_arch = sorted(counts.items(), key=lambda item: item[0][1])
        listed = ", ".join(f"{kind} sm_{arch}: {n}" for (kind, arch), n in by_arch)
        print(f"{lib}: {len(bins)} fatbins; {listed or 'no CUDA kernels'}")
        if a.arch is not None:
            n = driver_compiled(bins, a.arch)
            compiled += n
            print(f"  sm_{a.arch}: {n} fatbins compiled by the driver from PTX at first use (no machine code for it)")
    return 1 if compiled else 0


if __name__ == "__main__":
    sys.exit(main())
