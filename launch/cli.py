"""`mcorekit launch`: validate an experiment against a cluster profile, then print or submit its Slurm job(s).

  mcorekit launch --config EXP.yaml --cluster local [--nodes N] [--dry-run] [key.path=value ...]
  mcorekit launch sweep --config EXP.yaml --grid optimizer.lr=1e-4,3e-4 [--grid ...] [--max-parallel N]
  mcorekit launch chain --config EXP.yaml --hf-out DIR [--export-out DIR]   (train -> convert -> export)
  mcorekit launch plan --model PRESET_OR_HF_DIR --gpus N [--cluster P | --gpu-memory-gb 80] [--recompute full]
  mcorekit launch smoke --cluster local       (a one-minute all-reduce over every task)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mcorekit.config.cluster import load_profile
from mcorekit.config.loading import dump
from mcorekit.config.values import shown, text_problem
from mcorekit.errors import ConfigError, LaunchError
from mcorekit.export import targets
from mcorekit.launch import api
from mcorekit.options import count, nonempty
from mcorekit.launch.submit import check_writable, literal_env_warnings, submit_one


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", type=nonempty, default="local",
                        help="profile name from slurm/clusters/ or a YAML path (default: local)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and the exact sbatch script; submit nothing")
    parser.add_argument("--set", dest="profile_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a cluster-profile key, e.g. --set partition=batch (repeatable)")


def _experiment_args(parser: argparse.ArgumentParser, config_required: bool = True) -> None:
    parser.add_argument("--config", type=nonempty, required=config_required, help="experiment YAML")
    parser.add_argument("--nodes", type=count, default=None, help="number of nodes (default: the experiment's resources.nodes)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="experiment overrides, e.g. parallel.tp=2")


def _warn(p: api.Prepared) -> None:
    for w in p.warnings:
        print(f"mcorekit: warning: {w}", file=sys.stderr)


def main_train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False,
        prog="mcorekit launch",
        description="Validate an experiment (layout vs nodes x GPUs, divisibility, memory) and submit it as a Slurm "
        "job that requeues itself on time limit or preemption. Subcommands: sweep, chain, plan, smoke "
        "(`mcorekit launch SUBCOMMAND --help`).",
    )
    _experiment_args(parser, config_required=False)
    _common(parser)
    parser.add_argument("--resume", type=nonempty, metavar="RUN_DIR", default=None,
                        help="relaunch a run folder that `mcorekit launch` made: its own config.yaml and cluster.yaml, "
                             "the same folder and checkpoints (training resumes from the latest), as the next job; "
                             "takes no --config, --cluster, --set, --nodes or overrides")
    args = parser.parse_args(argv)
    if misplaced := [a for a in args.overrides if a in SUBCOMMANDS]:  # `launch --cluster local smoke`
        raise ConfigError(f"{misplaced[0]!r} is a launch subcommand: name it first, then its options "
                          f"(mcorekit launch {misplaced[0]} {' '.join(a for a in argv if a != misplaced[0])})")
    if args.resume is None and args.config is None:
        raise ConfigError("launch needs --config EXP.yaml (or --resume RUN_DIR to relaunch a run folder)")
    if args.resume is not None:
        return _resume(args, argv)
    p = api.load(args.config, args.cluster, args.overrides, args.profile_overrides, args.nodes)
    _warn(p)
    if args.dry_run:
        check_writable(p.spec.run_dir.parent, dry_run=True)
        _show(p)
        return 0
    job = api.submit_prepared(p)
    print(f"submitted {job.job_id}: {p.spec.run_dir} (mcorekit logs {job.job_id} --follow)")
    return 0


def _show(p: api.Prepared) -> None:
    config, script = dump(p.experiment), p.job().script  # first: what cannot be written or built prints nothing
    print(f"# model: {p.model.architecture}, {p.model.num_parameters() / 1e6:,.1f}M parameters")
    print("# resolved experiment\n" + config)
    print(f"# each task runs: {p.spec.task_command}")
    print("# sbatch script\n" + script, end="")


def _resume(args: argparse.Namespace, argv: list[str]) -> int:
    given = [f for f in ("--config", "--cluster", "--set", "--nodes")
             if any(a == f or a.startswith(f + "=") for a in argv)] + (["KEY=VALUE overrides"] if args.overrides else [])
    if given:
        raise ConfigError(f"--resume relaunches the run folder as it was (its config.yaml and cluster.yaml); it takes no "
                          f"{', '.join(given)}: start a new run with --config instead")
    p, root = api.resume(args.resume)
    _warn(p)
    if args.dry_run:  # what submit_resumed checks, short of submitting
        api.refuse_if_running(p, root)
        check_writable(root, dry_run=True)
        _show(p)
        return 0
    job = api.submit_resumed(p, root)
    print(f"submitted {job.job_id}: {p.spec.run_dir}, resuming from its latest checkpoint "
          f"(mcorekit logs {job.job_id} --follow)")
    return 0


def main_sweep(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="mcorekit launch sweep",
                                     description="A grid over config keys, submitted as one Slurm job array.")
    _experiment_args(parser)
    _common(parser)
    parser.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,...", help="one axis of the grid (repeatable)")
    parser.add_argument("--max-parallel", type=count, default=None, help="at most this many array tasks run at once (>= 1)")
    args = parser.parse_args(argv)
    points, sweep_dir = api.prepare_sweep(args.config, args.cluster, api.parse_axes(args.grid), args.overrides,
                                          args.profile_overrides, nodes=args.nodes)
    for w in dict.fromkeys(w for p in points for w in p.warnings):  # each once, however many points share it
        print(f"mcorekit: warning: {w}", file=sys.stderr)
    if args.dry_run:
        check_writable(sweep_dir.parent, dry_run=True)
        for i, (p, values) in enumerate(zip(points, api.grid(api.parse_axes(args.grid)))):
            print(f"# point {i}: {_resolved(p, values)} -> {p.spec.run_dir}")
        print("# sbatch script\n" + api.sweep_job(points, sweep_dir, args.max_parallel).script, end="")
        return 0
    jobs = api.submit_sweep(points, sweep_dir, max_parallel=args.max_parallel)
    # the points' folder: sweep_dir, or the next free name if a launch of the same second took it (submit.claim)
    print(f"submitted array {jobs[0].job_id.split('_')[0]} with {len(jobs)} points: {points[0].spec.run_dir.parent}")
    return 0


def _resolved(p: api.Prepared, values: dict) -> str:
    """A sweep point's grid values as its resolved experiment holds them: optimizer.lr=0.0001 parallel.tp=2."""
    import json

    shown_values = []
    for key in values:
        node = p.experiment.model_dump(mode="json")
        for part in key.split("."):
            node = node[part]
        shown_values.append(f"{key}={json.dumps(node)}")
    return " ".join(shown_values)


