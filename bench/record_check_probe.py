"""What the record check costs at scale (train/checkpoint_reader.checked_records, run by rank 0 at every start from
a checkpoint while the other ranks wait): a torch_dist checkpoint holding N TE-style extra-state records (a uint8
tensor of a pickle each, as Megatron-Core saves TE's FP8 states: one per expert's layer in a large MoE model),
written on CPU through the training Saver's writer, then its .metadata and records checked, with the page cache warm
and then dropped (as root).

    python bench/record_check_probe.py [--records 20000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def write(path: Path, records: int) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    from mcorekit.outputs import without_crc32
    from mcorekit.train.checkpoint_writer import results_queue, save_strategy, stage_per_tensor

    payload = bytearray(pickle.dumps({"scale": [1.0], "amax_history": [0.0] * 16, "recipe": "delayed"}))
    state: dict = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 64), replica_id=0)}
    for i in range(records):
        key = f"decoder.layers.{i // 256}.mlp.experts.{i % 256}._extra_state"
        state[key] = ShardedObject(key, [torch.frombuffer(payload, dtype=torch.uint8)], (1,), (0,), replica_id=0)
    path.mkdir(parents=True)
    current = torch.cuda.current_device
    if not torch.cuda.is_available():  # Megatron-Core's finalize broadcasts its failure flag from the current device
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        with without_crc32(), results_queue():
            request = dist_checkpointing.save(state, str(path), sharded_strategy=save_strategy(),
                                              async_sharded_save=True, async_strategy="mcore")
            with stage_per_tensor(request) as staged:
                staged.execute_sync()
    finally:
        torch.cuda.current_device = current  # type: ignore[assignment]


def check(path: Path, drop_cache: bool) -> dict[str, float | int]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from mcorekit.train.checkpoint_reader import checked_metadata, checked_records

    if drop_cache:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    start = time.perf_counter()
    metadata = checked_metadata(path)
    read = time.perf_counter()
    checked_records(path, metadata)
    checked = time.perf_counter()
    records = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    return {"metadata_s": round(read - start, 3), "records_s": round(checked - read, 3), "bytes_records": len(records),
            "extra_states": sum("._extra_state" in k for k in records)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=20000)
    p.add_argument("--out", default=None, help="where the checkpoint is written (default: a temporary folder)")
    a = p.parse_args(argv)
    from megatron.core import parallel_state as ps

    work = Path(a.out or tempfile.mkdtemp(prefix="mcorekit-records-"))
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    ckpt = work / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    try:
        write(ckpt, a.records)
        got = {"records": a.records, "warm": check(ckpt, False)}
        try:
            got["cold"] = check(ckpt, True)
        except OSError:  # dropping the page cache needs root
            pass
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    for label in ("warm", "cold"):
        if label in got:
            s = got[label]
            print(f"{label}: .metadata {s['metadata_s']} s, {a.records} records {s['records_s']} s "
                  f"({s['records_s'] / max(a.records, 1) * 1e6:.0f} us each)")
    print("RESULT " + json.dumps(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
