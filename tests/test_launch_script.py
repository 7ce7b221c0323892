"""What the rendered sbatch script asks of Slurm, and what the job builder refuses before anything is written or
submitted (the audit of the launch layer)."""

from __future__ import annotations

from pathlib import Path


from mcorekit.config.cluster import load_profile
from mcorekit.launch.submit import JobSpec, render


def gpu_profile(*extra: str):
    return load_profile("example-h100", ["python=/opt/venv/bin/python", "container={}", *extra])


def test_jobs_are_requeueable_on_sites_whose_default_is_not() -> None:
    """With JobRequeue=0 a job without --requeue refuses `scontrol requeue` (the time-limit requeue) and is not
    requeued on preemption or node failure."""
    text = render(gpu_profile(), JobSpec(name="t", run_dir=Path("/runs/t")))
    assert "#SBATCH --requeue\n" in text


REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "llama-tiny.yaml"


def setup_env(script: str, name: str, task: int | None = None) -> str:
    """The value the script's setup section gives `name` (in array task `task`): what srun's tasks inherit."""
    import os
    import subprocess

    setup = script.split("\n# setup\n", 1)[1].split("\n# command\n", 1)[0]
    env = {"PATH": os.environ["PATH"], **({"SLURM_ARRAY_TASK_ID": str(task)} if task is not None else {})}
    return subprocess.run(["bash", "-c", f'{setup}\nprintf %s "${name}"'], env=env, capture_output=True, text=True,
                          check=True).stdout


def test_each_sweep_point_gets_its_own_environment(tmp_path: Path) -> None:
    """parallel.fsdp needs CUDA_DEVICE_MAX_CONNECTIONS=8 (train/fsdp.py refuses 1); the array took the first point's
    environment for every point."""
    from mcorekit.launch import api

    points, sweep_dir = api.prepare_sweep(TINY, "example-h100", {"parallel.fsdp": [None, "optim", None]},
                                          ["schedule.global_batch_size=16"],
                                          [f"run_root={tmp_path}", "setup=[]", "container={}"])
    script = api.sweep_job(points, sweep_dir).script
    assert [setup_env(script, "CUDA_DEVICE_MAX_CONNECTIONS", i) for i in range(3)] == ["1", "8", "1"]
    single = api.load(TINY, "example-h100", ["parallel.fsdp=optim", "schedule.global_batch_size=16"],
                      [f"run_root={tmp_path}", "setup=[]", "container={}"])
    assert setup_env(single.job().script, "CUDA_DEVICE_MAX_CONNECTIONS") == "8"


def test_a_chains_training_stage_carries_the_experiments_environment(tmp_path: Path) -> None:
    from mcorekit.launch import api

    p = api.load(TINY, "example-h100", ["parallel.fsdp=optim", "schedule.global_batch_size=16"],
                 [f"run_root={tmp_path}", "setup=[]", "container={}"])
    train = api.chain_jobs(p.profile, [api.training_stage(p)], p.spec.run_dir)[0]
    assert setup_env(train.script, "CUDA_DEVICE_MAX_CONNECTIONS") == "8"


def test_srun_gets_the_cpus_per_task_sbatch_asked_for() -> None:
    """Since Slurm 22.05 srun does not inherit sbatch's --cpus-per-task: each rank got one CPU for itself and its
    data loader workers. SRUN_CPUS_PER_TASK is srun's --cpus-per-task (srun(1))."""
    text = render(gpu_profile(), JobSpec(name="t", run_dir=Path("/runs/t")))
    assert "#SBATCH --cpus-per-task=16\n" in text and setup_env(text, "SRUN_CPUS_PER_TASK") == "16"


def test_cpu_stages_share_nodes_and_ask_for_memory() -> None:
    """A chain's convert/export stage held a whole exclusive GPU node (the profile's exclusive: true) and, with no
    memory request, whatever the site's default gives (often all of the node's, or too little)."""
    cpu = JobSpec(name="convert", run_dir=Path("/runs/c/convert"), gpus_per_node=0, dependency="afterok:1")
    text = render(gpu_profile(), cpu)
    assert "--exclusive" not in text and "#SBATCH --mem=32G\n" in text
    assert "#SBATCH --mem=64G\n" in render(gpu_profile("cpu_mem_gb=64"), cpu)
    assert "--exclusive" in render(gpu_profile(), JobSpec(name="convert", run_dir=Path("/r"), gpus_per_node=0,
                                                          exclusive=True))  # asked for: kept
    gpu = render(gpu_profile(), JobSpec(name="train", run_dir=Path("/runs/c/train")))
    assert "#SBATCH --exclusive\n" in gpu and "#SBATCH --mem=" not in gpu
