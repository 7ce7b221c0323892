"""The torch_dist read path: chunks read straight from the .distcp files (mcorekit/torch_save.py) give the same bytes as
torch.distributed.checkpoint's own load, with several chunks per tensor, mapped or read, in our checkpoints and in
Megatron-Core's; nothing from the data files is unpickled; a damaged chunk is one error line, never garbage."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from hf_models import make_model
from mcorekit import torch_save
from mcorekit.convert import files, torch_dist
from mcorekit.convert.torch_dist import BACKEND, ChunkSource, PlannedTensor, TorchDistReader, load_metadata
from test_faults_convert import assert_nothing_at, assert_one_error, convert, tree_digest

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "megatron-written-torch_dist.tgz"


def dcp_load(path: Path, fqn: str, md: object) -> torch.Tensor:
    """The tensor as torch.distributed.checkpoint loads it (its own reader; these test files are trusted)."""
    out = {fqn: torch.zeros(tuple(md.size), dtype=md.properties.dtype)}
    with torch_dist._quiet_dcp():
        dcp.load(out, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return out[fqn]


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_reads_like_dcp(path: Path) -> int:
    """Every tensor, whole and (for stacked ones) layer by layer, is bytewise what DCP loads; returns how many."""
    reader = TorchDistReader(path)
    keys = reader.tensor_keys()
    for fqn, md in keys.items():
        ref = dcp_load(path, fqn, md)
        got = reader.read(fqn)
        assert got.dtype == ref.dtype and got.shape == ref.shape, fqn
        assert bits(got) == bits(ref), fqn
        if ref.dim() >= 2:
            for layer in range(ref.shape[0]):
                assert bits(reader.read(fqn, (layer,))) == bits(ref[layer]), (fqn, layer)
    return len(keys)


def split(t: torch.Tensor, rows: int, cols: int) -> list[ChunkSource]:
    """t [layers, R, C] in chunks of one layer and R/rows x C/cols (a TP-like split in two dimensions)."""
    L, R, C = t.shape
    r, c = R // rows, C // cols
    return [ChunkSource((l, i * r, j * c), (1, r, c), lambda l=l, i=i, j=j: t[l:l + 1, i * r:(i + 1) * r, j * c:(j + 1) * c].clone())
            for l in range(L) for i in range(rows) for j in range(cols)]


@pytest.fixture(params=[64, 1], ids=["aligned", "unaligned"])
def chunked(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkpoint with several chunks per tensor (split in dims 1 and 2 as TP would, one per layer), big ones
    (mapped when aligned) and small ones (read), bf16 and fp32; `unaligned` as DCP alone places them."""
    monkeypatch.setattr(torch_dist, "ITEM_ALIGN", request.param)
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3, 512, 1024, generator=g).to(torch.bfloat16)  # 1 MiB per chunk of 1 x 512 x 1024
    wide = torch.randn(2, 256, 1024, generator=g)  # fp32, 4 chunks per layer
    small = torch.randn(2, 6, 10, generator=g).to(torch.bfloat16)
    flat = torch.randn(8, 4, generator=g)
    planned = [PlannedTensor("big", tuple(big.shape), big.dtype, split(big, 1, 1), "layer"),
               PlannedTensor("wide", tuple(wide.shape), wide.dtype, split(wide, 2, 2), "layer"),
               PlannedTensor("small", tuple(small.shape), small.dtype, split(small, 3, 2), "layer"),
               PlannedTensor("flat", (8, 4), flat.dtype, [ChunkSource((0, 0), (5, 4), lambda: flat[:5].clone()),
                                                          ChunkSource((5, 0), (3, 4), lambda: flat[5:].clone())])]
    path = tmp_path_factory.mktemp("chunked") / "ckpt"
    torch_dist.write(path, planned, {"common_state/shard_0_1": torch_dist.common_state()})
    return path


def test_chunked_reads_equal_dcp_load(chunked: Path) -> None:
    assert assert_reads_like_dcp(chunked) == 4


