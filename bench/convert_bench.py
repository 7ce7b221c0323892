"""Conversion throughput and memory, next to the disk's own speed and a naive baseline, in one run.

    .venv/bin/python bench/convert_bench.py [--layers 20] [--workdir /tmp/mcorekit-bench] [--repeat 3] [--busy]

1. generates a random Llama-shaped HF checkpoint (hidden 2048, GQA 16/8, FFN 5632, vocab 32768, bf16; 20 layers
   is 2.1 GB) in 5 safetensors shards;
2. measures the disk: `dd` sequential write and read of a file the checkpoint's size with O_DIRECT, each alone
   and both at once (reading one such file while writing another): a conversion reads and writes every
   byte once, so the time of both at once is the least a conversion can take (the "vs disk" column is
   that time over the step's; 100% is the disk's speed). On a disk that does not read and write in
   parallel (this one), both at once take as long as one after the other;
3. runs, each in its own process (peak RSS is that process's): naive HF->HF (transformers from_pretrained +
   save_pretrained), mcorekit hf-to-mcore (torch_dist) and mcorekit mcore-to-hf;
4. prints a Markdown table. Page cache is dropped before each step when the machine allows it. With --repeat N the
   three steps run N rounds (one conversion of the same files took 3.8-5.8 s in one hour on this machine): each
   step's median time and its range.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results import fresh_dir, run_worker

NAIVE = """
import sys, time, torch, transformers
from mcorekit.convert.pipeline import peak_rss_gb
t = time.monotonic()
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
m.save_pretrained(sys.argv[2], max_shard_size="500MB")
print("RESULT", time.monotonic() - t, peak_rss_gb())
"""
OURS = """
import sys, time
from mcorekit.convert import pipeline
from mcorekit.convert.pipeline import peak_rss_gb
t = time.monotonic()
if sys.argv[1] == "hf-to-mcore":
    pipeline.hf_to_mcore(sys.argv[2], sys.argv[3], quiet=True)
else:
    pipeline.mcore_to_hf(sys.argv[2], sys.argv[3], max_shard_bytes=500 * 1024**2, quiet=True)
