"""Which speed levers help a benchmark shape on one GPU: each lever on its own and combined, next to HF
transformers, in one run on the same GPU (issue: speed). A lever is measured before it becomes an option.

    python bench/levers.py [--shape moe|dense|dense-3b] [--run bf16|fp8-<recipe>] [--steps 16]
                           [--levers base,eager] [--no-hf] [--out DIR]

The shapes are train_bench.py's. Levers (applied inside the training process, on top of `python -m mcorekit.train`'s
defaults for the shape and --run):
  base     the defaults. MoE: torch._grouped_mm experts, permute fusion, alltoall dispatcher; at one expert- and
           tensor-parallel rank the tokens per expert stay on the GPU (models/grouped_mm_experts.
           keep_expert_counts_on_gpu; the `nosync` lever of 2026-12-01, default since) and the identity sort by
           local expert is skipped (skip_identity_sort); each step runs as one CUDA graph (schedule.cuda_graph=auto,
           train/step_graph.py)
  eager    no CUDA graph: the step's kernels launched one by one from the host (schedule.cuda_graph=false)
  no-gaf   (dense) gradient_accumulation_fusion off: a bf16 .grad per parameter that DDP's hooks add to its fp32
           main_grad, instead of the weight gradients accumulated into main_grad by TE's layers in the GEMM (the
           default for dense models since 1f997b5; before, only where APEX was installed)
  gaf      (MoE) gradient_accumulation_fusion on, as for dense models: TE's layers and the torch._grouped_mm experts
           accumulate into main_grad. MoE models have it only where APEX is installed (7613494: 1.6% slower under
           the step graph on the 8-expert shape)
  no-te-act (dense) Megatron-Core's bias-SwiGLU, which torch.compile compiles at step 1, instead of TE's SwiGLU
           kernel (use_te_activation_func, without the op's always empty extra state: models/megatron.te_swiglu_op;
           the default for dense SwiGLU models since c94fcf1, measured before as the lever `te-act`)
  te-ops   (dense) the MLP as one sequence of TE's fusible operations (Megatron-Core's TEFusedMLP: RMSNorm, FC1,
           SwiGLU, FC2 through TE's op fuser, which can hand FP8 data from one op to the next; not with no-te-act)
  qkv-rope (dense) RoPE applied to the QKV projection's output before it is split (Megatron-Core's
           fused_single_qkv_rope): no split copies forward, no concatenation of the gradients backward
  ce-plain Megatron-Core's unfused cross entropy (PyTorch ops) instead of its native fused one, which
           torch.compile compiles at step 1
  ce-te    TE's fused cross entropy (a Triton kernel; Megatron-Core's cross_entropy_fusion_impl="te") instead of
           Megatron-Core's native fused one
  sync     (MoE) the dispatcher copies the tokens per expert to the host and waits for them in each MoE layer and
           micro-batch (Megatron-Core's own behaviour, which stops the host running ahead): the default before
           2026-12-01. It cannot be captured: use it with `eager`
  sort     (MoE) Megatron-Core's sort of the tokens by local expert, which is the identity with one EP and TP rank
  router   (MoE) TE's fused router (top-k + softmax + aux loss in one kernel): moe.router_fusion=true
  fp8-attn (--run fp8-delayed, -tensorwise or -mxfp8) attention in FP8 too: TE's FP8 fused attention (cuDNN),
           Megatron-Core's fp8_dot_product_attention, the FP8 recipe's fp8_dpa. Without it attention runs in bf16
           under FP8 training.
Levers combine with '+'. Tokens/s is the median over logged intervals after the first; one process per lever. Each
process starts with an empty torch.compile cache and torch's dynamo log on (TORCH_LOGS=dynamo), so the table also
gives its cold start (process start to the end of step 1) and the seconds torch.compile spent in it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from results import compile_env, compile_summary, finish, metrics_summary, run_training, startup_marks, timed
from train_bench import SHAPES, hf_run, write_config

LEVERS = {"base", "eager", "gaf", "no-gaf", "no-te-act", "te-ops", "qkv-rope", "ce-plain", "ce-te", "sync", "sort",
          "router", "fp8-attn"}
FP8_ATTN_RUNS = ("fp8-delayed", "fp8-tensorwise", "fp8-mxfp8")  # Megatron-Core's block-scaling recipe has no fp8_dpa

# Run in the training process before mcorekit.train's main: patches that switch a lever on (no config key yet), for
# the levers named by `levers` (a set).
PATCHES = r"""
import mcorekit.config.megatron as margs
import mcorekit.models.grouped_mm_experts as gmm
import mcorekit.models.megatron as mm
base_kwargs, base_layer_spec = margs.transformer_kwargs, mm.layer_spec
def kwargs(*args, **kw):
    out = base_kwargs(*args, **kw)
    if "gaf" in levers or "no-gaf" in levers:
        out["gradient_accumulation_fusion"] = "gaf" in levers
    if "no-te-act" in levers:  # Megatron-Core's bias-SwiGLU where TE's ran
        out["bias_activation_fusion"] |= out["use_te_activation_func"]
    if "no-te-act" in levers or "te-ops" in levers:  # TE's op-fuser MLP builds its own SwiGLU op
        out["use_te_activation_func"] = False
    if "qkv-rope" in levers:
        out["fused_single_qkv_rope"] = True
    if "ce-plain" in levers:
        out["cross_entropy_loss_fusion"] = False
    if "ce-te" in levers:
        out["cross_entropy_fusion_impl"] = "te"
    if "fp8-attn" in levers:
        out["fp8_dot_product_attention"] = True
    return out
