"""How fast one GPU writes and reads a checkpoint, lever by lever (issue "Speed", part 3), next to the disk's own
speed.

    python bench/save_levers.py [--gb 36] [--levers megatron,nocrc,per-tensor,defaults] [--dd-gb 8] [--out DIR]
                                [--load-levers torch,read-ahead --load-repeats 2]
    python bench/save_levers.py --device cpu --gb 6 --levers no-writeback,defaults   # the writer alone, no GPU

The state: bf16 weights and their fp32 main copies and two Adam moments, shaped as the llama-3b preset's layers
(2.6B parameters, ~36 GB with --gb 36), random, on the GPU, written by Megatron-Core's torch_dist writer through
`dist_checkpointing.save` as train/checkpoint.Saver calls it, one lever changed at a time:
  megatron     Megatron-Core's writer as it comes: every tensor staged in pinned host memory first, then written
               with torch.save's CRC-32 of every record
  nocrc        the same without CRC-32s (mcorekit.outputs.without_crc32)
  per-tensor   each tensor copied to host memory by the writer just before it is written (stage_per_tensor)
  no-writeback both, the disk left to write at the kernel's pace and at the closing fsync
  no-ahead     both, what is written handed to the kernel's writeback every 32 MiB, each tensor copied to pageable
               host memory when the writer asks for it (the defaults from 83cb09a until copies ran ahead)
  defaults     the same with each tensor's copy into pinned memory started while the writer writes the tensor
               before it (train/checkpoint_writer.copied_ahead; what a synchronous save of mcorekit does)
  defaults-2t  the defaults with two writer threads and two files (Megatron-Core 0.19.2 writes its last bucket on
               the calling thread before it starts the others, so this measures two files more than two writers)
Load levers (--load-levers, after the save levers): the state saved once more with the defaults, then loaded
into zeroed tensors of the same shapes and device by `dist_checkpointing.load`, the checkpoint's pages dropped from
the page cache before each load (so it reads the disk), the levers alternated --load-repeats times:
  torch        torch's FileSystemReader as Megatron-Core builds it (each record read when the loader reaches it)
  read-ahead   train/checkpoint_reader.ReadAheadReader (records read in file order on a thread, up to 2 GiB ahead,
               each tensor copied from where its record was read; what a resume of mcorekit reads with)
  read-ahead-torch-load  the same reader deserializing each tensor record with torch.load (weights_only), which
               copies it out of the bytes read: the reader before 38af619
With --device cpu the state lies in host memory and one gloo rank writes it: the staging is then no copy, and
only the levers staged per tensor run (Megatron-Core's own staging needs CUDA).
Each save's seconds include the writer's fsync; `release_s` is how long torch then takes to hand its cached pinned
host memory back (what a process pays at exit). The folder is deleted after each save; one checkpoint at a time.
Prints a Markdown table and writes results.json (after every lever).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

from results import fresh_dir
from start_save import dd_speed, drop_page_cache

LEVERS = {  # name: (CRC-32s, staged per tensor, writer threads, writeback every 32 MiB, copies ahead)
    "megatron": (True, False, 1, False, False),
    "nocrc": (False, False, 1, False, False),
    "per-tensor": (True, True, 1, False, True),
    "no-writeback": (False, True, 1, False, True),
    "no-ahead": (False, True, 1, True, False),
    "defaults": (False, True, 1, True, True),
    "defaults-2t": (False, True, 2, True, True),
}


def copied_when_asked(tensors: list[Any]) -> Iterator[Any]:
    """The no-ahead lever's stand-in for checkpoint_writer.copied_ahead: each tensor copied when the writer asks for
    it."""
    for item, tensor in tensors:
        yield item, tensor.to("cpu")


def layer_shapes(hidden: int = 3072, ffn: int = 8192, heads: int = 24, groups: int = 8, head_dim: int = 128,
                 vocab: int = 32768, layers: int = 24) -> list[tuple[str, tuple[int, ...]]]:
    """The llama-3b preset's parameters (models/spec.py), one entry per layer and matrix."""
    qkv = (heads + 2 * groups) * head_dim
    shapes = [("embedding.word_embeddings.weight", (vocab, hidden)), ("output_layer.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        shapes += [(p + "self_attention.linear_qkv.weight", (qkv, hidden)),
                   (p + "self_attention.linear_proj.weight", (hidden, heads * head_dim)),
                   (p + "mlp.linear_fc1.weight", (2 * ffn, hidden)), (p + "mlp.linear_fc2.weight", (hidden, ffn)),
                   (p + "input_layernorm.weight", (hidden,)), (p + "pre_mlp_layernorm.weight", (hidden,))]
    return shapes


def make_state(gb: float, device: str = "cuda") -> tuple[dict[str, Any], int]:
    """ShardedTensors of weights (bf16), main weights and moments (fp32) on `device`: 14 bytes per parameter,
    layers repeated or cut until about `gb` GB."""
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    state, nbytes, shapes = {}, 0, layer_shapes()
    for rep in range(1000):
        for name, shape in shapes:
            if nbytes >= gb * 1e9:
                return state, nbytes
            for kind, dtype in (("", torch.bfloat16), ("optimizer.param.", torch.float32),
                                ("optimizer.exp_avg.", torch.float32), ("optimizer.exp_avg_sq.", torch.float32)):
                key = f"{kind}r{rep}.{name}"
                t = torch.randn(shape, device=device, dtype=dtype)
                state[key] = ShardedTensor.from_rank_offsets(key, t, replica_id=0)
                nbytes += t.numel() * t.element_size()
    return state, nbytes


def save_once(state: dict[str, Any], path: Path, lever: str, keep: bool = False) -> dict[str, Any]:
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from mcorekit.train import checkpoint_writer as checkpoint

    crc, per_tensor, threads, writeback, ahead = LEVERS[lever]
    path.mkdir(parents=True)
    strategy = TorchDistSaveShardedStrategy(thread_count=threads)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        request = dist_checkpointing.save(state, str(path), sharded_strategy=strategy, async_sharded_save=True,
                                          async_strategy="mcore")
        if per_tensor:
            copies = contextlib.nullcontext() if ahead else mock.patch.object(checkpoint, "copied_ahead",
                                                                              copied_when_asked)
            with copies, checkpoint.stage_per_tensor(request, writeback) as staged:
                staged.execute_sync()
        else:
            request.execute_sync()
    finally:
        torch.serialization.set_crc32_options(before)
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    start = time.perf_counter()
    torch._C._host_emptyCache()
    release = time.perf_counter() - start
    check = _read_back(path, state)
    if not keep:
        shutil.rmtree(path)
    os.sync()
    return {"lever": lever, "crc32": crc, "per_tensor": per_tensor, "threads": threads, "writeback": writeback,
            "ahead": ahead, "seconds": round(seconds, 2),
            "gb": round(size / 1e9, 3), "gb_per_s": round(size / 1e9 / seconds, 3), "release_s": round(release, 2),
            "read_back": check}


LOAD_LEVERS = ("torch", "read-ahead-torch-load", "read-ahead")


def load_once(state: dict[str, Any], path: Path, lever: str) -> dict[str, Any]:
    """`path` (the state, saved) loaded into zeroed tensors like the state's, its page cache dropped first."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from mcorekit.train import checkpoint_reader

    targets = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v.data), replica_id=0) for k, v in state.items()}
    drop_page_cache(path)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    with contextlib.ExitStack() as using:
        if lever.startswith("read-ahead"):
            using.enter_context(checkpoint_reader.read_ahead())
        if lever == "read-ahead-torch-load":
            using.enter_context(mock.patch.object(checkpoint_reader, "saved_tensor", checkpoint_reader.torch_loaded))
        loaded = dist_checkpointing.load(targets, str(path))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    same = all(torch.equal(loaded[k], v.data) for k, v in state.items())
    del loaded, targets
    return {"load_lever": lever, "seconds": round(seconds, 2), "gb": round(size / 1e9, 3),
            "gb_per_s": round(size / 1e9 / seconds, 3), "loaded": "equal" if same else "DIFFERENT"}


def _read_back(path: Path, state: dict[str, Any]) -> str:
    """One tensor read back by convert/'s reader (which never unpickles), compared bitwise."""
    import torch

    from mcorekit.convert.torch_dist import TorchDistReader

    key = next(k for k in state if k.startswith("optimizer.exp_avg."))
    got = TorchDistReader(path).read(key)
    return "equal" if torch.equal(got, state[key].data.cpu()) else "DIFFERENT"


def table(rows: list[dict[str, Any]]) -> str:
    disk = next((r for r in rows if "dd_write_gb_per_s" in r), {})
    lines = [f"disk (dd O_DIRECT): write {disk.get('dd_write_gb_per_s')} GB/s, read {disk.get('dd_read_gb_per_s')} GB/s",
             "", "| lever | CRC-32 | staged | threads | writeback | GB | save s | GB/s | of dd write | pinned release s | "
             "read back |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    staged = {(False, None): "all, pinned", (False, False): "all, pinned", (True, False): "per tensor, when asked",
              (True, True): "per tensor, one ahead, pinned", (True, None): "per tensor"}
    for r in rows:
        if "lever" not in r:
            continue
        if "error" in r:
            lines.append(f"| {r['lever']} | error: {r['error']} ||||||||||")
            continue
        share = f"{100 * r['gb_per_s'] / disk['dd_write_gb_per_s']:.0f}%" if disk else "-"
        lines.append(f"| {r['lever']} | {'on' if r['crc32'] else 'off'} | "
                     f"{staged[r['per_tensor'], r.get('ahead')]} | {r['threads']} | "
                     f"{'32 MiB' if r.get('writeback') else 'off'} | {r['gb']} | "
                     f"{r['seconds']} | {r['gb_per_s']} | {share} | {r['release_s']} | {r['read_back']} |")
    loads = [r for r in rows if "load_lever" in r]
    if loads:
        lines += ["", "| load lever | GB | load s | GB/s | of dd read | loaded |", "|---|---|---|---|---|---|"]
        for r in loads:
            if "error" in r:
                lines.append(f"| {r['load_lever']} | error: {r['error']} |||||")
                continue
            share = f"{100 * r['gb_per_s'] / disk['dd_read_gb_per_s']:.0f}%" if disk else "-"
            lines.append(f"| {r['load_lever']} | {r['gb']} | {r['seconds']} | {r['gb_per_s']} | {share} | "
                         f"{r['loaded']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=36.0, help="checkpoint size, GB")
    p.add_argument("--levers", default=",".join(LEVERS), help=f"comma-separated, of {', '.join(LEVERS)}")
    p.add_argument("--dd-gb", type=int, default=8)
    p.add_argument("--budget", type=float, default=540, help="seconds; no lever starts after 80%% of it")
    p.add_argument("--out", default="/tmp/mcorekit-save-levers")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--load-levers", default="", help=f"comma-separated, of {', '.join(LOAD_LEVERS)}")
    p.add_argument("--load-repeats", type=int, default=2, help="the load levers alternated this many times")
    a = p.parse_args(argv)
    levers = [x for x in a.levers.split(",") if x]
    load_levers = [x for x in a.load_levers.split(",") if x]
    if unknown := [x for x in load_levers if x not in LOAD_LEVERS]:
        p.error(f"unknown load levers {unknown}; known: {', '.join(LOAD_LEVERS)}")
    if unknown := [x for x in levers if x not in LEVERS]:
        p.error(f"unknown levers {unknown}; known: {', '.join(LEVERS)}")
    if a.device == "cpu" and (pinned := [x for x in levers if not LEVERS[x][1]]):
        p.error(f"levers {pinned} stage through pinned memory, which needs CUDA")
    began = time.perf_counter()
    out = fresh_dir(a.out)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29733", "RANK": "0", "WORLD_SIZE": "1"})
    import torch
    import torch.distributed as dist

    if a.device == "cuda":
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    else:  # Megatron-Core's finalize broadcasts a flag from torch.cuda.current_device(): the CPU here
        dist.init_process_group("gloo")
        torch.cuda.current_device = lambda: "cpu"
    rows: list[dict[str, Any]] = [dd_speed(out, a.dd_gb)]
    print(json.dumps(rows[0]), flush=True)
    state, nbytes = make_state(a.gb, a.device)
    print(f"state: {len(state)} tensors, {nbytes / 1e9:.1f} GB on {a.device}", flush=True)
    # Megatron-Core's first save starts its helpers (a multiprocessing Manager's server process): once, unrecorded
    from megatron.core.dist_checkpointing import ShardedTensor

    warm = torch.randn(1024, device=a.device)
    save_once({"optimizer.exp_avg.warm": ShardedTensor.from_rank_offsets("optimizer.exp_avg.warm", warm, replica_id=0)},
              out / "warm-up", "defaults")
    for lever in levers:
        if time.perf_counter() - began > 0.8 * a.budget:
            rows.append({"lever": lever, "error": "not run: out of time"})
            continue
        try:
            rows.append(save_once(state, out / lever, lever))
        except Exception as e:  # noqa: BLE001 - a lever that fails is a row, the others still run
            rows.append({"lever": lever, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(rows[-1]), flush=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
    if load_levers:
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        try:
            print(json.dumps(save_once(state, out / "load", "defaults", keep=True)), flush=True)
            for _ in range(a.load_repeats):
                for lever in load_levers:
                    if time.perf_counter() - began > 0.8 * a.budget:
                        rows.append({"load_lever": lever, "error": "not run: out of time"})
                    else:
                        try:
                            rows.append(load_once(state, out / "load", lever))
                        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a row, the others still run
                            rows.append({"load_lever": lever, "error": f"{type(e).__name__}: {e}"})
                    print(json.dumps(rows[-1]), flush=True)
                    (out / "results.json").write_text(json.dumps(rows, indent=1))
        finally:
            shutil.rmtree(out / "load", ignore_errors=True)  # 36 GB on a 64 GB disk
    print(table(rows))
    dist.destroy_process_group()
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