def _check_chain_outputs(args: argparse.Namespace, ckpt: Path) -> None:
    """The later stages would refuse these only after training ran for hours: refuse them at submission."""
    if args.engine_out and not (args.export_out and targets.TARGETS[args.export_target].builds_engines):
        raise ConfigError("--engine-out needs --export-out and --export-target engine (engines are built from the export)")
    outputs = [("--hf-out", args.hf_out), ("--export-out", args.export_out), ("--engine-out", args.engine_out)]
    named = [(flag, Path(v)) for flag, v in outputs if v is not None]
    for flag, path in named:
        if problem := text_problem(str(path)):
            raise ConfigError(f"{flag} {shown(path)} {problem}; choose another path")
        if path.exists() or path.is_symlink():
            raise ConfigError(f"{flag} {path} exists; the chain's stages do not replace outputs: choose a new path or remove it")
    from mcorekit.outputs import overlaps

    inputs = [("the training checkpoints", ckpt)] + named
    for i, (flag, path) in enumerate(named):
        for what, other in inputs[: i + 1]:  # each output against the checkpoints and the outputs before it
            if overlaps(path, other):
                raise ConfigError(f"{flag} {path} overlaps {what} {other}; a stage must not write into its own input")


def _chain_stages(p: api.Prepared, args: argparse.Namespace, ckpt: str) -> list[api.Stage]:
    """train -> convert [-> export [-> engine]]; the later stages are CPU jobs, except the engine build."""
    name = p.experiment.name
    stages = [api.training_stage(p),
              api.Stage(f"{name}-convert", api.cli_payload(["convert", "mcore-to-hf", ckpt, args.hf_out]), gpus_per_node=0)]
    if args.export_out:
        export = ["export", "trtllm", args.hf_out, args.export_out, "--target", args.export_target]
        stages.append(api.Stage(f"{name}-export", api.cli_payload(export), gpus_per_node=0))
        if targets.TARGETS[args.export_target].builds_engines and args.engine_out:  # trtllm-build: one process on the profile's GPUs
            engine = ["export", "engine", args.export_out, args.engine_out]
            stages.append(api.Stage(f"{name}-engine", api.cli_payload(engine), tasks_per_node=1))
    return stages


