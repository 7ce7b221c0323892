"""The overlap benchmark's trace arithmetic (bench/overlap_bench.py): communication time per step and the part of it
that ran under compute kernels, from a chrome trace as torch.profiler writes it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
from overlap_bench import covered, overlap_from_trace, union  # noqa: E402


def kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}}


def test_union_and_covered() -> None:
    assert union([(5, 8), (0, 2), (1, 3), (8, 9)]) == [(0, 3), (5, 9)]
    assert covered([(0, 10)], [(2, 4), (6, 7), (9, 12)]) == 2 + 1 + 1
    assert covered([(0, 1), (20, 30)], [(2, 4)]) == 0


def test_hidden_and_exposed_communication_per_step() -> None:
    trace = {"traceEvents": [
        kernel("sm90_xmma_gemm_bf16", 0, 1000),  # compute 0-1000 us
        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 600, 800),  # comm 600-1400: 400 under compute
        kernel("elementwise_kernel", 1800, 200),  # compute 1800-2000
        kernel("ncclDevKernel_AllGather_RING_LL", 1900, 300),  # comm 1900-2200: 100 hidden
        kernel("Memcpy PtoP (Device -> Device)", 3000, 100, cat="gpu_memcpy"),  # a userbuffers peer copy, exposed
        kernel("Memcpy HtoD (Pageable -> Device)", 0, 5000, cat="gpu_memcpy"),  # neither compute nor communication
        {"ph": "i", "name": "marker", "ts": 0},
    ]}
    r = overlap_from_trace(trace, steps=2)
    assert r["comm_ms"] == (800 + 300 + 100) / 1e3 / 2
    assert r["hidden_ms"] == (400 + 100) / 1e3 / 2
    assert abs(r["exposed_ms"] - 0.35) < 1e-12 and abs(r["hidden_frac"] - 500 / 1200) < 1e-12


def test_profile_summary_per_step() -> None:
    """bench/profile_step.py: GPU busy time is the union of kernels; host waits are counted; figures are per step."""
    from profile_step import summarize

    def op(name: str, ts: float, dur: float, cat: str = "cpu_op") -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        kernel("gemm", 0, 1000), kernel("gemm", 500, 1000),  # overlapping: 1500 us busy
        kernel("permute", 3000, 500),  # 500 us more
        op("cudaStreamSynchronize", 100, 2000, cat="cuda_runtime"), op("cudaStreamSynchronize", 2500, 400, cat="cuda_runtime"),
        op("aten::item", 0, 50), op("aten::mm", 0, 300), op("cudaLaunchKernel", 0, 5, cat="cuda_runtime"),
    ]}
    s = summarize(trace, wall_s=0.008, steps=2)  # 8 ms for two steps
    assert s["wall_ms"] == 4.0 and s["gpu_busy_ms"] == 1.0 and s["gpu_idle_frac"] == 0.75
    assert s["host_waits"]["cudaStreamSynchronize"] == {"calls": 1, "ms": 1.2}
    assert s["host_waits"]["aten::item"]["ms"] == 0.025 and "cudaLaunchKernel" not in s["host_waits"]
    assert s["top_kernels"][0] == {"name": "gemm", "calls": 1, "ms": 1.0} and s["kernels_per_step"] == 1.5
    assert [o["name"] for o in s["top_host_ops"]] == ["aten::mm", "aten::item"]
    assert s["kernel_ms_by_kind"] == {"GEMM": 1.0, "other (elementwise, norms, optimizer)": 0.25}


def test_kernel_families() -> None:
    """Kernel names as the H200 traces print them (cuBLAS's nvjet, cuDNN's fused attention, flash attention, NCCL)."""
    from profile_step import kind_of

    assert kind_of("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT") == "GEMM"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "GEMM"
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    assert kind_of("flash_fwd_kernel") == "attention"
    assert kind_of("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert kind_of("Memcpy DtoD (Device -> Device)") == "memory copy/set"
    assert kind_of("Memset (Device)") == "memory copy/set"
    assert kind_of("triton_poi_fused_mul_silu_0") == "other (elementwise, norms, optimizer)"
    # A name that two families match goes to the first: cuDNN's GEMMs are GEMMs, dtype casts count as copies
    assert kind_of("cudnn_generated_fort_native_gemm_bf16") == "GEMM"
    assert kind_of("triton_poi_fused__to_copy_0") == "memory copy/set"
