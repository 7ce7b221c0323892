# Everyday entry points. Each creates what it needs: the Python 3.12 venv (tools/setup-venv.sh) and,
# where Slurm is involved, the embedded dev cluster (slurm/cluster.sh).
SHELL := /bin/bash
PY := .venv/bin/python
MK := .venv/bin/mcorekit
CLUSTER ?= local
CONFIG ?= examples/llama-tiny.yaml
ARGS ?=
NODES ?=

.PHONY: help setup demo test test-cpu test-gpu test-gpu-post test-gpu-multi cluster-up cluster-down cluster-status train sweep dry-run status logs cancel convert export data bench-train bench-overlap bench-profile bench-post bench-start-save

help:
	@echo "make demo            bring up the dev Slurm cluster and run the toolchain end to end"
	@echo "make test            venv + cluster + the whole test suite (fails on any failure)"
	@echo "make setup           create/refresh .venv (Python 3.12, requirements.lock)"
	@echo "make cluster-up|cluster-down|cluster-status"
	@echo "make train CONFIG=exp.yaml CLUSTER=local [NODES=n] [ARGS='parallel.tp=2 ...']"
	@echo "make dry-run CONFIG=... CLUSTER=...   print the resolved config and sbatch script"
	@echo "make sweep CONFIG=... GRID=\"optimizer.lr=1e-4,3e-4\" [MAX_PARALLEL=2]"
	@echo "make status | make logs JOB=id | make cancel JOB=id"
	@echo "make data ARGS=\"preprocess corpus.jsonl --tokenizer DIR --output-prefix data/corpus\""
	@echo "make test-gpu        (GPU machine) the one-GPU suite in one call; test-gpu-post: DPO/LoRA/GRPO/families;"
	@echo "                     make test-gpu-multi on 2 GPUs (layouts, FSDP, DPO and GRPO layouts)"
	@echo "make bench-train     (GPU) training tokens/s and MFU vs HF transformers, docs/train.md"
	@echo "make bench-overlap   (2+ GPUs) hidden vs exposed communication, DP and TP overlaps, docs/train.md"
	@echo "make bench-profile   (GPU) where a training step's time goes: GPU busy vs host, top kernels and ops"
	@echo "make bench-start-save (GPU) start-up phases to step 1, checkpoint save/load GB/s vs dd, async-save cost"
	@echo "make bench-post      (GPU) DPO and LoRA vs full fine-tuning, 0.89B: tokens/s, peak memory, checkpoint size"
	@echo "make convert ARGS=\"hf-to-mcore HF_DIR OUT --tp 2\" | make export ARGS=\"trtllm SRC OUT --target engine --tp 2\""

setup:
	@bash tools/setup-venv.sh

cluster-up:
	@bash slurm/cluster.sh up

cluster-down:
	@bash slurm/cluster.sh down

cluster-status:
	@bash slurm/cluster.sh status

demo: setup cluster-up
	@bash tools/demo.sh

# The whole suite; slurm tests must run (a missing cluster fails the run instead of skipping). Everything but Slurm
# on TEST_WORKERS processes (pytest-xdist; 20 min -> 17 min on the 2-core CI machine), then the Slurm tests one at a
# time: the dev cluster is one node, and some tests check what its queue holds. Pytest's exit 5 (no test selected) is
# a failure for the whole suite, but not for a half that PYTEST_ARGS (a file, -k) leaves empty.
TEST_WORKERS ?= 2
NO_TESTS_OK = rc=$$?; [ $$rc -eq 5 ] && [ -n "$(PYTEST_ARGS)" ] && rc=0; exit $$rc
test: setup cluster-up
	MCOREKIT_REQUIRE_SLURM=1 $(PY) -m pytest -n $(TEST_WORKERS) -m "not slurm" $(PYTEST_ARGS); $(NO_TESTS_OK)
	MCOREKIT_REQUIRE_SLURM=1 $(PY) -m pytest -m slurm $(PYTEST_ARGS); $(NO_TESTS_OK)

# Only what needs neither Slurm nor a GPU.
test-cpu: setup
	$(PY) -m pytest -m "not slurm and not gpu" $(PYTEST_ARGS)

