"""mcorekit/torch_save.py, the parser of stored tensor chunks (the converter's and the resume's): crafted archives
are refused with NotATensorChunk and a reason before zipfile allocates or parses what they claim, in memory
(locate_in) and in a file (locate) alike; nothing from them is unpickled."""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch

from mcorekit.torch_save import END, ZIP64_END, ZIP64_LOCATOR, NotATensorChunk, locate, locate_in


def _saved(value: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _rewritten(data: bytes, change: Callable[[zipfile.ZipInfo], None] = lambda info: None,
               pkl: bytes | None = None) -> bytes:
    """The archive's entries written again by zipfile, each ZipInfo changed by `change` first, data.pkl's bytes
    replaced by `pkl` where given."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        entries = [(i.filename, pkl if pkl is not None and i.filename.endswith("data.pkl") else z.read(i))
                   for i in z.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, payload in entries:
            info = zipfile.ZipInfo(name)
            change(info)
            z.writestr(info, payload)
    return out.getvalue()


def _many_entries(n: int) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for i in range(n):
            z.writestr(f"archive/x{i}", b"")
    return out.getvalue()


def _zip64_claiming(entries: int) -> bytes:
    """torch.save's own archive (it always writes zip64 end records) with the zip64 record's entry count raised."""
    data = bytearray(_saved(torch.ones(4)))
    at = len(data) - END.size - ZIP64_LOCATOR.size - ZIP64_END.size
    fields = list(ZIP64_END.unpack_from(data, at))
    fields[6] = fields[7] = entries
    ZIP64_END.pack_into(data, at, *fields)
    return bytes(data)


def _bzip2_pkl(info: zipfile.ZipInfo) -> None:
    if info.filename.endswith("data.pkl"):
        info.compress_type = zipfile.ZIP_BZIP2


class _Storage:
    """Pickled as torch.save pickles a storage: a persistent id."""


class _Tensor:
    def __init__(self, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args = (_Storage(), 0, size, stride, False, collections.OrderedDict())

    def __reduce__(self) -> tuple:
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: object) -> object:
        return ("storage", torch.FloatStorage, "0", "cpu", 1) if isinstance(obj, _Storage) else None


def _with_pkl(size: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    """torch.save's archive of a one-element float tensor whose data.pkl describes `size` and `stride` instead."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_Tensor(size, stride))
    return _rewritten(_saved(torch.ones(1)), pkl=buf.getvalue())


CRAFTED = {
    "2000 entries": (lambda: _many_entries(2000), "a zip directory of 2000 entries"),
    "zip64 record claiming 400000 entries": (lambda: _zip64_claiming(400_000), "a zip directory of 400000 entries"),
    "data.pkl compressed with bzip2": (lambda: _rewritten(_saved(torch.ones(3)), _bzip2_pkl), "data.pkl"),
    "no end record": (lambda: _saved(torch.ones(3))[:-10], "no zip end record"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
@pytest.mark.parametrize("where", ["memory", "file"])
def test_a_crafted_archive_is_refused_with_its_reason(case: str, where: str, tmp_path: Path) -> None:
    make, reason = CRAFTED[case]
    data = make()
    with pytest.raises(NotATensorChunk, match=reason):
        if where == "memory":
            locate_in(memoryview(data))
        else:
            (tmp_path / "f").write_bytes(b"x" * 100 + data)
            fd = os.open(tmp_path / "f", os.O_RDONLY)
            try:
                locate(fd, 100, len(data))
            finally:
                os.close(fd)


def test_an_encrypted_data_pkl_is_refused() -> None:
    data = bytearray(_saved(torch.ones(3)))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        pkl = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    central = data.index(b"PK\x01\x02")  # the first central entry is data.pkl's
    assert data[central + 46:central + 46 + len(pkl.filename)] == pkl.filename.encode()
    data[central + 8] |= 0x1  # general purpose flag: encrypted
    with pytest.raises(NotATensorChunk, match="compressed or encrypted"):
        locate_in(memoryview(bytes(data)))


def test_a_size_no_storage_could_hold_is_refused() -> None:
    """A stride-0 dimension fits any size into one element (torch.save writes them for expanded tensors); a size
    of 2^62 elements is refused before anything is viewed."""
    assert locate_in(memoryview(_with_pkl((1 << 20,), (0,)))).size == (1 << 20,)  # the crafting itself works
    with pytest.raises(NotATensorChunk, match="elements"):
        locate_in(memoryview(_with_pkl((1 << 31, 1 << 31), (0, 0))))