def layer_spec(*args, **kw):
    from megatron.core.models.gpt import gpt_layer_specs as specs
    te_spec = specs.get_gpt_layer_with_transformer_engine_spec
    if "te-ops" in levers:
        specs.get_gpt_layer_with_transformer_engine_spec = lambda *a, **k: te_spec(*a, **{**k, "use_te_op_fuser": True})
    try:
        return base_layer_spec(*args, **kw)
    finally:
        specs.get_gpt_layer_with_transformer_engine_spec = te_spec
margs.transformer_kwargs, mm.layer_spec = kwargs, layer_spec
if "sync" in levers:
    gmm.keep_expert_counts_on_gpu = lambda model: 0
if "sort" in levers:
    gmm.skip_identity_sort = lambda model: 0
"""
WORKER = f"""
import sys
levers = set(sys.argv[1].split("+"))
{PATCHES}
from mcorekit.train.__main__ import main
from mcorekit.train.shutdown import exit_with
exit_with(main(sys.argv[2:]))  # as `python -m mcorekit.train` ends
"""


def lever_run(shape: str, run: str, lever: str, steps: int, out: Path) -> dict:
    run_dir = out / f"{shape}-{run}-{lever.replace('+', '_')}"  # '+' in a folder name: some copy tools refuse it
    write_config(shape, run, steps, run_dir)
    cache = run_dir / "compile-cache"  # empty: the start is cold
    shutil.rmtree(cache, ignore_errors=True)
    parts = lever.split("+")
    extra = (["moe.router_fusion=true"] if "router" in parts else []) + \
        (["schedule.cuda_graph=false"] if "eager" in parts or "sync" in parts else [])
    cmd = [sys.executable, "-c", WORKER, lever, "--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir), *extra]
    proc = run_training(cmd, compile_env(29581, cache), run_dir)
    shutil.rmtree(cache, ignore_errors=True)
    row = {"shape": shape, "precision": run, "run": lever}
    if proc.returncode:
        return {**row, "error": (proc.stdout + proc.stderr)[-1500:]}
    log = proc.stdout + proc.stderr
    return {**row, **metrics_summary(run_dir), "cold_step1_s": startup_marks(log).get("step1"), **compile_summary(log)}


def table(results: list[dict]) -> str:
    hf = next((r.get("tokens_per_s") for r in results if r["run"] == "hf-bf16"), None)
    base = next((r.get("tokens_per_s") for r in results if r["run"] == "base"), None)
    rows = ["| run | tokens/s | MFU | peak mem GB | vs HF bf16 | vs base | loss first -> last | cold start to step 1, s "
            "| torch.compile, s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['run']} | failed: {r['error'].strip().splitlines()[-1][:100]} | | | | | | | |")
            continue
        tps, cold, compiled = r["tokens_per_s"], r.get("cold_step1_s"), r.get("compile_total_s")
        rows.append(f"| {r['run']} | {tps / 1e3:.1f}k | {r['mfu'] * 100:.1f}% | {r['mem_gb']:.1f} | "
                    f"{f'{tps / hf:.2f}x' if hf else ''} | {f'{tps / base:.2f}x' if base else ''} | "
                    f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} | {'' if cold is None else f'{cold:.1f}'} | "
                    f"{'' if compiled is None else f'{compiled:.1f}'} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="moe")
    p.add_argument("--run", default="bf16", help="the precision of every lever's run: bf16 or fp8-<recipe>")
    p.add_argument("--levers", default="base,eager")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--no-hf", action="store_true", help="leave out the transformers baseline")
    p.add_argument("--out", default="/tmp/mcorekit-levers")
    a = p.parse_args()
    unknown = {part for lever in a.levers.split(",") for part in lever.split("+")} - LEVERS
    if unknown:
        p.error(f"unknown lever(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(LEVERS))}")
    if "fp8-attn" in a.levers and a.run not in FP8_ATTN_RUNS:
        p.error(f"the fp8-attn lever needs an FP8 run whose recipe has attention in FP8: {', '.join(FP8_ATTN_RUNS)}")
    if any({"no-te-act", "te-ops"} <= set(lever.split("+")) for lever in a.levers.split(",")):
        p.error("no-te-act and te-ops do not combine: TE's op-fuser MLP builds its own SwiGLU op")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [] if a.no_hf else [timed(lambda: hf_run(a.shape, a.steps))]
    results += [timed(lambda: lever_run(a.shape, a.run, lever, a.steps, out)) for lever in a.levers.split(",")]
    return finish(results, out, table)


if __name__ == "__main__":
    sys.exit(main())