# The embedded dev cluster only for CLUSTER=local: another profile names a real cluster, reached from this login node.
LOCAL_CLUSTER = $(if $(filter local,$(CLUSTER)),cluster-up)

train: setup $(LOCAL_CLUSTER)
	$(MK) launch --config $(CONFIG) --cluster $(CLUSTER) $(if $(NODES),--nodes $(NODES)) $(ARGS)

dry-run: setup
	$(MK) launch --config $(CONFIG) --cluster $(CLUSTER) $(if $(NODES),--nodes $(NODES)) --dry-run $(ARGS)

status: setup
	$(MK) status --cluster $(CLUSTER)

logs: setup
	$(MK) logs --cluster $(CLUSTER) $(JOB) $(ARGS)

cancel: setup
	$(MK) cancel --cluster $(CLUSTER) $(JOB)

convert export data: setup
	$(MK) $@ $(ARGS)

# On the GPU machine (where the GPU stack is staged, not .venv): the one-GPU suite in one call (-n 4 shares the one
# GPU; 508 s for its 59 tests on one H200 at `397c5af`), the post-training and model-family tests (DPO, LoRA, GRPO,
# DeepSeek-V3/GPT-OSS; one GPU, their two-GPU cases skip there), and the two-GPU suites (layouts, Megatron-FSDP). From
# tests/: run from the repository root, its mcorekit/ folder would shadow the installed package. GPU_PY is that
# machine's python.
# -v names each result as it ends: a call cut by its time limit still says which test failed (-q printed dots).
GPU_PY ?= python3
test-gpu:
	cd tests && $(GPU_PY) -m pytest test_gpu_train.py test_gpu_convert.py test_checkpoint_writer.py -n 4 -v -rA --durations=10 \
		$(PYTEST_ARGS)

test-gpu-post:
	cd tests && $(GPU_PY) -m pytest test_gpu_lora.py test_gpu_dpo.py test_gpu_grpo.py test_gpu_families.py -n 4 \
		--dist loadfile -v -rA --durations=10 $(PYTEST_ARGS)

test-gpu-multi:
	cd tests && $(GPU_PY) -m pytest test_gpu_multi.py test_gpu_fsdp.py test_gpu_dpo.py test_gpu_grpo.py -v -s \
		-k "multi or fsdp or layouts or tp2" $(PYTEST_ARGS)

# On a GPU machine: both benchmark shapes, mcorekit next to HF transformers (the table in docs/train.md).
bench-train: setup
	cd /tmp && $(CURDIR)/$(PY) $(CURDIR)/bench/train_bench.py $(ARGS)

# On a node with 2+ GPUs: DP and TP communication overlaps, measured from profiler traces (docs/train.md).
bench-overlap: setup
	cd /tmp && $(CURDIR)/$(PY) $(CURDIR)/bench/overlap_bench.py $(ARGS)

# On a GPU machine: where one training step's time goes (GPU busy vs host, top kernels), e.g. ARGS="--shape moe".
bench-profile: setup
	cd /tmp && $(CURDIR)/$(PY) $(CURDIR)/bench/profile_step.py $(ARGS)

# On a GPU machine: post-training cost on the 0.89B shape (SFT full/LoRA, DPO live/precomputed/LoRA); ARGS="--dry"
# checks every case's config and data without a GPU.
bench-post: setup
	cd /tmp && $(CURDIR)/$(PY) $(CURDIR)/bench/post_bench.py $(ARGS)

# On a GPU machine: start-up phases, checkpoint save and load speed next to dd's, the cost of an async save (3B shape).
bench-start-save: setup
	cd /tmp && $(CURDIR)/$(PY) $(CURDIR)/bench/start_save.py $(ARGS)

# make sweep CONFIG=exp.yaml GRID="optimizer.lr=1e-4,3e-4 parallel.tp=1,2" [MAX_PARALLEL=2]
sweep: setup $(LOCAL_CLUSTER)
	$(MK) launch sweep --config $(CONFIG) --cluster $(CLUSTER) $(foreach g,$(GRID),--grid $(g)) $(if $(MAX_PARALLEL),--max-parallel $(MAX_PARALLEL)) $(ARGS)