def main_chain(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="mcorekit launch chain",
                                     description="Submit train -> convert (to HF) -> export (TensorRT-LLM) as dependent jobs "
                                     "(afterok, --kill-on-invalid-dep=yes).")
    _experiment_args(parser)
    _common(parser)
    parser.add_argument("--hf-out", type=nonempty, required=True,
                        help="where the convert stage writes the HF checkpoint")
    parser.add_argument("--export-out", type=nonempty, default=None,
                        help="where the export stage writes the TensorRT-LLM checkpoint")
    parser.add_argument("--export-target", choices=targets.NAMES, default="pytorch",
                        help="; ".join(f"{t.name}: {t.description}" for t in targets.TARGETS.values()))
    parser.add_argument("--engine-out", type=nonempty, default=None,
                        help="with --export-target engine: also build engines (a GPU job)")
    args = parser.parse_args(argv)
    p = api.load(args.config, args.cluster, args.overrides, args.profile_overrides, args.nodes)
    _warn(p)
    for flag in ("hf_out", "export_out", "engine_out"):  # the stages run in another working directory
        if getattr(args, flag) is not None and not text_problem(getattr(args, flag)):
            setattr(args, flag, api.absolute(getattr(args, flag), f"--{flag.replace('_', '-')}"))
    ckpt = p.experiment.checkpoint.dir or str(p.spec.run_dir / "checkpoints")
    _check_chain_outputs(args, Path(ckpt))
    stages = _chain_stages(p, args, ckpt)
    api.check_job_name(args.config, p.experiment.name, max((s.name for s in stages), key=len), "a chain")
    if args.dry_run:
        check_writable(p.spec.run_dir.parent, dry_run=True)
        print(f"# afterok:{api.UNSUBMITTED_PARENT} stands for the job id of the stage before, known once it is submitted")
        for stage, job in zip(stages, api.chain_jobs(p.profile, stages, p.spec.run_dir)):
            print(f"# stage {stage.name}: {job.spec.task_command}")
            print(job.script, end="")
        return 0
    api.require_gpus(p.profile)
    jobs = api.submit_chain(p.profile, stages, p.spec.run_dir, save=p.save)
    print("submitted chain: " + " -> ".join(f"{s.name} {j.job_id}" for s, j in zip(stages, jobs)))
    return 0


def main_plan(argv: list[str]) -> int:
    from mcorekit.launch.plan import main

    return main(argv)


def main_smoke(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False,
        prog="mcorekit launch smoke",
        description="Run a one-minute job that forms a torch.distributed group over all tasks and all-reduces; "
        "proves a cluster profile end to end before spending GPU hours.",
    )
    _common(parser)
    parser.add_argument("--nodes", type=count, default=1, help="nodes to span, every task of each joining the all-reduce "
                        "(default: 1)")
    args = parser.parse_args(argv)
    profile = load_profile(args.cluster, args.profile_overrides)
    for w in literal_env_warnings(profile):
        print(f"mcorekit: warning: {w}", file=sys.stderr)
    built = api.smoke_job(profile, args.nodes)
    if args.dry_run:
        check_writable(built.spec.run_dir.parent, dry_run=True)
        print(built.script, end="")
        return 0
    from mcorekit.launch.smoke import allreduce_check

    job = submit_one(built, allreduce_check, kind="smoke")
    print(f"submitted smoke job {job.job_id}; logs in {built.spec.run_dir / 'logs'}", flush=True)
    state = _wait_showing_state(job)
    if state != "COMPLETED":
        raise LaunchError(f"smoke job {job.job_id} ended {state}; its logs say why: mcorekit logs {job.job_id} --stderr "
                          f"--runs {shown(built.spec.run_dir.parent)}")
    results = job.results()
    ok = all(r["sum"] == r["expected"] for r in results)
    first = results[0]
    print(f"smoke job {job.job_id}: {first['world_size']} tasks, backend {first['backend']}, all-reduce sum "
          f"{first['sum']:g} (expected {first['expected']:g}) -> {'OK' if ok else 'WRONG'}")
    return 0 if ok else 1


def _wait_showing_state(job: Any, poll_s: float = 1.0) -> str:
    """Wait for the job to end, printing one line each time Slurm reports a new state (PENDING, RUNNING, ...);
    the final state."""
    import time

    from mcorekit.launch.accounting import job_record

    shown_state = None
    while True:
        rec = job_record(job.job_id)
        state = rec.state if rec else "SUBMITTED"  # not in Slurm's answers yet
        if state != shown_state:
            print(f"smoke job {job.job_id}: {state}", flush=True)
            shown_state = state
        if rec is not None and rec.final:
            return rec.state
        time.sleep(poll_s)


SUBCOMMANDS = {"sweep": main_sweep, "chain": main_chain, "plan": main_plan, "smoke": main_smoke}


def main(command: str, argv: list[str]) -> int:
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    return main_train(argv)


if __name__ == "__main__":
    sys.exit(main("launch", sys.argv[1:]))
