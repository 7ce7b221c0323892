"""`mcorekit`: one CLI for launch, status, logs, cancel, data, convert and export.

Every user-fixable problem is an MCoreKitError: printed as one line `mcorekit: error: ...`, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from mcorekit.errors import MCoreKitError, NotBuiltError

PARTS = {
    "launch": ("mcorekit.launch.cli", "turn an experiment YAML + cluster profile into a validated Slurm job"),
    "status": ("mcorekit.launch.jobs_cli", "table of this project's Slurm jobs"),
    "logs": ("mcorekit.launch.jobs_cli", "print (or follow) a job's logs"),
    "cancel": ("mcorekit.launch.jobs_cli", "cancel a job"),
    "data": ("mcorekit.train.data.cli", "prepare training data (jsonl -> Megatron .bin/.idx)"),
    "convert": ("mcorekit.convert.cli", "HF <-> Megatron checkpoint conversion and verification"),
    "export": ("mcorekit.export.cli", "Megatron/HF checkpoints to TensorRT-LLM"),
}


def dispatch(prog: str, doc: str | None, commands: dict[str, Callable[[list[str]], int]], argv: list[str]) -> int:
    """`mcorekit PART SUBCOMMAND ...`: run the subcommand, or print the part's help and exit 2."""
    if not argv or argv[0] not in commands:
        p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("subcommand", choices=list(commands))
        p.parse_args(argv[:1] or ["--help"])
        return 2
    return commands[argv[0]](argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = argparse.ArgumentParser(
        prog="mcorekit",
        description="Megatron-Core on Slurm: launch training, follow jobs, convert and export checkpoints.",
        epilog="Run `mcorekit COMMAND --help` for each command's options.",
    )
    top.add_argument("command", choices=list(PARTS), help=" | ".join(f"{k}: {v[1]}" for k, v in PARTS.items()))
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in PARTS:
        top.parse_args(argv[:1] or ["--help"])
        return 2
    command, rest = argv[0], argv[1:]
    module_name, _ = PARTS[command]
    try:
        import importlib

        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                raise NotBuiltError(f"`mcorekit {command}` is not built yet") from None
            raise
        return int(module.main(command, rest) or 0)
    except MCoreKitError as e:
        print(f"mcorekit: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0
    except OSError as e:  # a read-only or full filesystem, a vanished file: what and where, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"mcorekit: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mcorekit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
