"""bench/train_bench.py on a CPU: every shape's experiment file passes the project's loader and rules for one GPU,
with the shape's sequence length and micro-batch, so a GPU run cannot fail on a config key. In bf16: Megatron-Core
checks MoE FP8 against the installed Transformer Engine, which this machine has not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import train_bench  # noqa: E402

from mcorekit.config.experiment import load_experiment  # noqa: E402
from mcorekit.config.rules import Nodes, problems  # noqa: E402


@pytest.mark.parametrize("shape, preset, seq, mbs", [("dense", "llama-0.9b", 2048, 8), ("moe", "moe-8x-1.4b", 2048, 4),
                                                     ("dense-3b", "llama-3b", 4096, 2)])
def test_each_shape_writes_a_valid_experiment(tmp_path: Path, shape: str, preset: str, seq: int, mbs: int) -> None:
    exp = load_experiment(train_bench.write_config(shape, "bf16", 12, tmp_path / shape))
    assert problems(exp, 1, Nodes(transformer_engine=True, gpus=True, capability=(9, 0))) == []  # an H200
    assert (exp.model.preset, exp.data.seq_length, exp.schedule.micro_batch_size) == (preset, seq, mbs)
    assert exp.schedule.global_batch_size == mbs * train_bench.MICRO_BATCHES and exp.precision.fp8 is None


def test_a_run_past_its_time_is_killed_with_its_children(tmp_path: Path) -> None:
    """bench/results.run_training: a training process still running after its time limit (torchrun and its ranks,
    here a shell and its child) is killed as a group and counts as failed, with its output kept."""
    import os
    import time

    from results import run_training

    start = time.monotonic()
    proc = run_training(["bash", "-c", "sleep 60 & echo child $!; wait"], dict(os.environ), tmp_path, timeout=3)
    assert time.monotonic() - start < 30
    assert proc.returncode == 124 and "bench: killed after 3 s" in proc.stdout
    child = int(proc.stdout.split("child ")[1].split()[0])
    status = Path(f"/proc/{child}/status")

    def gone() -> bool:  # or a zombie awaiting its reaper
        try:
            return "\nState:\tZ" in status.read_text()
        except FileNotFoundError:
            return True

    # SIGKILLed with its group; its pipes close before it is a zombie, so it may still show running for a moment
    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()
    assert (tmp_path / "log.txt").read_text().startswith("child ")


def test_a_killed_bench_takes_its_training_process_with_it(tmp_path: Path) -> None:
    """bench/results.run_training: when the bench itself is killed (SIGKILL, as a GPU machine's time limit does), the
    training process it started goes too, instead of holding the GPU and its port for the next command."""
    import os
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    bench = (f"import os, sys; sys.path.insert(0, {str(Path(train_bench.__file__).parent)!r}); "
             "from pathlib import Path; from results import run_training; "
             f"run_training(['bash', '-c', 'echo $$ > {pid_file}; exec sleep 60'], dict(os.environ), Path({str(tmp_path)!r}))")
    parent = subprocess.Popen([sys.executable, "-c", bench])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert Path(f"/proc/{child}").exists()
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    status = Path(f"/proc/{child}/status")
    while status.exists() and "\nState:\tZ" not in status.read_text():  # gone, or a zombie awaiting its reaper
        assert time.monotonic() < deadline, "the training process outlived its bench"
        time.sleep(0.05)


LEVER_CHECK = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from levers import PATCHES
levers = set(sys.argv[1].split("+"))
exec(PATCHES)
from megatron.core.models.gpt import gpt_layer_specs
import mcorekit.config.megatron as margs
import mcorekit.models.megatron as mm
from mcorekit.config.experiment import load_experiment
from mcorekit.models.spec import resolve
calls = []
def recorder(*args, **kw):  # a real layer spec for the MLP's submodules (Megatron-Core's local one)
    calls.append(kw)
    return gpt_layer_specs.get_gpt_layer_local_spec()
gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec = recorder
exp, spec = load_experiment("examples/llama-tiny.yaml"), resolve("llama-tiny", None, {})
kw = margs.transformer_kwargs(exp, spec, use_te=True)
# Megatron-Core's own checks accept the combination (without the fused kernels, whose checks need TE)
config = margs.transformer_config(exp, spec, use_te=True, fusions=False)
got = mm.layer_spec(spec, use_te=True)
print("RESULT " + json.dumps({k: kw.get(k) for k in ("gradient_accumulation_fusion", "use_te_activation_func",
      "bias_activation_fusion", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "fp8_dot_product_attention",
      "fused_single_qkv_rope")}
      | {"activation": getattr(got.submodules.mlp.keywords["submodules"].activation_func, "__name__", None),
         "spec_kwargs": calls[0],
         "restored": gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec is recorder}))
"""


@pytest.mark.parametrize("lever, expected", [
    ("base", {"gradient_accumulation_fusion": True, "use_te_activation_func": True, "bias_activation_fusion": False,
              "cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native",
              "fp8_dot_product_attention": None, "fused_single_qkv_rope": None, "spec_kwargs": {}}),
    ("ce-te", {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te", "spec_kwargs": {}}),
    ("fp8-attn", {"gradient_accumulation_fusion": True, "fp8_dot_product_attention": True, "spec_kwargs": {}}),
    ("no-gaf+no-te-act+ce-plain", {"gradient_accumulation_fusion": False, "use_te_activation_func": False,
                                   "bias_activation_fusion": True, "cross_entropy_loss_fusion": False,
                                   "spec_kwargs": {}}),
    ("te-ops+qkv-rope", {"use_te_activation_func": False, "bias_activation_fusion": False,
                         "fused_single_qkv_rope": True, "spec_kwargs": {"use_te_op_fuser": True}}),
])
def test_lever_patches_change_what_the_training_process_builds(lever: str, expected: dict) -> None:
    """bench/levers.py's patches, run as its worker runs them (in a process of their own: they patch modules): the
    Megatron-Core config fields each lever switches, accepted by TransformerConfig, and what TE's layer spec is asked
    for: the op fuser's MLP only under `te-ops`. The dense MLP's activation module is always TE's SwiGLU op
    (models/megatron.te_swiglu_op; the config decides whether it runs). TE is not installed here: a recorder stands
    in for the spec function, returning Megatron-Core's local spec."""
    from results import run_worker

    payload, output = run_worker(LEVER_CHECK, lever, str(Path(train_bench.__file__).parent))
    assert payload is not None, output
    got = json.loads(payload)
    got["spec_kwargs"] = {k: v for k, v in got["spec_kwargs"].items() if k.startswith("use_te_")}
    assert {k: got[k] for k in expected} == expected
    assert got["activation"] == "te_swiglu_op" and got["restored"]


def test_a_runs_figures_from_its_metrics_and_output(tmp_path: Path) -> None:
    """bench/results.metrics_summary: tokens/s and MFU are the median of the logged intervals after the first (start-up
    and warm-up), lines without tokens/s (validation) are left out; startup_marks reads the start-up line."""
    from results import metrics_summary, startup_marks

    rows = [{"step": 2, "tokens_per_s": 10.0, "mfu": 0.1, "mem_gb": 5.0, "loss": 11.0},
            {"step": 4, "tokens_per_s": 30.0, "mfu": 0.3, "mem_gb": 6.0, "loss": 10.0},
            {"step": 4, "val_loss": 9.9},
            {"step": 6, "tokens_per_s": 50.0, "mfu": 0.5, "mem_gb": 5.5, "loss": 9.0},
            {"step": 8, "tokens_per_s": 40.0, "mfu": 0.4, "mem_gb": 5.5, "loss": 8.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert metrics_summary(tmp_path) == {"tokens_per_s": 40.0, "mfu": 0.4, "mem_gb": 6.0, "loss_first": 11.0,
                                         "loss_last": 8.5, "losses": [11.0, 10.0, 9.0, 8.5]}
    out = 'step 1/8 loss 11.0\nmcorekit.train: startup {"imports": 3.6, "step1": 28.78}\nstep 2/8 loss 10.9\n'
    assert startup_marks(out) == {"imports": 3.6, "step1": 28.78} and startup_marks("step 1/8\n") == {}


@pytest.mark.parametrize("levers, message", [
    ("base,no-te-act+te-ops", "no-te-act and te-ops do not combine"),
    ("base,no-such", "unknown lever(s) no-such"),
])
def test_levers_refuses_what_it_cannot_run_before_running_anything(tmp_path: Path, levers: str, message: str) -> None:
    bench = Path(train_bench.__file__).parent
    proc = subprocess.run([sys.executable, str(bench / "levers.py"), "--shape", "dense-3b", "--levers", levers,
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
