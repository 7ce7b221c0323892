"""Known, harmless notices of the libraries we build on, filtered by their exact text and origin so that a user
sees our output and the warnings that matter. Nothing is blanket-silenced: our own warnings and any unknown ones
still show. `install()` is called once by each entry point (the CLI, `python -m mcorekit.train`, the Slurm payload)."""

from __future__ import annotations

import logging
import re
import warnings

# (category, message regex, module regex of the code that warns)
KNOWN_WARNINGS: list[tuple[type[Warning], str, str]] = [
    (UserWarning, r"(Transformer Engine and )?Apex (are|is) not installed", r".*megatron"),
    (UserWarning, r"full scope is deprecated", r".*megatron"),
    (UserWarning, r"MimoModelConfig is experimental", r".*megatron"),
    (SyntaxWarning, r"invalid escape sequence", r".*megatron"),  # compiling Megatron-Core's docstrings
    (RuntimeWarning, r"Detected a Jax installation", r".*transformer_engine"),
    (UserWarning, r"barrier\(\): using the device under current context", r".*torch"),
    (FutureWarning, r"`torch_dtype` is deprecated", r".*transformers"),
]
# Megatron-Core's log lines at WARNING that describe its own roadmap, not the user's run
# (and torch's notice, on machines without CUDA, that it would build extensions against CUDA_HOME)
KNOWN_LOG_LINES = re.compile(
    r"GPTModel IS DEPRECATED|MCore's async save is deprecated|full_param_layout not provided|"
    r"Implicit initialization of Rerun State Machine|RerunStateMachine initialized in mode|No CUDA runtime is found")
OWN_HANDLERS = ("torch.utils.cpp_extension",)  # loggers that print through a handler of their own


class _DropKnown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith(("megatron", "torch")) and KNOWN_LOG_LINES.search(record.getMessage()))


def install() -> None:
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    drop = _DropKnown()
    # Filters on the handlers that print: records of Megatron's child loggers reach them without passing through
    # any filter set on a parent logger. lastResort prints when nothing is configured.
    for handler in [*logging.getLogger().handlers, logging.lastResort]:
        if handler is not None and not any(isinstance(f, _DropKnown) for f in handler.filters):
            handler.addFilter(drop)
    for name in OWN_HANDLERS:  # a filter on the logger itself sees the records it creates
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(drop)
