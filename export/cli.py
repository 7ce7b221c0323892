"""`mcorekit export`: checkpoints to TensorRT-LLM.

  mcorekit export trtllm SRC OUT --target pytorch|engine [--tp N --pp N --ep N] [--dtype bf16|fp16|fp32] [--fp8 --calib FILE]
  mcorekit export engine TRTLLM_CKPT ENGINE_DIR [--max-batch-size N ...]   (runs trtllm-build; TensorRT-LLM <= 1.2)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcorekit.cli import HelpFormatter, dispatch
from mcorekit.export import targets
from mcorekit.models import dtypes
from mcorekit.options import positive_int




def _trtllm(argv: list[str]) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="mcorekit export trtllm", formatter_class=HelpFormatter,
                                description=(
        "SRC is an HF directory or a Megatron checkpoint (converted through convert/ first). "
        + " ".join(f"Target {t.name}: {t.description}." for t in targets.TARGETS.values())))
    p.add_argument("src", help="HF model directory (or a Hub model ID, org/name) or Megatron checkpoint")
    p.add_argument("out", help="output directory (written aside and renamed when complete)")
    p.add_argument("--target", choices=list(targets.NAMES), required=True,
                   help="; ".join(f"{t.name}: {t.description}" for t in targets.TARGETS.values()))
    p.add_argument("--tp", type=positive_int, default=1, help="tensor parallel size of the served model")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline parallel size of the served model")
    p.add_argument("--ep", type=positive_int, default=1,
                   help="expert parallel, MoE only (inside the TP group: divides --tp and the expert count)")
    p.add_argument("--dtype", choices=list(dtypes.NAMES), default="bf16", help="weight dtype (non-FP8 weights)")
    p.add_argument("--fp8", action="store_true", help="per-tensor FP8 weights and activation scales (needs --calib)")
    p.add_argument("--calib", default=None, help="calibration data: JSON lines with input_ids or text")
    p.add_argument("--hf-config", default=None, help="for a Megatron SRC without a stored HF config")
    p.add_argument("--force", action="store_true", help="replace OUT if an earlier mcorekit export wrote it")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    from mcorekit.hub import model_dir  # an org/name Hub ID for SRC (HF weights) or --hf-config (config, tokenizer)

    src = str(model_dir(a.src, "model", "SRC"))
    hf_config = a.hf_config and str(model_dir(a.hf_config, "tokenizer", "--hf-config"))
    from mcorekit.export.pipeline import export  # torch: imported only once the arguments are valid (fast --help)

    s = export(src, a.out, a.target, tp=a.tp, pp=a.pp, ep=a.ep, dtype=a.dtype,
               use_fp8=a.fp8, calib=a.calib, hf_config=hf_config, force=a.force, quiet=a.quiet)
    print(f"export {a.target} -> {a.out}: {s.bytes / 1e9:.3f} GB in {s.seconds:.1f} s")
    return 0


def _engine(argv: list[str]) -> int:
    from mcorekit.export.build import BuildOptions, build

    p = argparse.ArgumentParser(allow_abbrev=False, prog="mcorekit export engine", formatter_class=HelpFormatter,
                                description=(
        "Build TensorRT engines from a rank-file checkpoint with trtllm-build (TensorRT-LLM <= 1.2 must be installed)."))
    p.add_argument("checkpoint", help="rank-file checkpoint written by `mcorekit export trtllm --target engine`")
    p.add_argument("engine_dir", help="where trtllm-build writes the engines")
    p.add_argument("--max-batch-size", type=positive_int, default=8, help="trtllm-build --max_batch_size")
    p.add_argument("--max-input-len", type=positive_int, default=2048, help="trtllm-build --max_input_len")
    p.add_argument("--max-seq-len", type=positive_int, default=4096, help="trtllm-build --max_seq_len")
    p.add_argument("--max-num-tokens", type=positive_int, default=8192, help="trtllm-build --max_num_tokens")
    p.add_argument("--gemm-plugin", default="auto", help="trtllm-build --gemm_plugin")
    p.add_argument("--force", action="store_true", help="replace ENGINE_DIR if an earlier build wrote it")
    a = p.parse_args(argv)
    opts = BuildOptions(a.max_batch_size, a.max_input_len, a.max_seq_len, a.max_num_tokens, a.gemm_plugin)
    build(Path(a.checkpoint), Path(a.engine_dir), opts, force=a.force)
    print(f"engine built in {a.engine_dir}")
    return 0


COMMANDS = {"trtllm": _trtllm, "engine": _engine}


HELPS = {"trtllm": "a checkpoint for TensorRT-LLM (--target pytorch: today's; engine: rank files for <= 1.2)",
         "engine": "build TensorRT engines from rank files with trtllm-build (TensorRT-LLM <= 1.2)"}


def main(command: str, argv: list[str]) -> int:
    return dispatch("mcorekit export", __doc__, COMMANDS, argv, HELPS)


if __name__ == "__main__":
    sys.exit(main("export", sys.argv[1:]))
