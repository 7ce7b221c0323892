"""One error type per part. The CLI prints any of them as a single line and exits 2."""

import unicodedata


class MCoreKitError(Exception):
    """A problem the user can fix; the message says what was wrong, where, and what to do."""


class ConfigError(MCoreKitError):
    """An experiment file, cluster profile or override is invalid."""


class LayoutError(ConfigError):
    """A parallel layout does not fit the model or the GPUs."""


class LaunchError(MCoreKitError):
    """Submitting, querying or cancelling a Slurm job failed."""


class ModelError(MCoreKitError):
    """A model description is unsupported or inconsistent."""


class ConversionError(MCoreKitError):
    """A checkpoint cannot be converted: unsupported, missing, truncated or inconsistent."""


class ExportError(MCoreKitError):
    """An export to TensorRT-LLM cannot be done as asked."""


class OutputError(MCoreKitError):
    """An output path is unsafe (it overlaps an input, or is not ours to replace) or cannot be written."""


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (library messages can span lines; ours print one), else its
    type's name; without Python's advice to raise its limit on an integer's digits (meant for the program)."""
    text = str(e).strip()
    return text.splitlines()[0].split("; use sys.set_int_max_str_digits")[0] if text else type(e).__name__


def one_line(e: BaseException) -> str | None:
    """What a command prints for an error that its input or the machine caused, in one line: our own errors; the
    OS's (a read-only or full filesystem, a vanished file), with the file; pathlib's symlink loop and unknown `~user`
    (RuntimeErrors raised inside pathlib). None for anything else: a bug, which keeps its traceback. Characters that
    would not print as themselves (a newline in a path) are shown escaped, as repr() does; the one exception is
    config.rules.listed's "\n  - ", which puts each of several problems on a line of its own."""
    line = _message(e)
    if line is None:
        return None
    return LISTED.join("".join(repr(c)[1:-1] if unicodedata.category(c) in BREAKING else c for c in part)
                       for part in line.split(LISTED))


BREAKING = ("Cc", "Zl", "Zp")  # control characters and line/paragraph separators: a space or joiner in a name stays


LISTED = "\n  - "  # the separator of several problems in one error (config.rules.listed)


def _message(e: BaseException) -> str | None:
    if isinstance(e, MCoreKitError):
        return str(e)
    if isinstance(e, OSError):
        return f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e)
    if isinstance(e, RuntimeError) and _raised_in_pathlib(e):
        if "home directory" in str(e):  # expanduser's message names no path
            return f"{e} (a path starts with ~ and a user name this machine does not know)"
        return str(e)
    return None


def _raised_in_pathlib(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return module.split(".")[0] in ("pathlib", "posixpath", "ntpath")
