"""Where FP8 MoE experts spend their time on one GPU: the per-row quantization (models/fp8_grouped_mm.py) as torch
ops (quantize_rows_eager) next to the one kernel torch.compile makes of them (quantize_rows on a GPU, what training
runs: the weights' rows through the 2-D kernels, their columns through quantize_columns) and next to a plain copy
of the tensor (the memory-bound floor), and the FP8 grouped GEMMs next to the bf16 ones they replace, at the MoE
benchmark's shapes.

    python bench/fp8_quant_bench.py [--out DIR] [--budget 150]

Shapes: `moe-8x-1.4b` (hidden 2048, expert FFN 1408, 8 experts, top-2) at micro-batch 4 x seq 2048: 16384 routed
token rows per MoE layer and micro-batch, split evenly over the experts. Per layer and micro-batch the experts quantize
four activation/gradient tensors and, once per step, their weights in two layouts; the last lines scale the
measured times to one training step of the benchmark (16 layers, 8 micro-batches). Needs only torch and a GPU
(compute capability 9.0/10.0 for the FP8 GEMMs). Prints a Markdown table; writes results.json after every row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROWS, HIDDEN, FFN, EXPERTS, LAYERS, MICRO_BATCHES = 16384, 2048, 1408, 8, 16, 8


def fp8_module():
    """models/fp8_grouped_mm.py by path: this bench runs where only torch is installed."""
    spec = importlib.util.spec_from_file_location("fp8_grouped_mm", HERE.parent / "models" / "fp8_grouped_mm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="fp8-quant-bench")
    p.add_argument("--budget", type=float, default=150.0, help="seconds; rows not reached by then are left out")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    fp8 = fp8_module()
    started = time.monotonic()
    results: list[dict] = []

    def record(row: dict) -> None:
        results.append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(json.dumps(row), flush=True)

    dev, bf16 = "cuda", torch.bfloat16
    fc1_w = torch.randn(EXPERTS, 2 * FFN, HIDDEN, device=dev, dtype=bf16) / 45
    fc2_w = torch.randn(EXPERTS, HIDDEN, FFN, device=dev, dtype=bf16) / 38
    def rows_of(t: torch.Tensor) -> tuple:  # [rows, cols] as the experts quantize activations and gradients
        return t, (lambda: fp8.quantize_rows_eager(t)), (lambda: fp8.quantize_rows(t))

    def weight_rows(w: torch.Tensor) -> tuple:  # what quantize_weights does for the forward's layout
        return w, (lambda: fp8.quantize_rows_eager(w)), (lambda: fp8.quantize_rows(w.reshape(-1, w.shape[-1])))

    def weight_columns(w: torch.Tensor) -> tuple:  # ... and for the input gradient's
        return w.transpose(1, 2), (lambda: fp8.quantize_rows_eager(w.transpose(1, 2))), (lambda: fp8.quantize_columns(w))

    per_micro_batch, once_per_step = LAYERS * MICRO_BATCHES, LAYERS
    tensors = {  # name: ((tensor, as torch ops, as training runs it), how often per step)
        "fc1 input [16384, 2048]": (rows_of(torch.randn(ROWS, HIDDEN, device=dev, dtype=bf16)), per_micro_batch),
        "fc2 input [16384, 1408]": (rows_of(torch.randn(ROWS, FFN, device=dev, dtype=bf16)), per_micro_batch),
        "fc2 output grad [16384, 2048]": (rows_of(torch.randn(ROWS, HIDDEN, device=dev, dtype=bf16)), per_micro_batch),
        "fc1 output grad [16384, 2816]": (rows_of(torch.randn(ROWS, 2 * FFN, device=dev, dtype=bf16)), per_micro_batch),
        "fc1 weights [8, 2816, 2048]": (weight_rows(fc1_w), once_per_step),
        "fc1 weights transposed": (weight_columns(fc1_w), once_per_step),
        "fc2 weights [8, 2048, 1408]": (weight_rows(fc2_w), once_per_step),
        "fc2 weights transposed": (weight_columns(fc2_w), once_per_step),
    }
    step = {"eager": 0.0, "compiled": 0.0, "copy": 0.0}
    for name, ((t, eager, compiled), per_step) in tensors.items():
        if time.monotonic() - started > a.budget:
            break
        eager_ms = timed_ms(eager)
        compiled_ms = timed_ms(compiled)
        copy_ms = timed_ms(lambda: t.clone(memory_format=torch.contiguous_format))
        (q, scale), (q_compiled, scale_compiled) = eager(), compiled()
        same = torch.equal(q.view(torch.uint8), q_compiled.view(torch.uint8).view(q.shape)) and \
            torch.equal(scale, scale_compiled.view(scale.shape))
        for key, ms in (("eager", eager_ms), ("compiled", compiled_ms), ("copy", copy_ms)):
            step[key] += ms * per_step
        record({"what": f"quantize {name}", "eager_ms": round(eager_ms, 3), "compiled_ms": round(compiled_ms, 3),
                "bf16_copy_ms": round(copy_ms, 3), "compiled_bitwise_equal": same, "per_step": per_step})
    record({"what": "quantization per training step (16 layers x 8 micro-batches; weights once per step)",
            "eager_ms": round(step["eager"], 1), "compiled_ms": round(step["compiled"], 1),
            "bf16_copy_ms": round(step["copy"], 1)})

    counts = torch.full((EXPERTS,), ROWS // EXPERTS, device=dev)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    gemm_step = {"bf16": 0.0, "fp8": 0.0}
    for name, x, w in (("fc1", tensors["fc1 input [16384, 2048]"][0], fc1_w),
                       ("fc2", tensors["fc2 input [16384, 1408]"][0], fc2_w)):
        if time.monotonic() - started > a.budget:
            break
        q = fp8.quantize_weights(w)
        g = torch.randn(ROWS, w.shape[1], device=dev, dtype=bf16)
        xq, xs = fp8.quantize_rows(x)
        gq, gs = fp8.quantize_rows(g)
        rows = {
            "forward bf16": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=ends),
            "forward fp8": lambda: fp8.scaled_grouped_mm(xq, q.rows.transpose(1, 2), xs, q.row_scale, ends),
            "input grad bf16": lambda: torch._grouped_mm(g, w, offs=ends),
            "input grad fp8": lambda: fp8.scaled_grouped_mm(gq, q.cols.transpose(1, 2), gs, q.col_scale, ends),
        }
        for what, fn in rows.items():
            ms = timed_ms(fn)
            gemm_step["fp8" if "fp8" in what else "bf16"] += ms * LAYERS * MICRO_BATCHES
            flops = 2 * ROWS * w.shape[1] * w.shape[2]
            record({"what": f"{name} {what} (GEMM only)", "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)})
    record({"what": "forward + input-gradient GEMMs per training step", "bf16_ms": round(gemm_step["bf16"], 1),
            "fp8_ms": round(gemm_step["fp8"], 1)})
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
