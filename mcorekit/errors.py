"""One error type per part. The CLI prints any of them as a single line and exits 2."""


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