def test_writer_aligns_every_chunk(chunked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our writer puts every chunk's data at a multiple of 64 bytes (so the reader can map it); the unaligned
    variant shows the test can tell."""
    reader = TorchDistReader(chunked)
    offsets = []
    for index, info in reader.metadata.storage_data.items():
        if index.offset is not None:
            fd = os.open(chunked / info.relative_path, os.O_RDONLY)
            try:
                offsets.append(torch_save.locate(fd, info.offset, info.length).data_offset)
            finally:
                os.close(fd)
    aligned = [o % 64 == 0 for o in offsets]
    assert all(aligned) if torch_dist.ITEM_ALIGN == 64 else not all(aligned)


def test_big_aligned_chunk_is_mapped_not_copied(chunked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large chunk whose bytes lie aligned is a mapping of the file (no copy); unaligned, it is read."""
    maps = []
    real = files.mmap.mmap  # the one reader both checkpoint formats use

    def counting(*args: object, **kwargs: object) -> object:
        maps.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(files.mmap, "mmap", counting)
    reader = TorchDistReader(chunked)
    got = [reader.read("big", (layer,)) for layer in range(3)]
    element_aligned = 0  # DCP alone places a chunk's data at an odd byte about every other time
    for index, info in reader.metadata.storage_data.items():
        if index.fqn == "big":
            fd = os.open(chunked / info.relative_path, os.O_RDONLY)
            try:
                element_aligned += torch_save.locate(fd, info.offset, info.length).data_offset % 2 == 0
            finally:
                os.close(fd)
    assert len(maps) == element_aligned == 3 if torch_dist.ITEM_ALIGN == 64 else len(maps) == element_aligned < 3
    ref = dcp_load(chunked, "big", reader.tensor_keys()["big"])
    assert all(bits(t) == bits(ref[layer]) for layer, t in enumerate(got))


def test_reading_unpickles_nothing(chunked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once .metadata is loaded (restricted), no tensor read unpickles anything: torch.load and every unpickler
    fail if called."""
    reader = TorchDistReader(chunked)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("unpickling during a tensor read")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    for fqn in reader.tensor_keys():
        reader.read(fqn)


def test_non_contiguous_stored_chunk(tmp_path: Path) -> None:
    """DCP keeps a tensor's strides when it owns its whole storage (a transposed weight); read back as DCP does."""
    g = torch.Generator().manual_seed(1)
    state = {"t": torch.randn(1024, 384, generator=g).to(torch.bfloat16).t(), "s": torch.randn(5, 3, generator=g).t()}
    with torch_dist._quiet_dcp():
        dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    (tmp_path / "metadata.json").write_text(json.dumps(BACKEND))
    reader = TorchDistReader(tmp_path)
    for index, info in reader.metadata.storage_data.items():  # stored with strides: the as_strided path is taken
        fd = os.open(tmp_path / info.relative_path, os.O_RDONLY)
        try:
            assert not torch_save.locate(fd, info.offset, info.length).is_dense()
        finally:
            os.close(fd)
    for fqn, t in state.items():
        assert bits(reader.read(fqn)) == bits(t)
    assert assert_reads_like_dcp(tmp_path) == 2


def test_megatron_written_reads_equal_dcp_load(tmp_path: Path) -> None:
    if not FIXTURES.is_file():
        pytest.skip(f"{FIXTURES} not present (shared/ fixtures live beside the repository)")
    with tarfile.open(FIXTURES) as tar:
        tar.extractall(tmp_path, filter="data")
    found = sorted(tmp_path.glob("*/mcore/iter_*"))
    assert found
    for iter_dir in found:
        assert assert_reads_like_dcp(iter_dir) >= 9


# ---------------------------------------------------------------- damaged chunks: one error line


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reads")
    hf = make_model("llama", False, root / "llama")
    rc, err = convert("hf-to-mcore", str(hf), str(root / "ckpt"))
    assert rc == 0, err
    return root / "ckpt"


KEY = "embedding.word_embeddings.weight"


def _chunk(c: Path) -> tuple[Path, int, int]:
    """The .distcp file, offset and length of the embedding's stored chunk."""
    md = load_metadata(c / "release/.metadata")
    info = next(v for k, v in md.storage_data.items() if k.fqn == KEY)
    return c / "release" / info.relative_path, info.offset, info.length


def _patch(c: Path, find: bytes, change: Callable[[bytes], bytes]) -> None:
    """Change the embedding chunk's bytes at the first occurrence of `find` inside it."""
    file, offset, length = _chunk(c)
    raw = bytearray(file.read_bytes())
    at = raw.index(find, offset, offset + length)
    raw[at:at + len(find)] = change(find)
    file.write_bytes(bytes(raw))


def _replace_chunk(c: Path, blob: bytes) -> None:
    """Point the embedding's chunk at `blob`, appended to its file (.metadata rewritten)."""
    file, _, _ = _chunk(c)
    start = file.stat().st_size
    with open(file, "ab") as f:
        f.write(blob)
    md = load_metadata(c / "release/.metadata")
    for k, v in md.storage_data.items():
        if k.fqn == KEY:
            v.offset, v.length = start, len(blob)
    (c / "release/.metadata").write_bytes(pickle.dumps(md))


def _end_record(c: Path) -> None:
    file, offset, length = _chunk(c)
    raw = bytearray(file.read_bytes())
    raw[offset + length - 22:offset + length] = bytes(22)
    file.write_bytes(bytes(raw))


def _local_header(c: Path) -> None:
    """The data record's local header signature overwritten (its name follows the 30-byte header)."""
    file, offset, length = _chunk(c)
    raw = bytearray(file.read_bytes())
    at = raw.index(b"/data/0", offset, offset + length) - len("archive") - 30
    assert raw[at:at + 4] == b"PK\x03\x04"
    raw[at:at + 4] = b"XXXX"
    file.write_bytes(bytes(raw))


class Payload:
    """Pickles as a call to os.system, padded so the chunk looks big enough for the tensor."""

    def __init__(self, marker: Path, pad: int) -> None:
        self.marker, self.pad = marker, pad

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker} #{'x' * self.pad}",)


def _saved(obj: object) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _flipped(blob: bytes) -> bytes:
    return blob.replace(b"_rebuild_tensor_v2", b"_rebuild_tensor_v3")


CORRUPTIONS = {
    "end-record-zeroed": (_end_record, "not a torch.save archive"),
    # our writer writes no CRC-32s (mcorekit.outputs.without_crc32): the damage is found by the disassembly
    "data-pkl-flipped": (lambda c: _patch(c, b"_rebuild_tensor_v2", lambda b: b"_rebuild_tensor_v3"),
                         "does not rebuild one plain tensor"),
    # a chunk written with CRC-32s (Megatron-Core's own writer): zipfile checks data.pkl's
    "data-pkl-flipped-with-crc": (lambda c: _replace_chunk(c, _flipped(_saved(torch.zeros(256, 64, dtype=torch.bfloat16)))),
                                  "Bad CRC-32"),
    "local-header-gone": (_local_header, "no local header"),
    "fp32-in-a-bf16-chunk": (lambda c: _replace_chunk(c, _saved(torch.zeros(256, 64))), "stored as (256, 64) of torch.float32"),
    "wrong-shape": (lambda c: _replace_chunk(c, _saved(torch.zeros(64, 255, dtype=torch.bfloat16))), "stored as (64, 255)"),
    "list-of-tensor": (lambda c: _replace_chunk(c, _saved([torch.zeros(256, 64, dtype=torch.bfloat16)])),
                       "not a saved tensor (opcode EMPTY_LIST"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_damaged_chunk_is_one_error_line(ckpt: Path, tmp_path: Path, case: str) -> None:
    damage, needle = CORRUPTIONS[case]
    c = Path(shutil.copytree(ckpt, tmp_path / "ckpt"))
    damage(c)
    before = tree_digest(c)
    rc, err = convert("mcore-to-hf", str(c), str(tmp_path / "out"))
    assert_one_error(rc, err, needle)
    assert f"cannot read tensor '{KEY}'" in err
    assert_nothing_at(tmp_path / "out")
    assert tree_digest(c) == before


def test_crafted_chunk_runs_nothing(ckpt: Path, tmp_path: Path) -> None:
    """A chunk whose data.pkl calls os.system: disassembled, refused, never run."""
    c = Path(shutil.copytree(ckpt, tmp_path / "ckpt"))
    marker = tmp_path / "MARKER"
    blob = _saved(Payload(marker, 40000))
    assert len(blob) > 256 * 64 * 2  # passes .metadata's size check, so the chunk itself is looked at
    _replace_chunk(c, blob)
    rc, err = convert("mcore-to-hf", str(c), str(tmp_path / "out"))
    assert_one_error(rc, err, "does not rebuild one plain tensor")
    assert not marker.exists()
    assert_nothing_at(tmp_path / "out")


def test_file_truncated_inside_a_chunk(ckpt: Path, tmp_path: Path) -> None:
    c = Path(shutil.copytree(ckpt, tmp_path / "ckpt"))
    file, offset, length = _chunk(c)
    os.truncate(file, offset + length // 2)
    rc, err = convert("mcore-to-hf", str(c), str(tmp_path / "out"))
    assert_one_error(rc, err, "truncated checkpoint file")
    assert_nothing_at(tmp_path / "out")
