"""Demo: a tiny random Qwen3 model goes HF -> Megatron (torch_dist) -> HF -> TensorRT-LLM rank files as three
dependent Slurm jobs on the dev cluster, then the round trip is verified bit for bit."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import transformers

from mcorekit.config.cluster import load_profile
from mcorekit.launch import api
from mcorekit.launch.accounting import wait_final


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="mcorekit-demo-")).resolve()
    hf = root / "hf"
    if not hf.exists():
        torch.manual_seed(0)
        cfg = transformers.Qwen3Config(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=2, head_dim=32)
        transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(hf, max_shard_size="200KB")
    print(f"model: tiny random Qwen3 in {hf}")
    profile = load_profile("local", [f"run_root={root / 'runs'}", "tasks_per_node=1"])
    stages = [
        api.Stage("demo-hf-to-mcore", api.cli_payload(["convert", "hf-to-mcore", str(hf), str(root / "mcore"), "--quiet", "--force"])),
        api.Stage("demo-mcore-to-hf", api.cli_payload(["convert", "mcore-to-hf", str(root / "mcore"), str(root / "hf-back"), "--quiet", "--force"])),
        api.Stage("demo-export-engine", api.cli_payload(["export", "trtllm", str(root / "hf-back"), str(root / "trtllm"),
                                                         "--target", "engine", "--tp", "2", "--quiet", "--force"])),
    ]
    jobs = api.submit_chain(profile, stages, root / "runs" / "chain")
    print("submitted: " + " -> ".join(f"{s.name} ({j.job_id}, afterok)" for s, j in zip(stages, jobs)))
    ok = True
    for stage, job in zip(stages, jobs):
        rec = wait_final(job.job_id, timeout_s=600)
        print(f"  {stage.name}: {rec.state} exit {rec.exit_code} elapsed {rec.elapsed} (sacct)")
        ok &= rec.state == "COMPLETED"
    if not ok:
        return 1
    from mcorekit.convert.verify import compare_hf

    reports = compare_hf(hf, root / "hf-back")
    equal = sum(r.status == "equal" for r in reports)
    print(f"verify: {equal} of {len(reports)} tensors bitwise equal after HF -> Megatron -> HF")
    print(f"TensorRT-LLM engine checkpoint: {sorted(p.name for p in (root / 'trtllm').iterdir())}")
    return 0 if equal == len(reports) else 1


if __name__ == "__main__":
    sys.exit(main())
