"""`trtllm-build` for the engine workflow (TensorRT-LLM <= 1.2), run only where tensorrt_llm is installed."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mcorekit.errors import ExportError

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


def build_command(checkpoint: Path, engine_dir: Path, opts: BuildOptions) -> list[str]:
    config = json.loads((checkpoint / "config.json").read_text())
    workers = config["mapping"]["world_size"]
    return ["trtllm-build", "--checkpoint_dir", str(checkpoint), "--output_dir", str(engine_dir),
            "--gemm_plugin", opts.gemm_plugin, "--max_batch_size", str(opts.max_batch_size),
            "--max_input_len", str(opts.max_input_len), "--max_seq_len", str(opts.max_seq_len),
            "--max_num_tokens", str(opts.max_num_tokens), "--workers", str(workers)]


def check_checkpoint(checkpoint: Path) -> None:
    if not (checkpoint / "config.json").is_file():
        raise ExportError(f"{checkpoint}: no config.json; pass a directory written by `mcorekit export trtllm --target engine`")
    world = json.loads((checkpoint / "config.json").read_text())["mapping"]["world_size"]
    missing = [f"rank{r}.safetensors" for r in range(world) if not (checkpoint / f"rank{r}.safetensors").is_file()]
    if missing:
        raise ExportError(f"{checkpoint}: missing {missing[0]} (config.json says world_size={world})")


def build(checkpoint: Path, engine_dir: Path, opts: BuildOptions, force: bool = False) -> None:
    check_checkpoint(checkpoint)
    if importlib.util.find_spec("tensorrt_llm") is None or shutil.which("trtllm-build") is None:
        raise ExportError(INSTALL_HINT)
    if engine_dir.exists() and not force:
        raise ExportError(f"output {engine_dir} exists; pass --force to replace it")
    proc = subprocess.run(build_command(checkpoint, engine_dir, opts))
    if proc.returncode != 0:
        raise ExportError(f"trtllm-build failed with exit code {proc.returncode}; its output is above")
