"""`trtllm-build` for the engine workflow (TensorRT-LLM <= 1.2), run only where tensorrt_llm is installed."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcorekit.errors import ExportError, first_line
from mcorekit.outputs import check_output, staged_output

INSTALL_HINT = ("tensorrt_llm is not installed here: the engine workflow needs TensorRT-LLM <= 1.2 "
                "(pip install 'mcorekit[trtllm]', i.e. 'tensorrt-llm<=1.2', on a GPU node); today's TensorRT-LLM "
                "loads HF checkpoints directly: export with --target pytorch instead")


@dataclass(frozen=True)
class BuildOptions:
    max_batch_size: int = 8
    max_input_len: int = 2048
    max_seq_len: int = 4096
    max_num_tokens: int = 8192
    gemm_plugin: str = "auto"


MAX_CONFIG_BYTES = 16 * 1024**2  # a rank-file config.json is a few KB


def read_config(checkpoint: Path) -> dict[str, Any]:
    """The rank-file checkpoint's config.json, checked for what trtllm-build needs from it (mapping.world_size)."""
    path = checkpoint / "config.json"
    fix = "re-export the checkpoint with `mcorekit export trtllm --target engine`"
    if not path.is_file():
        raise ExportError(f"{checkpoint}: no config.json; pass a directory written by `mcorekit export trtllm "
                          f"--target engine`")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ExportError(f"{path}: {path.stat().st_size} bytes, too big for a checkpoint config; {fix}")
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ExportError(f"{path}: not UTF-8 text (byte {e.start}); {fix}") from None
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: not valid JSON ({e.msg}, line {e.lineno} column {e.colno}); {fix}") from None
    except RecursionError:
        raise ExportError(f"{path}: JSON nested too deeply; {fix}") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ExportError(f"{path}: not valid JSON ({first_line(e)}); {fix}") from None
    mapping = config.get("mapping") if isinstance(config, dict) else None
    if not isinstance(mapping, dict):
        raise ExportError(f"{path}: no 'mapping' object (world_size, tp_size, pp_size); {fix}")
    sizes = {k: mapping.get(k) for k in ("world_size", "tp_size", "pp_size")}
    bad = [f"{k}={v!r}" for k, v in sizes.items() if (v is not None or k == "world_size") and not _positive(v)]
    if bad:
        raise ExportError(f"{path}: mapping {', '.join(bad)}: must be integers >= 1; {fix}")
    tp, pp = sizes["tp_size"], sizes["pp_size"]
    if tp is not None and pp is not None and tp * pp != sizes["world_size"]:
        raise ExportError(f"{path}: mapping world_size={sizes['world_size']} is not tp_size * pp_size = {tp * pp}; {fix}")
    return config


def _positive(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def check_options(opts: BuildOptions) -> None:
    sizes = {"--max-batch-size": opts.max_batch_size, "--max-input-len": opts.max_input_len,
             "--max-seq-len": opts.max_seq_len, "--max-num-tokens": opts.max_num_tokens}
    bad = [f"{k}={v}" for k, v in sizes.items() if not _positive(v)]
    if bad:
        raise ExportError(f"{', '.join(bad)}: must be integers >= 1")
    if opts.max_input_len > opts.max_seq_len:
        raise ExportError(f"--max-input-len={opts.max_input_len} exceeds --max-seq-len={opts.max_seq_len}; the prompt "
                          f"is part of the sequence")


def build_command(checkpoint: Path, engine_dir: Path, opts: BuildOptions) -> list[str]:
    workers = read_config(checkpoint)["mapping"]["world_size"]
    return ["trtllm-build", "--checkpoint_dir", str(checkpoint), "--output_dir", str(engine_dir),
            "--gemm_plugin", opts.gemm_plugin, "--max_batch_size", str(opts.max_batch_size),
            "--max_input_len", str(opts.max_input_len), "--max_seq_len", str(opts.max_seq_len),
            "--max_num_tokens", str(opts.max_num_tokens), "--workers", str(workers)]


def check_checkpoint(checkpoint: Path) -> None:
    world = read_config(checkpoint)["mapping"]["world_size"]
    for r in range(world):  # stops at the first gap: a huge world_size costs nothing
        rank = checkpoint / f"rank{r}.safetensors"
        if not rank.is_file():
            raise ExportError(f"{checkpoint}: missing {rank.name} (config.json says world_size={world}); "
                              f"re-export the checkpoint")


def build(checkpoint: Path, engine_dir: Path, opts: BuildOptions, force: bool = False) -> None:
    """trtllm-build into a staged folder that becomes ENGINE_DIR only when the build succeeds."""
    check_options(opts)
    check_checkpoint(checkpoint)
    check_output(engine_dir, [checkpoint], force)  # refused with or without TensorRT-LLM installed
    if importlib.util.find_spec("tensorrt_llm") is None or shutil.which("trtllm-build") is None:
        raise ExportError(INSTALL_HINT)
    with staged_output(engine_dir, force, [checkpoint], command="export engine") as stage:
        proc = subprocess.run(build_command(checkpoint, stage, opts))
        if proc.returncode != 0:
            raise ExportError(f"trtllm-build failed with exit code {proc.returncode}; its output is above")
