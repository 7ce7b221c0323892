"""The resume load's reader (train/checkpoint_reader.py) loads what torch's own reader loads, bitwise, reading each
file front to back; a truncated file and a failing target are raised, and its read-ahead thread stops either way.
On CPU with one gloo rank; the checkpoints are written by the Saver's writer (tests/test_checkpoint_writer.py)."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from mcorekit.torch_save import locate_in
from mcorekit.train import checkpoint_reader
from mcorekit.train.checkpoint_reader import ReadAheadReader, read_ahead
from test_checkpoint_writer import _finalize_on_cpu, _save, _state  # noqa: F401  # the fixture applies here too
from test_faults_convert import Evil


def _zeroed() -> dict:
    """The test state's sharded tensors with zeros for data: a load must fill every byte."""
    state = _state()
    for key in ("w.bf16", "m.fp32", "e.int", "view.fp32", "t.fp32"):
        state[key].data = torch.zeros_like(state[key].data)
    return state


def _load(path: Path, ahead: bool) -> dict:
    from megatron.core import dist_checkpointing

    if not ahead:
        return dist_checkpointing.load(_zeroed(), str(path))
    with read_ahead():
        return dist_checkpointing.load(_zeroed(), str(path))


def _readers() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name == "mcorekit-read-ahead"}


@pytest.mark.parametrize(("ahead_bytes", "most_per_read"), [
    (checkpoint_reader.AHEAD_BYTES, None),
    (1, None),  # the consumer paces every read
    (checkpoint_reader.AHEAD_BYTES, 100),  # short reads, as Linux gives a record over 2 GiB: the rest is read next
])
def test_loads_what_torchs_reader_loads_in_file_order(model_parallel: None, tmp_path: Path, ahead_bytes: int,
                                                      most_per_read: int | None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.dist_checkpointing.strategies import torch as strategies

    _save(tmp_path / "ckpt", ours=True)
    monkeypatch.setattr(checkpoint_reader, "AHEAD_BYTES", ahead_bytes)
    reads: list[tuple[int, int]] = []
    preadv = os.preadv

    def spy(fd: int, buffers: list[memoryview], offset: int) -> int:
        (buffer,) = buffers
        got = preadv(fd, [buffer[:most_per_read or len(buffer)]], offset)
        if threading.current_thread().name == "mcorekit-read-ahead":  # not common_state's read, before the load
            reads.append((offset, got))
        return got

    monkeypatch.setattr(checkpoint_reader.os, "preadv", spy)
    with read_ahead():
        assert type(strategies._get_filesystem_reader(str(tmp_path / "ckpt"))) is ReadAheadReader
    assert strategies._get_filesystem_reader.__name__ == "_get_filesystem_reader"  # put back
    theirs, ours = _load(tmp_path / "ckpt", ahead=False), _load(tmp_path / "ckpt", ahead=True)
    template = _state()
    for key in ("w.bf16", "m.fp32", "e.int", "view.fp32", "t.fp32"):
        assert ours[key].dtype == template[key].data.dtype
        assert torch.equal(ours[key], template[key].data) and torch.equal(ours[key], theirs[key]), key
    assert ours["rng"]["seed"] == 1234 and torch.equal(ours["rng"]["state"], torch.arange(4))
    assert ours["iteration"] == 7 == theirs["iteration"]
    # every record (5 tensors, the ShardedObject) read once, front to back, none overlapping
    assert reads == sorted(reads) and all(a + n <= b for (a, n), (b, _) in zip(reads, reads[1:]))
    if most_per_read:
        assert len(reads) > 6 and max(n for _, n in reads) == most_per_read
    else:
        assert len(reads) == 6
    assert not _readers()


def _record(value: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(value, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("shape", ["plain", "transposed", "a slice", "0-d", "empty"])
def test_a_saved_tensor_is_viewed_where_its_bytes_were_read(dtype: torch.dtype, shape: str) -> None:
    """What torch.load gives, bitwise, with the same strides, as a view into the record's memory (no copy)."""
    full = (torch.randn(6, 10) * 50).to(dtype)
    value = {"plain": full, "transposed": full.t(), "a slice": full[2:5, 1:8], "0-d": full[1, 2],
             "empty": full[:0]}[shape]
    record = _record(value)
    expected = torch.load(io.BytesIO(record.numpy().tobytes()), weights_only=True)
    got = checkpoint_reader.saved_tensor(record)
    assert got.dtype == expected.dtype and got.size() == expected.size() and got.stride() == expected.stride()
    assert torch.equal(got.flatten().view(torch.uint8), expected.flatten().view(torch.uint8))  # bitwise
    start = record.data_ptr()
    assert got.untyped_storage().data_ptr() == start  # the record's own memory
    assert got.numel() == 0 or start < got.data_ptr() < start + record.numel()


def test_a_saved_tensor_at_an_unaligned_offset_is_copied_out() -> None:
    """An archive whose storage record starts at an odd offset (zipfile, unlike torch.save, does not align):
    the bytes are copied to aligned memory; the values are torch.load's."""
    import zipfile

    value = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with zipfile.ZipFile(io.BytesIO(_record(value).numpy().tobytes())) as saved:
        records = {i.filename.split("/", 1)[1]: saved.read(i) for i in saved.infolist()}
    unaligned = 0
    for pad in range(4):
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
            for name, data in records.items():
                z.writestr(("a" * pad) + "archive/" + name, data)  # a longer name moves the bytes after it
        record = torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
        got = checkpoint_reader.saved_tensor(record)
        assert torch.equal(got, value) and torch.equal(got, torch.load(io.BytesIO(out.getvalue()), weights_only=True))
        aligned = locate_in(memoryview(record.numpy())).data_offset % 4 == 0
        assert (got.untyped_storage().data_ptr() == record.data_ptr()) == aligned  # a view exactly where aligned
        unaligned += not aligned
    assert unaligned
    record = _record(value)  # torch.save's own alignment, but the record at an odd address (a slice of memory)
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), record])[3:]
    assert shifted.data_ptr() % 4 and torch.equal(checkpoint_reader.saved_tensor(shifted), value)


