"""`mcorekit launch`: validate an experiment against a cluster profile, then print or submit its sbatch job.

  mcorekit launch --config EXP.yaml --cluster local [--nodes N] [--dry-run] [key.path=value ...]
  mcorekit launch smoke --cluster local [--nodes N] [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mcorekit.errors import NotBuiltError
from mcorekit.launch import config as cfg
from mcorekit.launch.submit import JobSpec, render, submit


def _run_dir(profile: cfg.ClusterProfile, name: str) -> Path:
    return Path(profile.run_root).resolve() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="local", help="profile name from slurm/clusters/ or a YAML path (default: local)")
    parser.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the experiment's resources.nodes)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and the exact sbatch script; submit nothing")
    parser.add_argument("--set", dest="profile_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a cluster-profile key, e.g. --set partition=batch (repeatable)")


def main_smoke(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mcorekit launch smoke",
        description="Run a one-minute job that forms a torch.distributed group over all tasks and all-reduces; "
        "proves a cluster profile end to end before spending GPU hours.",
    )
    _common(parser)
    args = parser.parse_args(argv)
    profile = cfg.load_profile(args.cluster, args.profile_overrides)
    spec = JobSpec(name="mcorekit-smoke", run_dir=_run_dir(profile, "smoke"), nodes=args.nodes or 1, time="00:05:00")
    if args.dry_run:
        print(render(profile, spec))
        return 0
    from mcorekit.launch.smoke import allreduce_check

    job = submit(profile, spec, allreduce_check, kind="smoke")
    print(f"submitted smoke job {job.job_id}; logs in {spec.run_dir / 'logs'}", flush=True)
    results = job.results()
    ok = all(r["sum"] == r["expected"] for r in results)
    first = results[0]
    print(f"smoke job {job.job_id}: {first['world_size']} tasks, backend {first['backend']}, all-reduce sum "
          f"{first['sum']:g} (expected {first['expected']:g}) -> {'OK' if ok else 'WRONG'}")
    return 0 if ok else 1


def main_train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mcorekit launch",
        description="Validate an experiment (layout vs nodes x GPUs, divisibility) and submit it as a Slurm job. "
        "Subcommands: `smoke` (cluster check).",
    )
    parser.add_argument("--config", required=True, help="experiment YAML")
    _common(parser)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="experiment overrides, e.g. parallel.tp=2")
    args = parser.parse_args(argv)
    experiment = cfg.load_experiment(args.config, args.overrides)
    profile = cfg.load_profile(args.cluster, args.profile_overrides)
    if args.nodes:
        experiment.resources.nodes = args.nodes
    spec = JobSpec(
        name=experiment.name, run_dir=_run_dir(profile, experiment.name), nodes=experiment.resources.nodes,
        time=experiment.resources.time, exclusive=experiment.resources.exclusive,
    )
    if args.dry_run:
        print("# resolved experiment\n" + cfg.dump(experiment))
        print("# sbatch script\n" + render(profile, spec))
        return 0
    raise NotBuiltError("training jobs need train/, which is not built yet; `--dry-run` shows the job that would be submitted")


def main(command: str, argv: list[str]) -> int:
    if argv and argv[0] == "smoke":
        return main_smoke(argv[1:])
    return main_train(argv)


if __name__ == "__main__":
    sys.exit(main("launch", sys.argv[1:]))
