"""tools/fatbin_arches.py on fatbins built here byte by byte, in the layout nvcc embeds them (magic 0xBA55ED50, a
16-byte header, then entries each with its kind and architecture): no CUDA library is installed on this machine."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def tool() -> Any:
    spec = importlib.util.spec_from_file_location("fatbin_arches", REPO / "tools" / "fatbin_arches.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    """One fatbin entry: kind (1 PTX, 2 ELF), version, header size 64, padded payload size, the architecture at 28."""
    head = struct.pack("<HHII", kind, 0x101, 64, len(payload)) + bytes(16) + struct.pack("<I", arch)
    return head + bytes(64 - len(head)) + payload


def fatbin(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def library(tmp_path: Path, *bins: bytes) -> Path:
    """A file like a shared library's: other bytes around and between the fatbins, and the magic once by chance."""
    lib = tmp_path / "libkernels.so"
    stray_magic = struct.pack("<IHHQ", 0xBA55ED50, 7, 3, 1 << 40)  # not a fatbin: wrong version, size past the end
    lib.write_bytes(b"\x7fELF" + bytes(100) + stray_magic + b"".join(b + bytes(37) for b in bins))
    return lib


def test_entries_by_kind_and_architecture(tmp_path: Path) -> None:
    fb = tool()
    lib = library(tmp_path, fatbin(entry(2, 80, b"s" * 40), entry(2, 90, b"s" * 24), entry(1, 120, b"ptx" * 9)),
                  fatbin(entry(2, 80, b"s" * 8), entry(1, 90, b"p" * 16)))
    bins = fb.fatbins(lib.read_bytes())
    assert bins == [[("SASS", 80), ("SASS", 90), ("PTX", 120)], [("SASS", 80), ("PTX", 90)]]
    assert fb.driver_compiled(bins, 90) == 1  # the second: PTX for sm_90, machine code only for sm_80
    assert fb.driver_compiled(bins, 80) == 0  # both have sm_80 machine code
    assert fb.driver_compiled(bins, 86) == 0  # sm_80 machine code runs on sm_86
    assert fb.driver_compiled(bins, 120) == 2  # the first: PTX for sm_120; the second: sm_90 PTX compiles for it too
    # PTX of an older architecture compiles for a newer one; machine code of another major version does not run
    older = fb.fatbins(fatbin(entry(2, 80, b"s" * 8), entry(1, 80, b"p" * 8)))
    assert fb.driver_compiled(older, 90) == 1 and fb.driver_compiled(older, 86) == 0
    # a fatbin for other GPUs only (machine code for sm_75, PTX for sm_121) is never loaded on sm_90
    assert fb.driver_compiled(fb.fatbins(fatbin(entry(2, 75, b"s" * 8), entry(1, 121, b"p" * 8))), 90) == 0


def test_exit_status_says_whether_the_driver_compiles_for_the_architecture(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    fb = tool()
    compiled = library(tmp_path, fatbin(entry(2, 80, b"s" * 8), entry(1, 90, b"p" * 8)))
    assert fb.main([str(compiled), "--arch", "90"]) == 1
    assert "sm_90: 1 fatbins compiled by the driver from PTX" in capsys.readouterr().out
    assert fb.main([str(compiled), "--arch", "80"]) == 0
    plain = tmp_path / "plain.so"
    plain.write_bytes(b"\x7fELF" + bytes(64))
    assert fb.main([str(plain), "--arch", "90"]) == 0
    assert "0 fatbins; no CUDA kernels" in capsys.readouterr().out
