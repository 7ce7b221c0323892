"""What a value may be in either schema (experiment, cluster profile): names, text without control characters,
Slurm times; and the strict base model both schemas build on.

These values end up in the sbatch script. Names are restricted; other values are quoted by the renderer, but a
newline or other control character could end a `#SBATCH` line early, so those are rejected.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from mcorekit.errors import ConfigError

# \Z, not $: `$` also matches before a final newline, so "debug\n" passed a .match and split its #SBATCH line
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# C0, DEL and C1 controls, and the line and paragraph separators: YAML folds NEL (U+0085), U+2028 and U+2029 into
# a line break, and a terminal may act on any of them
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Python reads bytes that are not UTF-8 (in argv, the environment, the current directory's name) as lone surrogates
# (\udcXX): such text cannot be written to a UTF-8 file, so a config.yaml holding it could not be read back
NOT_UTF8_RE = re.compile(r"[\ud800-\udfff]")


def text_problem(value: str) -> str | None:
    """What makes `value` unfit for one line of a setting, or for a UTF-8 file we write; None when nothing does."""
    if CONTROL_RE.search(value):
        return "contains a newline or control character"
    if NOT_UTF8_RE.search(value):
        return "is not UTF-8 (each \\udcXX stands for a byte that does not decode)"
    return None


def no_control(value: str, what: str) -> str:
    """`value` unchanged; a ValueError naming `what` when it holds a newline or other control character, or bytes
    that are not UTF-8."""
    if problem := text_problem(value):
        raise ValueError(f"{what} {value!r} {problem}; {'remove it' if CONTROL_RE.search(value) else 'use UTF-8'}")
    return value


def plain_argument(value: str, what: str) -> str:
    """no_control for what the command line gives (an override, a sweep axis): a ConfigError, not a ValueError."""
    try:
        return no_control(value, what)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def path_value(value: str | None, what: str, empty_hint: str = "give a path, or null to leave it unset") -> str | None:
    """A path field's value: None stays None (unset); an empty or blank path is refused, since it would silently
    mean the current directory."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"{what} is empty, which would mean the current directory; {empty_hint}")
    return no_control(value, what)


def shown(path: str | Path) -> str:
    """A path for a one-line message: as typed, or quoted with escapes when it holds a newline, a control character
    or bytes that are not UTF-8."""
    text = str(path)
    return repr(text) if text_problem(text) else text


class Strict(BaseModel):
    # NaN or infinity is never a meaningful setting (YAML reads `.nan` and `.inf` as floats)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# sbatch reads --time=MINUTES into a C int of seconds (time_str2secs: minutes x 60): more would overflow it
MAX_TIME_MINUTES = (2**31 - 1) // 60


def slurm_time(value: object) -> object:
    """A time field's value as Slurm reads it: a whole number is minutes (`time: 90`), text is checked here; any
    other type is left to the schema's own message."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        parse_time_minutes(value)
    return value


def parse_time_minutes(value: str) -> int:
    """Slurm time (MM, HH:MM:SS, D-HH:MM:SS, D-HH) -> whole minutes, rounded up."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(value).strip())
    if not m:
        raise ValueError(f"time {value!r} is not a Slurm time (use HH:MM:SS or D-HH:MM:SS)")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        secs = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # HH:MM:SS
        secs = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # MM:SS
        secs = int(a) * 60 + int(b)
    else:  # MM
        secs = int(a) * 60
    if secs <= 0:
        raise ValueError(f"time {value!r} must be positive")
    if -(-secs // 60) > MAX_TIME_MINUTES:
        raise ValueError(f"time {value!r} is longer than Slurm takes (at most {MAX_TIME_MINUTES} minutes, "
                         f"about 68 years)")
    return -(-secs // 60)
