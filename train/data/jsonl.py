"""JSON-lines input read defensively: bounded line length, UTF-8 checked, one JSON object per line, and every
problem reported as `FILE:LINE: what is wrong` (a ConfigError: one line from the CLI, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from mcorekit.errors import ConfigError, first_line

MAX_LINE_MB = 16  # one document per line: a book is 1-2 MB; tokenizing a line takes ~70x its size in RAM


def raw_lines(path: Path, max_line_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of every line, blank ones included; a line longer than the limit is refused before
    it is read whole."""
    with open(path, "rb") as f:
        lines = iter(lambda: f.readline(max_line_bytes + 1), b"")
        n = 0
        while True:
            try:
                line = next(lines)
            except StopIteration:
                return
            except OSError as e:  # a read that fails has no file name of its own: name the input
                raise ConfigError(f"{path}: cannot read line {n + 1}: {e.strerror or e}") from None
            n += 1
            if len(line) > max_line_bytes:
                raise ConfigError(f"{path}:{n}: line longer than {max_line_bytes / 1024**2:g} MB; split the "
                                  f"document or raise the limit (--max-line-mb)")
            yield n, line


def json_object(raw: bytes, where: str) -> dict[str, Any] | None:
    """The JSON object of one line, or None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start}); JSON lines must be UTF-8") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ConfigError(f"{where}: not valid JSON ({first_line(e)})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, got a JSON {_json_type(record)}")
    return record


LONE_SURROGATE = "holds a lone UTF-16 surrogate escape (\\uD800-\\uDFFF without its pair), which is not text"


def has_lone_surrogate(value: Any) -> bool:
    """Whether a JSON value holds, at any depth, a string that tokenizers refuse: one with a lone surrogate. Walked
    with a stack, not recursion: json.loads accepts deeper nesting than Python's recursion limit leaves here."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")  # at C speed: only a surrogate makes it fail
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def refuse_lone_surrogates(values: list[Any], where: str) -> None:
    """The fields a reader tokenizes, refused in one line if one holds a lone surrogate (tokenizers raise a
    TypeError on it)."""
    if has_lone_surrogate(values):
        raise ConfigError(f"{where}: {LONE_SURROGATE}; fix or drop the line")


def text_problem(text: str, raw: bytes) -> str | None:
    """Why a string read from JSON line `raw` cannot be tokenized, or None: a \\uD800-\\uDFFF escape without its pair
    (a pair is one character) decodes to a lone surrogate, which is not text. Looked for only where the line has such
    an escape, so other lines cost nothing."""
    if b"\\ud" not in raw and b"\\uD" not in raw:
        return None
    return LONE_SURROGATE if has_lone_surrogate(text) else None


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")


def records(path: Path, max_line_bytes: int = MAX_LINE_MB * 1024**2) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line."""
    for n, raw in raw_lines(path, max_line_bytes):
        record = json_object(raw, f"{path}:{n}")
        if record is not None:
            yield n, record
