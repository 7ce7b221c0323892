#!/usr/bin/env bash
# make demo: bring up the dev cluster and run the toolchain end to end, as far as it is built today.
set -euo pipefail
cd "$(dirname "$0")/.."
mk=".venv/bin/mcorekit"
step() { printf '\n== %s\n' "$*"; }

step "1. cluster smoke job: 2 tasks form a gloo group over srun and all-reduce (real Slurm, real sacct)"
$mk launch smoke --cluster local

step "2. training job for examples/llama-0.9b.yaml on a 2-node, 8-GPU profile (dry run: the exact sbatch script)"
$mk launch --config examples/llama-0.9b.yaml --cluster example-h100 --dry-run | sed -n '/# sbatch script/,$p'

step "3. bad input fails early: a typo, then an impossible layout (nothing is submitted)"
$mk launch --config examples/llama-tiny.yaml --cluster local parallel.tpp=2 || true
$mk launch --config examples/llama-0.9b.yaml --cluster example-h100 parallel.tp=3 parallel.pp=5 || true

step "3b. layouts that fit: a 3B model on 8 GPUs"
$mk launch plan --model llama-3b --gpus 8 --seq 4096

step "4. HF -> Megatron -> HF -> TensorRT-LLM as a chain of three Slurm jobs (afterok), verified bit for bit"
.venv/bin/python tools/demo_chain.py "${DEMO_DIR:-$PWD/runs/demo}"

step "5. this project's jobs"
$mk status --cluster local
$mk status --runs "${DEMO_DIR:-$PWD/runs/demo}/runs"

step "6. training needs GPUs: the dev cluster is CPU-only, so the launcher refuses before submitting"
$mk launch --config examples/llama-tiny.yaml --cluster local || true
echo "  (train/ runs on the GPU machines: one- and two-GPU results in docs/gpu-runs.md)"
echo
echo "demo: done"