print("RESULT", time.monotonic() - t, peak_rss_gb())
"""


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def generate(out: Path, layers: int) -> int:
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
                                   num_key_value_heads=8, vocab_size=32768, max_position_embeddings=4096, dtype="bfloat16")
    out.mkdir(parents=True)
    cfg.save_pretrained(out)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (32768, 2048)}
    for i in range(layers):
        p = f"model.layers.{i}"
        names.update({f"{p}.input_layernorm.weight": (2048,), f"{p}.post_attention_layernorm.weight": (2048,),
                      f"{p}.self_attn.q_proj.weight": (2048, 2048), f"{p}.self_attn.k_proj.weight": (1024, 2048),
                      f"{p}.self_attn.v_proj.weight": (1024, 2048), f"{p}.self_attn.o_proj.weight": (2048, 2048),
                      f"{p}.mlp.gate_proj.weight": (5632, 2048), f"{p}.mlp.up_proj.weight": (5632, 2048),
                      f"{p}.mlp.down_proj.weight": (2048, 5632)})
    names.update({"model.norm.weight": (2048,), "lm_head.weight": (32768, 2048)})
    total = sum(2 * int(torch.Size(s).numel()) for s in names.values())
    shards, current, size, weight_map = [], {}, 0, {}
    per_shard = total // 5 + 1
    for name, shape in names.items():
        current[name] = rnd(*shape)
        size += current[name].numel() * 2
        if size >= per_shard:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def dd(args: list[str]) -> float:
    t = time.monotonic()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.monotonic() - t


def concurrently(commands: list[list[str]]) -> float:
    t = time.monotonic()
    procs = [subprocess.Popen(["dd", *args, "status=none"]) for args in commands]
    if any(p.wait() for p in procs):
        raise SystemExit("dd failed")
    return time.monotonic() - t


def run(code: str, *args: str) -> tuple[float, float]:
    payload, output = run_worker(code, *args)
    if payload is None:
        raise SystemExit(output)
    secs, rss = payload.split()
    return float(secs), float(rss)


def steps(rows: list[tuple[str, float, float]], hf: Path, work: Path) -> None:
    for out in ("naive", "mcore", "back"):  # a previous round's outputs
        shutil.rmtree(work / out, ignore_errors=True)
    drop_caches()
    t, rss = run(NAIVE, str(hf), str(work / "naive"))
    rows.append(("naive: transformers from_pretrained + save_pretrained (HF -> HF)", t, rss))
    drop_caches()
    t, rss = run(OURS, "hf-to-mcore", str(hf), str(work / "mcore"))
    rows.append(("mcorekit convert hf-to-mcore (torch_dist)", t, rss))
    drop_caches()
    t, rss = run(OURS, "mcore-to-hf", str(work / "mcore"), str(work / "back"))
    rows.append(("mcorekit convert mcore-to-hf", t, rss))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--workdir", default="/tmp/mcorekit-bench")
    ap.add_argument("--busy", action="store_true", help="run the steps (not the dd) next to a process that keeps one core busy")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the three steps; the table gives each step's "
                    "median time (and its range), x naive from the medians, the largest peak RSS")
    a = ap.parse_args()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    work = fresh_dir(a.workdir)
    os.sync()
    time.sleep(2)  # the discards of a previous run's files
    hf = work / "hf"
    total = generate(hf, a.layers)
    gb = total / 1e9
    largest = max(p.stat().st_size for p in hf.glob("*.safetensors")) / 1e9
    cache = drop_caches()
    blocks = max(1, total // (16 * 1024**2))
    w = dd(["if=/dev/zero", f"of={work / 'ddfile'}", "bs=16M", f"count={blocks}", "oflag=direct,sync"])
    drop_caches()
    r = dd([f"if={work / 'ddfile'}", "of=/dev/null", "bs=16M", "iflag=direct"])
    drop_caches()
    both = concurrently([[f"if={work / 'ddfile'}", "of=/dev/null", "bs=16M", "iflag=direct"],
                         ["if=/dev/zero", f"of={work / 'ddfile2'}", "bs=16M", f"count={blocks}", "oflag=direct,sync"]])
    (work / "ddfile").unlink()
    (work / "ddfile2").unlink()
    os.sync()
    time.sleep(2)  # the filesystem discards the deleted blocks (mount -o discard) before the next step starts
    rounds: list[list[tuple[str, float, float]]] = []
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if a.busy else None
    try:
        for _ in range(a.repeat):
            rounds.append([])
            steps(rounds[-1], hf, work)
    finally:
        if busy:
            busy.kill()
            busy.wait()
    print(f"checkpoint: {gb:.2f} GB in {len(list(hf.glob('*.safetensors')))} shards (largest {largest:.2f} GB); "
          f"page cache dropped between steps: {'yes' if cache else 'no (not permitted here)'}; "
          f"{'one core kept busy by another process' if a.busy else 'no other load started'} (load average before: {load})")
    print(f"disk (dd, O_DIRECT): write {gb / w:.2f} GB/s, read {gb / r:.2f} GB/s; reading and writing the checkpoint's "
          f"size at once {both:.2f} s ({gb / both:.2f} GB/s of conversion; one after the other {w + r:.2f} s)\n")
    rows = [(name, statistics.median(r[i][1] for r in rounds), max(r[i][2] for r in rounds),
             [r[i][1] for r in rounds]) for i, (name, _, _) in enumerate(rounds[0])]
    print("| step | time (s) | GB/s | x naive | vs disk (read+write at once) | peak RSS (GB) | RSS / largest shard |")
    print("|---|---|---|---|---|---|---|")
    for name, t, rss, times in rows:
        spread = f" ({min(times):.1f}-{max(times):.1f})" if len(times) > 1 else ""
        print(f"| {name} | {t:.1f}{spread} | {gb / t:.2f} | {rows[0][1] / t:.2f} | {both / t * 100:.0f}% | {rss:.2f} | "
              f"{rss / largest:.1f}x |")
    if len(rounds) > 1:
        print(f"\n{len(rounds)} rounds, each step's time the median (range); each round: "
              + "; ".join(", ".join(f"{t:.1f}" for _, t, _ in r) for r in rounds))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
