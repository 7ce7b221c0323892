"""Causal attention's forward and backward on one GPU at a training shape, one way of running it per process
(issue: speed). The dense 3B profile of 2026-12-02 put cuDNN's fused attention at 35% of the bf16 peak, its backward
kernel alone 235 of the step's 2,110 ms: this says which of the ways at hand runs that shape fastest.

    python bench/attention_probe.py [--batch 2 --seq 4096 --heads 24 --groups 8 --dim 128] [--iters 20]
                                    [--variants all] [--out /tmp/attention-probe]

Variants (torch and Transformer Engine only; each in a fresh process, its environment set before TE is imported):
  te-sbhd        TE's DotProductAttention as Megatron-Core calls it: [s, b, h, d] inputs, causal mask (cuDNN)
  te-sbhd-dpws   the same with cuDNN's dP workspace allowed to hold the whole shape
                 (CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT; below it cuDNN's backward accumulates dQ in fp32 instead)
  te-bshd        TE with [b, s, h, d] inputs
  te-bshd-dpws   both
  torch-cudnn    torch's scaled_dot_product_attention, cuDNN backend, [b, h, s, d], GQA by enable_gqa
  torch-flash    torch's scaled_dot_product_attention, FlashAttention-2 backend

Reported per variant: forward and backward milliseconds (median over --iters, CUDA events), their TFLOP/s (causal
FLOPs: the forward 2 * b * h * s^2 * d, the backward 2.5 times that), peak memory, the longest kernels of one
iteration (torch.profiler), and how far the output and the gradients are from te-sbhd's on the same inputs
(max |difference| / max |reference|). The inputs come from a fixed seed, the same in every process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

WHOLE_DP = str(64 << 30)  # bytes: more than any shape here needs
VARIANTS: dict[str, tuple[str, str, dict[str, str]]] = {  # name: (library, layout, environment)
    "te-sbhd": ("te", "sbhd", {}),
    "te-sbhd-dpws": ("te", "sbhd", {"CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT": WHOLE_DP}),
    "te-bshd": ("te", "bshd", {}),
    "te-bshd-dpws": ("te", "bshd", {"CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT": WHOLE_DP}),
    "torch-cudnn": ("torch", "cudnn", {}),
    "torch-flash": ("torch", "flash", {}),
}
REFERENCE = "te-sbhd"


def inputs(b: int, s: int, h: int, g: int, d: int) -> dict[str, Any]:
    """q [b, s, h, d], k and v [b, s, g, d], the output gradient [b, s, h, d]; bf16 on the GPU, seed 0."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    return {"q": rand(b, s, h, d), "k": rand(b, s, g, d), "v": rand(b, s, g, d), "dout": rand(b, s, h, d)}


LAYOUTS = {  # how each variant holds a [b, s, heads, d] tensor, and back
    "sbhd": (lambda t: t.transpose(0, 1).contiguous(), lambda t: t.transpose(0, 1)),
    "bshd": (lambda t: t.contiguous(), lambda t: t),
    "cudnn": (lambda t: t.transpose(1, 2).contiguous(), lambda t: t.transpose(1, 2)),  # torch's [b, h, s, d]
    "flash": (lambda t: t.transpose(1, 2).contiguous(), lambda t: t.transpose(1, 2)),
}


def attention(library: str, layout: str, h: int, g: int, d: int) -> Any:
    """A function of (q, k, v), each in the variant's own layout, returning the output in that layout."""
    if library == "te":
        from transformer_engine.pytorch import DotProductAttention

        core = DotProductAttention(h, d, num_gqa_groups=g, qkv_format=layout, attn_mask_type="causal")
        return lambda q, k, v: core(q, k, v).view(q.shape)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[layout]

    def run(q: Any, k: Any, v: Any) -> Any:
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g != h)

    return run


def measure(name: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    library, layout, _ = VARIANTS[name]
    lay, unlay = LAYOUTS[layout]
    x = inputs(a.batch, a.seq, a.heads, a.groups, a.dim)
    fn = attention(library, layout, a.heads, a.groups, a.dim)
    q, k, v = (lay(x[n]).requires_grad_() for n in ("q", "k", "v"))
    dout = lay(x["dout"])

    def once() -> tuple[float, float]:
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        q.grad = k.grad = v.grad = None
        start.record()
        o = fn(q, k, v)
        mid.record()
        o.backward(dout)
        end.record()
        end.synchronize()
        return start.elapsed_time(mid), mid.elapsed_time(end)

    for _ in range(3):
        once()
    torch.cuda.reset_peak_memory_stats()
    times = [once() for _ in range(a.iters)]
    fwd_ms, bwd_ms = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
    peak_gb = torch.cuda.max_memory_allocated() / 1e9

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        once()
    kernels = sorted(((e.key, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0),
                     key=lambda kv: -kv[1])[:4]

    q.grad = k.grad = v.grad = None
    o = fn(q, k, v)
    o.backward(dout)
    tensors = {"out": unlay(o.detach()), "dq": unlay(q.grad), "dk": unlay(k.grad), "dv": unlay(v.grad)}
    save_file({n: t.contiguous().cpu() for n, t in tensors.items()}, str(out / f"{name}.safetensors"))

    fwd_flop = 2 * a.batch * a.heads * a.seq * a.seq * a.dim  # causal: half of 4 * b * h * s^2 * d
    return {"variant": name, "fwd_ms": round(fwd_ms, 3), "bwd_ms": round(bwd_ms, 3),
            "fwd_tflops": round(fwd_flop / fwd_ms / 1e9, 1), "bwd_tflops": round(2.5 * fwd_flop / bwd_ms / 1e9, 1),
            "peak_gb": round(peak_gb, 2), "kernels": [[k, round(ms, 3)] for k, ms in kernels]}


def compare(name: str, out: Path) -> dict[str, float]:
    """max |difference| / max |reference| of each of out, dq, dk, dv against the reference variant's."""
    from safetensors.torch import load_file

    mine, ref = load_file(str(out / f"{name}.safetensors")), load_file(str(out / f"{REFERENCE}.safetensors"))
    return {f"{n}_rel_diff": float((mine[n].float() - ref[n].float()).abs().max() / ref[n].float().abs().max())
            for n in ref}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variants", default="all", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--out", default="/tmp/attention-probe")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: measure this variant
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.one:
        print("RESULT " + json.dumps(measure(a.one, a, out)), flush=True)
        return 0
    names = list(VARIANTS) if a.variants == "all" else a.variants.split(",")
    if bad := [n for n in names if n not in VARIANTS]:
        p.error(f"unknown variant(s) {bad}; known: {', '.join(VARIANTS)}")
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    shape = [f"--{k}={getattr(a, k)}" for k in ("batch", "seq", "heads", "groups", "dim", "iters")]
    results = []
    for name in names:
        env = {**os.environ, **VARIANTS[name][2]}
        proc = subprocess.run([sys.executable, __file__, *shape, "--out", str(out), "--one", name],
                              env=env, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            result = {"variant": name, "error": (proc.stdout + proc.stderr)[-1500:]}
        else:
            result = json.loads(line.removeprefix("RESULT "))
            result.update(compare(name, out))
        results.append(result)
        print(json.dumps(result), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("| variant | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | peak GB | dq rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error'].strip().splitlines()[-1][:80]} | | | | | |")
        else:
            print(f"| {r['variant']} | {r['fwd_ms']} | {r['bwd_ms']} | {r['fwd_tflops']} | {r['bwd_tflops']} | "
                  f"{r['peak_gb']} | {r['dq_rel_diff']:.2e} |")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
