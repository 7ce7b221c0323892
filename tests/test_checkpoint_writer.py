"""A synchronous save as train/checkpoint.Saver writes it (no CRC-32s, each tensor staged by the writer just
before it is written) is the checkpoint Megatron-Core's own writer makes: the same files and .metadata, the same
bytes apart from the CRC fields, loaded bitwise by Megatron-Core's dist_checkpointing.load and by convert/'s reader.
On CPU with one gloo rank (the GPU copy that the staging does on a GPU node is the identity here)."""

from __future__ import annotations

import functools
import re

from pathlib import Path

import pytest
import torch

from mcorekit.train.checkpoint import save_strategy, stage_per_tensor, without_crc32


@pytest.fixture(autouse=True)
def _finalize_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-Core's finalize broadcasts its failure flag from a tensor on torch.cuda.current_device(): no GPU
    here, so that one call is pointed at the CPU (the gloo rank broadcasts it from there)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def _state() -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    g = torch.Generator().manual_seed(0)
    tensors = {"w.bf16": torch.randn(64, 48, generator=g).bfloat16(), "m.fp32": torch.randn(3000, generator=g),
               "e.int": torch.arange(17, dtype=torch.int64), "view.fp32": torch.randn(8, 10, generator=g)[:, 2:7]}
    state = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}
    state["rng"] = ShardedObject("rng", {"seed": 1234, "state": torch.arange(4)}, (1,), (0,), replica_id=0)
    state["iteration"] = 7
    return state


def _save(path: Path, ours: bool) -> None:
    from megatron.core import dist_checkpointing

    path.mkdir()
    if ours:
        with without_crc32():
            request = dist_checkpointing.save(_state(), str(path), sharded_strategy=save_strategy(),
                                              async_sharded_save=True, async_strategy="mcore")
            stage_per_tensor(request).execute_sync()
    else:  # Megatron-Core's own staging and writing; its copy to pinned memory needs CUDA, so a plain copy here
        request = dist_checkpointing.save(_state(), str(path), sharded_strategy=save_strategy(),
                                          async_sharded_save=True, async_strategy="mcore")
        stage = request.preload_fn
        request._replace(preload_fn=functools.partial(stage.func, stage.args[0], False)).execute_sync()


def _without_save_ids(data: bytes) -> bytes:
    """The bytes with each torch.save record's serialization id (digits unique to every save) zeroed."""
    return re.sub(rb"(\.data/serialization_id(?:FB[\s\S]{2}Z*)?)(\d+)(?=PK\x07\x08)",
                  lambda m: m[1] + b"0" * len(m[2]), data)


def _without_crcs(data: bytes) -> bytes:
    """The bytes with every zip CRC-32 field (local headers, data descriptors, central directory) zeroed."""
    out = bytearray(data)
    for sig, at in ((b"PK\x03\x04", 14), (b"PK\x07\x08", 4), (b"PK\x01\x02", 16)):
        i = out.find(sig)
        while i >= 0:
            out[i + at:i + at + 4] = b"\0\0\0\0"
            i = out.find(sig, i + 4)
    return bytes(out)


def test_saver_writer_matches_megatron_writer(model_parallel: None, tmp_path: Path) -> None:
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    _save(tmp_path / "megatron", ours=False)
    _save(tmp_path / "ours", ours=True)
    names = sorted(p.name for p in (tmp_path / "megatron").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert torch.serialization.get_crc32_options()  # restored after the save
    for name in names:
        a, b = (tmp_path / "megatron" / name).read_bytes(), (tmp_path / "ours" / name).read_bytes()
        if name.endswith(".distcp"):
            assert a != b  # Megatron-Core's has CRCs, ours has none
            assert _without_save_ids(b) != b, name  # every save's ids were found and masked
            assert _without_crcs(_without_save_ids(a)) == _without_save_ids(b), name
            assert _without_crcs(b) == b, name  # ours: every CRC field already 0
        elif name == ".metadata":  # the same apart from each save's own id and folder
            ma, mb = (FileSystemReader(str(tmp_path / d)).read_metadata() for d in ("megatron", "ours"))
            assert ma.storage_meta.save_id != mb.storage_meta.save_id
            ma.storage_meta = mb.storage_meta = None
            assert ma == mb
        elif name != "common.pt":  # common.pt is torch.save too: its CRCs differ the same way
            assert a == b, name
    template = _state()
    loaded = dist_checkpointing.load(_state(), str(tmp_path / "ours"))
    for key in ("w.bf16", "m.fp32", "e.int", "view.fp32"):
        assert torch.equal(loaded[key], template[key].data), key
        assert loaded[key].dtype == template[key].data.dtype
    assert loaded["rng"]["seed"] == 1234 and torch.equal(loaded["rng"]["state"], torch.arange(4))
    assert loaded["iteration"] == 7


def test_convert_reader_reads_crcless_checkpoint(model_parallel: None, tmp_path: Path) -> None:
    from mcorekit.convert.torch_dist import TorchDistReader

    _save(tmp_path / "ours", ours=True)
    reader = TorchDistReader(tmp_path / "ours")
    template = _state()
    for key in ("w.bf16", "m.fp32", "e.int", "view.fp32"):
        got = reader.read(key)
        assert got.dtype == template[key].data.dtype and torch.equal(got, template[key].data), key


@pytest.mark.parametrize("crc", [True, False])
def test_without_crc32_restores_the_setting(crc: bool) -> None:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        with without_crc32():
            assert torch.serialization.get_crc32_options() is False
        assert torch.serialization.get_crc32_options() is crc
    finally:
        torch.serialization.set_crc32_options(before)
