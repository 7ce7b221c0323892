"""`mcorekit`: one CLI for launch, status, logs, cancel, data, convert and export.

Every user-fixable problem is an MCoreKitError: printed as one line `mcorekit: error: ...`, exit code 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable

from mcorekit import quiet
from mcorekit.errors import MCoreKitError, one_line

PARTS = {
    "launch": ("mcorekit.launch.cli", "turn an experiment YAML + cluster profile into a validated Slurm job"),
    "status": ("mcorekit.launch.jobs_cli", "table of this project's Slurm jobs"),
    "logs": ("mcorekit.launch.jobs_cli", "print (or follow) a job's logs"),
    "cancel": ("mcorekit.launch.jobs_cli", "cancel a job"),
    "data": ("mcorekit.train.data.cli", "prepare training data (jsonl -> Megatron .bin/.idx)"),
    "convert": ("mcorekit.convert.cli", "HF <-> Megatron checkpoint conversion and verification"),
    "export": ("mcorekit.export.cli", "Megatron/HF checkpoints to TensorRT-LLM"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help shows its default, except where there is none to show (flags, unset options)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _parser(prog: str, description: str | None, commands: dict[str, str]) -> argparse.ArgumentParser:
    """A parser that only names the commands: each command parses its own options (imported only when run)."""
    listing = "\n".join(f"  {name:<14}{text}" for name, text in commands.items())
    p = argparse.ArgumentParser(allow_abbrev=False, prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"commands:\n{listing}\n\nRun `{prog} COMMAND --help` for each command's options.")
    p.add_argument("command", metavar="COMMAND", choices=list(commands), help="one of the commands below")
    return p


def _choose(p: argparse.ArgumentParser, argv: list[str]) -> int | None:
    """None when argv names a command; else the exit code after help (0) or a usage error (2: no or unknown command)."""
    if not argv:
        p.print_usage(sys.stderr)
        names = next(a.choices for a in p._actions if a.dest == "command")
        print(f"{p.prog}: error: a command is required (one of: {', '.join(names)})", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        p.print_help()
        return 0
    if argv[0].startswith("-"):  # argparse would only say that COMMAND is missing
        p.print_usage(sys.stderr)
        print(f"{p.prog}: error: unknown option {argv[0]}; a command comes first, its options after it "
              f"(`{p.prog} COMMAND --help`)", file=sys.stderr)
        return 2
    try:
        p.parse_args(argv[:1])
    except SystemExit as e:
        return int(e.code or 0)
    return None


def dispatch(prog: str, doc: str | None, commands: dict[str, Callable[[list[str]], int]], argv: list[str],
             helps: dict[str, str] | None = None) -> int:
    """`mcorekit PART SUBCOMMAND ...`: run the subcommand; help exits 0, a missing or unknown subcommand exits 2."""
    p = _parser(prog, doc, {name: (helps or {}).get(name, "") for name in commands})
    code = _choose(p, argv)
    return code if code is not None else commands[argv[0]](argv[1:])


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("mcorekit")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # this process is the `mcorekit` command: torch & co. from cached bytecode where they have none
        from mcorekit.caches import use_bytecode_cache

        use_bytecode_cache()
    argv = sys.argv[1:] if argv is None else argv
    quiet.install()
    if argv[:1] == ["--version"]:
        print(f"mcorekit {version()}")
        return 0
    top = _parser("mcorekit", "Megatron-Core on Slurm: launch training, follow jobs, convert and export checkpoints.",
                  {name: text for name, (_, text) in PARTS.items()})
    top.add_argument("--version", action="store_true", help="print the version and exit")
    code = _choose(top, argv)
    if code is not None:
        return code
    command, rest = argv[0], argv[1:]
    module_name, _ = PARTS[command]
    try:
        import importlib

        module = importlib.import_module(module_name)
        code = int(module.main(command, rest) or 0)
        sys.stdout.flush()  # a pipe's buffered output is written here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:  # output piped into head & co., which stopped reading
        for stream in (sys.stdout, sys.stderr):  # the pipe may be either: what it still buffers goes nowhere
            try:
                stream.flush()
            except BrokenPipeError:
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
            except (AttributeError, OSError, ValueError):  # closed, or none: nothing to write
                pass
        # not 0: the command may have stopped before its work (a launch before sbatch); 141 = 128 + SIGPIPE, what a
        # shell reports for a tool that SIGPIPE ended, so `set -o pipefail` treats mcorekit as any other tool
        return 128 + signal.SIGPIPE
    except (MCoreKitError, OSError, RuntimeError) as e:  # bad input or the machine's state: one line, no traceback
        if (line := one_line(e)) is None:
            raise  # a bug: its traceback
        print(f"mcorekit: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mcorekit: interrupted", file=sys.stderr)
        return 130
    except (EOFError, ValueError) as e:  # marshal's, on bytecode cut short in our cache folder: said, and removed
        from mcorekit.caches import damaged_cache_line

        if (line := damaged_cache_line(e)) is None:
            raise
        print(f"mcorekit: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
