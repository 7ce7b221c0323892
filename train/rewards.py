"""Reward functions for GRPO (train/tasks/grpo.py): plain Python functions `function(prompt, completion, **fields)
-> float`, where `fields` are the prompt record's other jsonl fields (e.g. `answer`) plus the reward's own
`kwargs` from the experiment.

A reward is named in the experiment as `module:function` (a module importable from sys.path, e.g.
`mcorekit.train.rewards:math_answer`) or `path/to/file.py:function` (a file, relative to the working directory like
data.paths). A failing reward stops training with one line that says which function, on which prompt, and what it
raised; a reward that returns something other than a finite number does too.

Provided here:
  math_answer    1.0 when the last number in the completion equals the `answer` field (1,234 and 1234.0 count as 1234)
  format_match   1.0 when the completion (stripped) matches the regex `pattern` (a kwarg) as a whole
  exact_match    1.0 when the completion (stripped) equals the `answer` field (stripped)
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mcorekit.config.loading import short_repr
from mcorekit.errors import ConfigError

RewardFn = Callable[..., float]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardError(ConfigError):
    """A reward function could not be loaded, raised, or returned something that is not a finite number."""


# ---------------------------------------------------------------- provided rewards


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def math_answer(prompt: str, completion: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the last number in the completion equals `answer` (a number or a numeric string), else 0.0."""
    if answer is None:
        raise ValueError("math_answer needs an 'answer' field in the prompt record")
    want = last_number(str(answer))
    if want is None:
        raise ValueError(f"math_answer: the answer field {answer!r} holds no number")
    got = last_number(completion)
    return float(got is not None and math.isclose(got, want, rel_tol=0.0, abs_tol=1e-6))


def format_match(prompt: str, completion: str, pattern: str | None = None, **_: Any) -> float:
    """1.0 when the stripped completion matches the regular expression `pattern` as a whole (re.fullmatch, DOTALL)."""
    if pattern is None:
        raise ValueError("format_match needs a 'pattern' (give it in the reward's kwargs)")
    return float(re.fullmatch(pattern, completion.strip(), flags=re.DOTALL) is not None)


def exact_match(prompt: str, completion: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the stripped completion equals the stripped `answer`, else 0.0."""
    if answer is None:
        raise ValueError("exact_match needs an 'answer' field in the prompt record")
    return float(completion.strip() == str(answer).strip())


# ---------------------------------------------------------------- loading and calling


def load_function(spec: str) -> RewardFn:
    """The callable `spec` names: 'module:function' (imported from sys.path) or 'path/to/file.py:function'."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise RewardError(f"reward function {spec!r} must be 'module:function' or 'path/to/file.py:function'")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _module_from_file(Path(where), spec)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:  # noqa: BLE001  (an import runs arbitrary code: any error is the module's)
            raise RewardError(f"reward function {spec!r}: cannot import module {where!r}: {type(e).__name__}: "
                              f"{_one_line(e)}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardError(f"reward function {spec!r}: {where} has no attribute {name!r}")
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: {name} is a {type(fn).__name__}, not a function")
    return fn


def _module_from_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise RewardError(f"reward function {spec!r}: file not found: {path} (relative paths are read from the "
                          f"working directory {Path.cwd()})")
    resolved = path.resolve()
    key = "mcorekit_reward_" + hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    if key in sys.modules:
        return sys.modules[key]
    loader_spec = importlib.util.spec_from_file_location(key, resolved)
    if loader_spec is None or loader_spec.loader is None:
        raise RewardError(f"reward function {spec!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[key] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        del sys.modules[key]
        raise RewardError(f"reward function {spec!r}: {path} failed to import: {type(e).__name__}: "
                          f"{_one_line(e)}") from None
    return module


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _finite(value: object) -> bool:
    """A number a float holds finitely (bool is an int: True = 1.0; 10**400 is an int no float holds)."""
    try:
        return isinstance(value, (int, float)) and math.isfinite(float(value))
    except OverflowError:
        return False


def _shown(text: str, limit: int = 120) -> str:
    short = text if len(text) <= limit else text[: limit - 3] + "..."
    return repr(short)


@dataclass
class Reward:
    spec: str
    weight: float
    fn: RewardFn
    kwargs: dict[str, Any] = field(default_factory=dict)


class Rewards:
    """The experiment's weighted reward functions; score() returns their weighted sum and each one's value."""

    def __init__(self, rewards: list[tuple[str, float, dict[str, Any]]]) -> None:
        if not rewards:
            raise RewardError("no reward functions: give at least one grpo.rewards entry")
        self.rewards = [Reward(spec, weight, load_function(spec), dict(kwargs)) for spec, weight, kwargs in rewards]

    @classmethod
    def of(cls, configs: list[Any]) -> Rewards:
        """From the experiment's grpo.rewards (RewardConfig: function, weight, kwargs)."""
        return cls([(c.function, c.weight, c.kwargs) for c in configs])

    @property
    def names(self) -> list[str]:
        return [r.spec.rpartition(":")[2] for r in self.rewards]

    def score(self, prompt: str, completion: str, fields: dict[str, Any]) -> tuple[float, list[float]]:
        values = []
        for r in self.rewards:
            try:
                value = r.fn(prompt, completion, **{**fields, **r.kwargs})
            except (Exception, SystemExit) as e:  # noqa: BLE001  (the user's code: report what it raised and where)
                raise RewardError(f"reward {r.spec} raised {type(e).__name__} on prompt {_shown(prompt)}: "
                                  f"{_one_line(e)}") from None
            if not _finite(value):
                raise RewardError(f"reward {r.spec} returned {short_repr(value, 60)} on prompt {_shown(prompt)}; a "
                                  f"reward must return a finite float")
            values.append(float(value))
        return sum(r.weight * v for r, v in zip(self.rewards, values)), values