def test_a_record_that_is_not_one_tensor_goes_to_torch_load() -> None:
    value = {"a": torch.ones(3), "b": [1, 2]}
    got = checkpoint_reader.saved_tensor(_record(value))
    assert torch.equal(got["a"], value["a"]) and got["b"] == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint16, torch.complex32])
def test_a_dtype_torch_saves_with_its_v3_rebuild_goes_to_torch_load(dtype: torch.dtype) -> None:
    """torch.save writes these with _rebuild_tensor_v3, which mcorekit.torch_save does not read: torch.load's
    value, bitwise, in memory of its own."""
    value = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(dtype)
    record = _record(value)
    got = checkpoint_reader.saved_tensor(record)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), value.view(torch.uint8))
    assert got.untyped_storage().data_ptr() != record.data_ptr()


def test_a_tensor_record_that_would_run_code_is_refused_not_run(tmp_path: Path) -> None:
    """The parser refuses it (no _rebuild_tensor_v2) and torch.load, weights_only, refuses it too: nothing runs."""
    import pickle

    record = _record(Evil(tmp_path / "ran"))
    with pytest.raises(pickle.UnpicklingError, match="system"):
        checkpoint_reader.saved_tensor(record)
    assert not (tmp_path / "ran").exists()


def test_the_reader_views_every_plain_tensor_record(model_parallel: None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """What read_data copies into the targets is, for each of the saved tensors, a view into the record it read."""
    _save(tmp_path / "ckpt", ours=True)
    views = []
    real = checkpoint_reader.saved_tensor

    def spy(record: torch.Tensor) -> torch.Tensor:
        got = real(record)
        views.append(got.untyped_storage().data_ptr() == record.data_ptr())
        return got

    monkeypatch.setattr(checkpoint_reader, "saved_tensor", spy)
    loaded = _load(tmp_path / "ckpt", ahead=True)
    assert views == [True] * 5  # w.bf16, m.fp32, e.int, view.fp32, t.fp32; the ShardedObject is a bytes record
    template = _state()
    assert all(torch.equal(loaded[k], template[k].data) for k in ("w.bf16", "m.fp32", "e.int", "view.fp32", "t.fp32"))


def test_a_truncated_file_is_an_error_not_a_hang(model_parallel: None, tmp_path: Path) -> None:
    _save(tmp_path / "ckpt", ours=True)
    data = next((tmp_path / "ckpt").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(BaseException, match="a truncated file"):
        _load(tmp_path / "ckpt", ahead=True)
    assert not _readers()


def test_a_failing_target_stops_the_reader(model_parallel: None, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer fails half-way (here: finding the second tensor in its record): the error comes out (in torch's
    CheckpointException, a BaseException), the thread ends."""
    _save(tmp_path / "ckpt", ours=True)
    monkeypatch.setattr(checkpoint_reader, "AHEAD_BYTES", 1)  # the thread is waiting for room when the copy fails
    loads = []
    real = checkpoint_reader.saved_tensor

    def failing(record: torch.Tensor) -> torch.Tensor:
        loads.append(1)
        if len(loads) == 2:
            raise RuntimeError("the target's copy failed")
        return real(record)

    monkeypatch.setattr(checkpoint_reader, "saved_tensor", failing)
    with pytest.raises(BaseException, match="the target's copy failed"):
        _load(tmp_path / "ckpt", ahead=True)
    assert not _readers()


def test_the_reader_unpickles_metadata_through_the_restricted_unpickler(model_parallel: None, tmp_path: Path) -> None:
    """A .metadata replaced after the start's check (or never checked) is refused by the load's own reader: what
    torch's reader would unpickle, running its code, never runs."""
    import pickle

    _save(tmp_path / "ckpt", ours=True)
    assert _load(tmp_path / "ckpt", ahead=True)["iteration"] == 7  # a real one loads through it
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Evil(tmp_path / "ran")))
    for reader in (checkpoint_reader.RestrictedReader, ReadAheadReader):
        with pytest.raises(checkpoint_reader.MetadataRefused, match="refusing to load class"):
            reader(str(tmp_path / "ckpt")).read_metadata()
    with pytest.raises(BaseException, match="refusing to load class") as e:
        _load(tmp_path / "ckpt", ahead=True)
    assert "metadata is None" not in str(e.value)  # not DCP's own message after it swallowed the refusal
    assert not (tmp_path / "ran").exists()
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    with pytest.raises(checkpoint_reader.MetadataRefused, match="refusing to load class"), read_ahead():
        TorchDistLoadShardedStrategy().load_sharded_metadata(tmp_path / "ckpt")  # Megatron-Core reads it directly
    assert not (tmp_path / "ran").exists()


def test_common_state_reads_what_megatron_core_reads(model_parallel: None, tmp_path: Path) -> None:
    """checkpoint_reader.common_state against dist_checkpointing.load_common_state_dict (which unpickles without
    restriction) on our checkpoint, with a nested common state, and on Megatron-Core's own (the fixtures)."""
    import tarfile

    from megatron.core import dist_checkpointing

    state = {**_state(), "scheduler": {"num_steps": 56, "max_lr": 3e-4, "decay_style": "cosine"}}
    _save(tmp_path / "ours", ours=True, state=state)
    got = checkpoint_reader.common_state(tmp_path / "ours")
    assert got == {"iteration": 7, "scheduler": state["scheduler"]}
    assert got == dist_checkpointing.load_common_state_dict(str(tmp_path / "ours"))
    if not FIXTURES.is_file():  # shared/ fixtures live beside the repository, not in a clone elsewhere
        return
    with tarfile.open(FIXTURES) as tar:
        tar.extractall(tmp_path / "megatron", filter="data")
    folders = [m.parent for m in (tmp_path / "megatron").rglob(".metadata")]
    assert folders
    for folder in folders:
        assert checkpoint_reader.common_state(folder) == dist_checkpointing.load_common_state_dict(str(folder))


def test_a_common_state_that_would_run_code_is_refused_by_every_load(model_parallel: None, tmp_path: Path) -> None:
    """A common state that calls os.system when unpickled: Megatron-Core's own load_common_state_dict would run it
    (DCP's default planner unpickles byte records with weights_only=False); checkpoint.read, the loads of training,
    refuses it in one line and nothing runs."""
    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    _save(tmp_path / "iter_0000005", ours=True, state={**_state(), "evil": Evil(tmp_path / "ran")})
    with pytest.raises(ConfigError, match=r"record common_state/shard_0_1 asks to run posix\.system") as e:
        checkpoint.read(_zeroed(), tmp_path / "iter_0000005")
    assert "\n" not in str(e.value) and not (tmp_path / "ran").exists()
    with pytest.raises(ConfigError, match="asks to run posix.system"):
        checkpoint_reader.common_state(tmp_path / "iter_0000005")
    assert not (tmp_path / "ran").exists()


def test_a_bytes_record_replaced_after_the_start_check_is_refused_by_the_load(model_parallel: None, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The start's check (checked_records) passes; the record is then replaced by one that calls os.system (the same
    length, as a copy in place could); the load checks the bytes it read before the planner unpickles them (with
    weights_only=False): one line, nothing runs. Here the replacement is simulated at the read."""
    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    path = _with_record(tmp_path / "iter_0000005", {"fine": 1})
    checkpoint_reader.checked_records(path, checkpoint_reader.checked_metadata(path))
    evil = _record(Evil(tmp_path / "ran")).numpy().tobytes()
    real = checkpoint_reader.read_exactly

    def swapped(fd: int, length: int, offset: int, name: str) -> torch.Tensor:
        got = real(fd, length, offset, name)
        if threading.current_thread().name == "mcorekit-read-ahead" and \
                b"fine" in got.numpy().tobytes():
            return torch.frombuffer(bytearray(evil), dtype=torch.uint8)
        return got

    monkeypatch.setattr(checkpoint_reader, "read_exactly", swapped)
    state = _zeroed()
    from megatron.core.dist_checkpointing import ShardedObject

    state["layer._extra_state"] = ShardedObject("layer._extra_state", None, (1,), (0,), replica_id=0)
    with pytest.raises(ConfigError, match=r"record layer\._extra_state.* asks to run posix\.system") as e:
        checkpoint.read(state, path)
    assert "\n" not in str(e.value) and not (tmp_path / "ran").exists()


def test_a_legacy_common_pt_is_read_weights_only(model_parallel: None, tmp_path: Path) -> None:
    """Older Megatron-Core wrote the common state to common.pt (torch.load'ed weights-only there as well)."""
    from mcorekit.errors import ConfigError

    (tmp_path / "old").mkdir()
    torch.save({"iteration": 3, "args": None}, tmp_path / "old" / "common.pt")
    assert checkpoint_reader.common_state(tmp_path / "old") == {"iteration": 3, "args": None}
    torch.save({"x": Evil(tmp_path / "ran")}, tmp_path / "old" / "common.pt")
    with pytest.raises(ConfigError, match="common.pt asks to run posix.system"):
        checkpoint_reader.common_state(tmp_path / "old")
    assert not (tmp_path / "ran").exists()


def test_checked_metadata_passes_a_real_checkpoint(model_parallel: None, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    _save(tmp_path / "ckpt", ours=True)
    md = checkpoint_reader.checked_metadata(tmp_path / "ckpt")
    assert "w.bf16" in md.state_dict_metadata
    assert any(isinstance(m, BytesStorageMetadata) for m in md.state_dict_metadata.values())


def test_a_crafted_metadata_file_is_refused_before_any_loader_reads_it(model_parallel: None, tmp_path: Path) -> None:
    """torch's and Megatron-Core's loaders unpickle .metadata without restriction: training's loads (train/
    checkpoint.read, load, load_fsdp_weights; build's MTP check) run checked_metadata first."""
    import pickle

    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    _save(tmp_path / "ckpt", ours=True)
    marker = tmp_path / "MARKER"
    with open(tmp_path / "ckpt" / ".metadata", "rb") as f:
        md = checkpoint_reader.MetadataUnpickler(f).load()
    md.planner_data = Evil(marker)
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ConfigError, match="refusing to load class posix.system"):
        checkpoint.read(_zeroed(), tmp_path / "ckpt")
    assert not marker.exists()


def _gpt(layers: int = 2, hidden: int = 64, qk_layernorm: bool = False) -> Any:
    from mcorekit.models.megatron import build_gpt, transformer_config
    from mcorekit.models.spec import ModelSpec

    spec = ModelSpec("llama", layers, hidden, 4, 2, 16, 128, 256, qk_layernorm=qk_layernorm)
    return build_gpt(spec, transformer_config(spec, cpu_init=True), 256, use_te=False)


@pytest.mark.parametrize("other, expected", [
    (dict(layers=3), r"linear_proj.weight is \[2, 64, 64\] in it, \[3, 64, 64\] here;.*\(and 2 more\); it was saved "
                     r"with other model settings"),
    (dict(hidden=96), r"linear_qkv.weight is \[2, 128, 64\] in it, \[2, 128, 96\] here"),
    (dict(qk_layernorm=True), r"q_layernorm.weight is not in it; decoder.layers.self_attention.k_layernorm.weight is "
                              r"not in it; it was saved"),
])
def test_a_checkpoint_of_another_model_shape_is_one_line_before_anything_is_read(
        model_parallel: None, tmp_path: Path, other: dict, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume or checkpoint.load of another model's checkpoint: Megatron-Core's planner raised a traceback, one
    tensor at a time; checkpoint.read names the tensors that differ first, one line, and reads nothing."""
    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    torch.manual_seed(0)
    saved = _gpt()
    path = tmp_path / "iter_0000010"
    _save(path, ours=True, state=checkpoint._model_state([saved]))
    same = checkpoint.read(checkpoint._model_state([_gpt()]), path)
    weights = {k: v for k, v in saved.state_dict().items() if torch.is_tensor(v) and "extra" not in k}
    assert all(torch.equal(same[k], v) for k, v in weights.items())
    monkeypatch.setattr(checkpoint_reader, "ReadAheadReader", None)  # reading anything now fails the test
    with pytest.raises(ConfigError, match=f"^checkpoint {path} does not fit this model: .*{expected}"):
        checkpoint.read(checkpoint._model_state([_gpt(**other)]), path)


def test_a_damaged_record_is_one_line_on_a_resume(model_parallel: None, tmp_path: Path) -> None:
    """checkpoint.read (every training load): torch's CheckpointException, a BaseException with each rank's
    traceback in its text, becomes one error line naming the checkpoint and what to do."""
    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    _save(tmp_path / "iter_0000005", ours=True)
    data = next((tmp_path / "iter_0000005").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ConfigError, match=r"^checkpoint .*iter_0000005 could not be read: .*a truncated file.*resume "
                                          r"from an earlier one by setting its step in .*latest_checkpointed") as e:
        checkpoint.read(_zeroed(), tmp_path / "iter_0000005")
    assert "\n" not in str(e.value)
    assert not _readers()


# ------------------------------------------------------- the records of a checkpoint from elsewhere (checked_records)

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "megatron-written-torch_dist.tgz"


def _with_record(path: Path, data: Any) -> Path:
    """A checkpoint written by the Saver's writer with one more bytes record, `data` (pickled as torch.save does)."""
    from megatron.core.dist_checkpointing import ShardedObject

    state = _state()
    state["layer._extra_state"] = ShardedObject("layer._extra_state", data, (1,), (0,), replica_id=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(path, ours=True, state=state)
    return path


@pytest.fixture
def te_recipe(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A stand-in for TE's recipe module (TE is not installed on this machine): a dataclass and an enum under
    transformer_engine.common.recipe, as TE's DelayedScaling and Format are; in sys.modules for this test only (a
    package without a spec left there breaks other libraries' find_spec("transformer_engine"))."""
    import dataclasses
    import enum
    import sys
    import types

    name = "transformer_engine.common.recipe"
    mod = types.ModuleType(name)

    class Format(enum.Enum):
        E4M3, HYBRID = "e4m3", "hybrid"

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024

    for cls in (Format, DelayedScaling):
        cls.__module__, cls.__qualname__ = name, cls.__name__
        setattr(mod, cls.__name__, cls)
    for module in ("transformer_engine", "transformer_engine.common", name):
        assert module not in sys.modules, "TE is installed here: use it, not this stand-in"
        monkeypatch.setitem(sys.modules, module, mod if module == name else types.ModuleType(module))
    return mod


def _te_extra_state(payload: dict) -> list:
    """TE's extra state as Megatron-Core saves it: a list holding a uint8 tensor of a plain pickle."""
    import pickle

    return [torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)]


def test_records_of_checkpoints_megatron_and_we_write_pass(model_parallel: None, tmp_path: Path,
                                                           te_recipe: Any) -> None:
    """What real checkpoints hold passes: Megatron-Core's own (the shared fixtures: TE's empty extra states, the
    common state), the Saver's, an FP8 extra state of TE's shape (tensors, the recipe's dataclass and enum), a
    Megatron-LM `args` namespace with a Megatron-Core enum and numpy's RNG state."""
    import argparse
    import tarfile

    import numpy as np
    from megatron.core.enums import ModelType

    from mcorekit.train.checkpoint_reader import checked_records

    recipe = te_recipe
    paths = [_with_record(tmp_path / "fp8", _te_extra_state({
        "recipe": recipe.DelayedScaling(), "scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(16, 3),
        "extra_fp8_variables": {"num_gemms": 3, "names": ["a", 1.5], "t": (1,)}})),
        _with_record(tmp_path / "args", {"args": argparse.Namespace(model_type=ModelType.encoder_or_decoder,
                                                                    params_dtype=torch.bfloat16),
                                         "rng": np.random.get_state(), "buffer": io.BytesIO(b"x")})]
    if FIXTURES.is_file():
        with tarfile.open(FIXTURES) as tar:
            tar.extractall(tmp_path / "fixtures", filter="data")
        paths += sorted((tmp_path / "fixtures").glob("*/mcore/iter_*"))
    for path in paths:
        checked_records(path, checkpoint_reader.checked_metadata(path))
    assert len(paths) == 2 + 5 * FIXTURES.is_file()


@pytest.mark.parametrize("where", ["record", "extra state", "extra state's tensor", "extra state as int8"])
def test_a_record_that_would_run_code_is_refused_before_any_loader_reads_it(
        model_parallel: None, tmp_path: Path, where: str, te_recipe: Any) -> None:
    """A crafted bytes record (torch's and Megatron-Core's loaders unpickle them without restriction) or TE extra
    state (TE unpickles it with pickle.loads; a tensor inside it unpickles its storage with torch.load unrestricted):
    a run whose checkpoint.load names such a checkpoint stops at its start with one line naming the call, before
    the model is built or any loader reads it, and nothing of it runs."""
    import pickle

    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    marker = tmp_path / "MARKER"

    class EvilStorageTensor:  # a tensor whose storage bytes are a pickle that calls os.system
        def __reduce__(self) -> tuple:
            return torch._utils._rebuild_tensor_v2, (_evil_storage(marker), 0, (1,), (1,), False, {})

    data = {"record": lambda: [Evil(marker)],
            "extra state": lambda: _te_extra_state({"recipe": Evil(marker)}),
            "extra state's tensor": lambda: [torch.frombuffer(bytearray(pickle.dumps(
                {"scale_fwd": EvilStorageTensor()})), dtype=torch.uint8)],
            "extra state as int8": lambda: [t.view(torch.int8) for t in _te_extra_state({"recipe": Evil(marker)})],
            }[where]()
    iter_dir = _with_record(tmp_path / "base" / "iter_0000003", data)
    (tmp_path / "base" / "latest_checkpointed_iteration.txt").write_text("3")
    refused = rf"^checkpoint {iter_dir}: record layer._extra_state.* asks to run posix.system when it is unpickled: "
    with pytest.raises(ConfigError, match=refused + "refusing to load it .*mcorekit convert"):
        checkpoint.pinned_sources(_experiment(load=tmp_path / "base"))
    assert not marker.exists()
    if where == "record":  # what the check stops: Megatron-Core's own load of the record runs the call
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedObject

        state = _zeroed()
        state["layer._extra_state"] = ShardedObject("layer._extra_state", None, (1,), (0,), replica_id=0)
        dist_checkpointing.load(state, str(iter_dir))
        assert marker.exists()


class _EvilStorage:
    """Pickles as a tensor storage whose bytes are a pickle that calls os.system (the function that unpickles a
    storage is the one torch.storage names at pickling time: Megatron-Core's weights-only one once it is imported)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        import torch.storage

        payload = io.BytesIO()
        torch.save(Evil(self.marker), payload)
        return torch.storage._load_from_bytes, (payload.getvalue(),)


def _evil_storage(marker: Path) -> _EvilStorage:
    return _EvilStorage(marker)


def _experiment(load: Path, adapters: Path | None = None) -> Any:
    from mcorekit.config.experiment import Experiment

    lora = {"peft": {"lora": {"rank": 4, "load": str(adapters)}}} if adapters else {}
    return Experiment.model_validate({"name": "x", "model": {"preset": "llama-tiny"},
                                      "checkpoint": {"load": str(load), "finetune": True}, **lora})


def test_lora_json_names_the_pinned_base_iteration_absolute(model_parallel: None, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA run started with a relative checkpoint.load records the iteration it trained on as an absolute path:
    a merge (convert/lora.py) reads it from wherever it runs, and the base's newer iterations are not it."""
    from mcorekit.config.experiment import Experiment
    from mcorekit.models.spec import resolve
    from mcorekit.train import checkpoint
    from mcorekit.train.build import lora_info

    _with_record(tmp_path / "base" / "iter_0000003", _te_extra_state({"scale": 1.0}))
    (tmp_path / "base" / "latest_checkpointed_iteration.txt").write_text("3")
    monkeypatch.chdir(tmp_path)
    exp = Experiment.model_validate({"name": "x", "model": {"preset": "llama-tiny"}, "peft": {"lora": {"rank": 4}},
                                     "checkpoint": {"load": "base"}})
    info = lora_info(checkpoint.pinned_sources(exp), resolve("llama-tiny", None, {}))
    assert info["base"] == str(tmp_path / "base" / "iter_0000003") and info["rank"] == 4


def test_a_start_reads_the_iterations_it_checked(model_parallel: None, tmp_path: Path) -> None:
    """checkpoint.load and peft.lora.load are pinned to the iterations checked at the start: a newer, crafted
    iteration their runs save afterwards (the DPO reference is read at the first step, long after the check) is
    not what the start reads; a start after it checks, and refuses, the new one."""
    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    marker = tmp_path / "MARKER"
    base, adapters = tmp_path / "base", tmp_path / "adapters"
    for root in (base, adapters):
        _with_record(root / "iter_0000003", _te_extra_state({"scale": 1.0}))
        (root / "latest_checkpointed_iteration.txt").write_text("3")
    exp = _experiment(base, adapters)
    pinned = checkpoint.pinned_sources(exp)
    assert (pinned.checkpoint.load, pinned.peft.lora.load) == (str(base / "iter_0000003"),
                                                                str(adapters / "iter_0000003"))
    assert (exp.checkpoint.load, exp.peft.lora.load) == (str(base), str(adapters))  # the given exp is unchanged
    assert pinned.peft.lora.rank == 4 and pinned.checkpoint.finetune

    for root in (base, adapters):
        _with_record(root / "iter_0000004", [Evil(marker)])
        (root / "latest_checkpointed_iteration.txt").write_text("4")
    assert checkpoint.start_of(pinned.checkpoint.load) == base / "iter_0000003"
    assert checkpoint.start_of(pinned.peft.lora.load) == adapters / "iter_0000003"
    with pytest.raises(ConfigError, match=rf"^checkpoint {base / 'iter_0000004'}: record .* asks to run posix.system"):
        checkpoint.pinned_sources(exp)
    assert not marker.exists()


def test_a_resumed_run_keeps_the_iterations_its_first_start_pinned(model_parallel: None, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A LoRA base and a DPO or GRPO reference are read again at every start: a run that resumes from its own
    checkpoint reads the iterations its first start pinned (sources.json in its checkpoints folder), not a newer
    one its base's run saved meanwhile; checked again; one that is gone is a warning naming it. A start without a
    checkpoint of its own pins anew."""
    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    base, run = tmp_path / "base", tmp_path / "run" / "checkpoints"
    _with_record(base / "iter_0000003", _te_extra_state({"scale": 1.0}))
    (base / "latest_checkpointed_iteration.txt").write_text("3")
    exp = _experiment(base)
    assert checkpoint.pinned_sources(exp, run).checkpoint.load == str(base / "iter_0000003")
    record = json.loads((run / "sources.json").read_text())
    assert (record["given"], record["pinned"]) == ([str(base), None], [str(base / "iter_0000003"), None])

    _with_record(base / "iter_0000004", _te_extra_state({"scale": 2.0}))  # the base's run goes on
    (base / "latest_checkpointed_iteration.txt").write_text("4")
    own = run / "iter_0000002"  # this run's own checkpoint: the next start is a resume
    own.mkdir()
    (own / "metadata.json").write_text("{}")
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    assert checkpoint.pinned_sources(exp, run).checkpoint.load == str(base / "iter_0000003")

    marker = tmp_path / "MARKER"  # the kept iteration is checked at each start, as a newly pinned one is
    shutil.rmtree(base / "iter_0000003")
    _with_record(base / "iter_0000003", [Evil(marker)])
    with pytest.raises(ConfigError, match=rf"^checkpoint {base / 'iter_0000003'}: record .* asks to run posix.system"):
        checkpoint.pinned_sources(exp, run)
    assert not marker.exists()

    shutil.rmtree(base / "iter_0000003")  # pruned by its run's keep_last
    with caplog.at_level(logging.WARNING, logger="mcorekit.train"):
        assert checkpoint.pinned_sources(exp, run).checkpoint.load == str(base / "iter_0000003")
    assert f"this run started from checkpoint.load={base / 'iter_0000003'}, which is gone" in caplog.text

    shutil.rmtree(own)  # no checkpoint of its own: a new start pins the base's latest and records it
    (run / "latest_checkpointed_iteration.txt").unlink()
    assert checkpoint.pinned_sources(exp, run).checkpoint.load == str(base / "iter_0000004")
    assert json.loads((run / "sources.json").read_text())["pinned"] == [str(base / "iter_0000004"), None]


class _StatefulLayer(torch.nn.Module):
    """Records, when its extra state is set, what TE reads to decide whether it may unpickle one (TE is not installed
    here): TE 2.18 on refuses a delayed-scaling FP8 state unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.seen: list[str | None] = []

    def get_extra_state(self) -> Any:
        return _te_extra_state({"scale_fwd": torch.ones(1)})[0]

    def set_extra_state(self, state: Any) -> None:
        self.seen.append(os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"))


@pytest.mark.parametrize("before", [None, "0"])
def test_te_may_unpickle_the_checked_extra_states_while_a_model_loads_and_then_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: str | None) -> None:
    """Every load of model weights (a resume, checkpoint.load, a LoRA base, the DPO reference) runs after the
    checkpoint's records were checked, so TE may unpickle its FP8 extra states there: without it an FP8 (delayed)
    run could neither resume nor start another (the GPU run of 2026-12-05). Outside the load, the variable is
    what it was."""
    from mcorekit.train import checkpoint

    if before is None:
        monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    else:
        monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", before)
    model = torch.nn.Sequential(_StatefulLayer())
    state = model.state_dict()
    for part in (checkpoint.ALL, checkpoint.BASE):
        checkpoint._load_part(model, state, part)
    assert model[0].seen == ["1", "1"]
    assert os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE") == before


def test_a_resume_that_reads_its_base_again_refuses_one_saved_again_in_place_or_gone(model_parallel: None,
                                                                                     tmp_path: Path) -> None:
    """A LoRA run reads its base at every start: the iteration its first start pinned, saved again in place since (its
    run's tracker reset, a release converted again) or gone, is a refusal naming it; a plain fine-tune resumes from
    its own checkpoint without reading it (test_a_resumed_run_keeps_the_iterations_its_first_start_pinned)."""
    from mcorekit.config.experiment import Experiment
    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    base, run = tmp_path / "base", tmp_path / "run" / "checkpoints"
    _with_record(base / "iter_0000003", _te_extra_state({"scale": 1.0}))
    (base / "latest_checkpointed_iteration.txt").write_text("3")
    lora = Experiment.model_validate({"name": "x", "model": {"preset": "llama-tiny"}, "peft": {"lora": {"rank": 4}},
                                      "checkpoint": {"load": str(base), "finetune": True}})
    checkpoint.pinned_sources(lora, run)
    (run / "iter_0000002").mkdir()
    (run / "iter_0000002" / "metadata.json").write_text("{}")
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    assert checkpoint.pinned_sources(lora, run).checkpoint.load == str(base / "iter_0000003")
    shutil.rmtree(base / "iter_0000003")
    _with_record(base / "iter_0000003", _te_extra_state({"scale": 3.0}))  # other weights, same iteration
    with pytest.raises(ConfigError, match=rf"^this run started from checkpoint.load={base / 'iter_0000003'}, which was "
                                          rf"saved again in place since \(its metadata files changed\): a resume "
                                          rf"reads it again"):
        checkpoint.pinned_sources(lora, run)
    shutil.rmtree(base / "iter_0000003")
    with pytest.raises(ConfigError, match=r"which is gone: a resume reads it again"):
        checkpoint.pinned_sources(lora, run)


def test_a_base_read_at_every_start_is_pinned_for_the_run_and_released_at_its_end(model_parallel: None,
                                                                                  tmp_path: Path) -> None:
    """A LoRA run's start marks the iteration it pinned in its base's folder (prune keeps it: test_checkpoint_prune),
    its resumes mark it again, and its end takes the mark back; a plain fine-tune, which reads it once, marks
    nothing."""
    from mcorekit.config.experiment import Experiment
    from mcorekit.train import checkpoint

    base, run = tmp_path / "base", tmp_path / "run" / "checkpoints"
    _with_record(base / "iter_0000003", _te_extra_state({"scale": 1.0}))
    (base / "latest_checkpointed_iteration.txt").write_text("3")
    settings = {"name": "x", "model": {"preset": "llama-tiny"}, "checkpoint": {"load": str(base), "finetune": True}}
    lora = Experiment.model_validate({**settings, "peft": {"lora": {"rank": 4}}})
    pinned = checkpoint.pinned_sources(lora, run)
    marks = list((base / checkpoint.PINS).iterdir())
    assert [m.name.split(".")[0] for m in marks] == ["iter_0000003"] and marks[0].read_text() == f"{run}\n"
    marks[0].unlink()  # removed by hand: the next start marks it again
    (run / "iter_0000002").mkdir()
    (run / "iter_0000002" / "metadata.json").write_text("{}")
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    checkpoint.pinned_sources(lora, run)
    assert [m.name for m in (base / checkpoint.PINS).iterdir()] == [marks[0].name]
    checkpoint.release_sources(pinned, run)
    assert list((base / checkpoint.PINS).iterdir()) == []
    checkpoint.pinned_sources(Experiment.model_validate(settings), tmp_path / "finetune" / "checkpoints")
    assert list((base / checkpoint.PINS).iterdir()) == []


def test_a_checkpoint_folder_is_taken_as_it_is_and_a_folder_without_one_is_refused(model_parallel: None,
                                                                                      tmp_path: Path) -> None:
    """An iteration or release folder is the checkpoint, even with a checkpoints folder inside it (which was not
    checked); a start from a folder that is gone or holds no checkpoint yet stops in one line, instead of reading
    whatever is saved there by the time it reads (the DPO reference at the first step)."""
    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    release = _with_record(tmp_path / "conv" / "release", _te_extra_state({"scale": 1.0}))
    _with_record(release / "iter_0000001", _te_extra_state({"scale": 2.0}))
    (release / "latest_checkpointed_iteration.txt").write_text("1")
    assert checkpoint.pinned_sources(_experiment(release)).checkpoint.load == str(release)
    assert checkpoint.start_of(release) == release
    (tmp_path / "empty").mkdir()
    for given, state in ((tmp_path / "gone", "does not exist"), (tmp_path / "empty", "holds no complete checkpoint")):
        with pytest.raises(ConfigError, match=rf"^checkpoint.load={given} {state} \(an iter_N or release folder"):
            checkpoint.pinned_sources(_experiment(given))


def test_a_crafted_common_pt_is_refused_in_one_line(model_parallel: None, tmp_path: Path) -> None:
    """common.pt, where older Megatron-Core wrote the common state: checked as the records are, in checkpoint.load
    and in the run's own folder at a resume (a run folder can be copied from elsewhere)."""
    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    marker = tmp_path / "MARKER"
    iter_dir = _with_record(tmp_path / "base" / "iter_0000001", _te_extra_state({"scale": 1.0}))
    exp = _experiment(iter_dir)
    torch.save({"args": [1, 2], "rng": torch.zeros(2)}, iter_dir / "common.pt")
    assert checkpoint.pinned_sources(exp).checkpoint.load == str(iter_dir)
    checkpoint.checked_resume(iter_dir)
    torch.save({"args": Evil(marker)}, iter_dir / "common.pt")
    for check in (lambda: checkpoint.pinned_sources(exp), lambda: checkpoint.checked_resume(iter_dir)):
        with pytest.raises(ConfigError, match=rf"^checkpoint {iter_dir}: common.pt asks to run posix.system when "):
            check()
    assert not marker.exists()


def test_the_grpo_examples_evaluation_starts_from_the_checkpoint_it_evaluates(model_parallel: None, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/grpo/evaluate.py builds the model from grpo.yaml, whose checkpoint.load names the SFT run: where that
    run's folder does not exist (a checkpoint evaluated elsewhere, the GPU test's folders), the start refused it
    (what failed test_grpo_example_raises_held_out_accuracy on one H100 at 6db32bb). The evaluated checkpoint is the
    start's source instead, pinned and checked as any."""
    import importlib.util

    from mcorekit.config.experiment import load_experiment
    from mcorekit.errors import ConfigError
    from mcorekit.train import checkpoint

    script = Path(__file__).resolve().parents[1] / "examples" / "grpo" / "evaluate.py"
    spec = importlib.util.spec_from_file_location("grpo_evaluate", script)
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    monkeypatch.chdir(tmp_path)  # runs/grpo-example/sft/checkpoints (grpo.yaml's checkpoint.load) is not here
    exp = load_experiment(str(script.parent / "grpo.yaml"), [])
    with pytest.raises(ConfigError, match="checkpoint.load=runs/grpo-example/sft/checkpoints does not exist"):
        checkpoint.pinned_sources(exp)
    grpo = tmp_path / "grpo" / "checkpoints"
    _with_record(grpo / "iter_0000060", _te_extra_state({"scale": 1.0}))
    (grpo / "latest_checkpointed_iteration.txt").write_text("60")
    pinned = checkpoint.pinned_sources(evaluate.evaluating(exp, grpo / "iter_0000060"))
    assert pinned.checkpoint.load == str(grpo / "iter_0000060") and pinned.checkpoint.finetune


def test_load_probe_times_every_record_of_a_checkpoint(model_parallel: None, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """bench/load_probe.py (where a resume's host time goes) runs on a real torch_dist checkpoint and accounts for
    each of its records' bytes; its figures are for the GPU machine's disk, not asserted here."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import load_probe
    from torch.distributed.checkpoint import FileSystemReader

    _save(tmp_path / "ckpt", ours=True)
    assert load_probe.main([str(tmp_path / "ckpt")]) == 0
    got = json.loads(capsys.readouterr().out.split("RESULT ", 1)[1])
    info = FileSystemReader(str(tmp_path / "ckpt"))
    info.set_up_storage_reader(info.read_metadata(), True)
    assert got["records"] == len(info.storage_data) > 0
    assert got["bytes"] == sum(r.length for r in info.storage_data.values())  # every record's bytes, once


def test_record_check_probe_writes_and_checks_its_records(model_parallel: None, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """bench/record_check_probe.py (what the record check costs with many TE extra states) writes a checkpoint of
    that many extra-state records, which the check passes, and removes it; its timings are not asserted."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import record_check_probe

    assert record_check_probe.main(["--records", "40", "--out", str(tmp_path)]) == 0
    got = json.loads(capsys.readouterr().out.split("RESULT ", 1)[1])
    assert got["warm"]["extra_states"] == 40 and got["warm"]["bytes_records"] >= 40  # what the check read
    assert not (tmp_path / "ckpt").exists()
