"""One exception type for bad user input.

Every check of a setting raises ``ConfigError`` with a message that names the setting, the bad value and what is
allowed. The CLI turns it into a single line on stderr and a non-zero exit, before any compute is spent.
"""


class ConfigError(ValueError):
    """A setting (config value, file, checkpoint) the run cannot use."""


def require(condition: bool, setting: str, value, allowed: str) -> None:
    """Raise ``ConfigError`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{setting}={value!r} is not allowed: {allowed}")


class TrainingDiverged(RuntimeError):
    """The loss (or the parameters) became NaN/Inf; training stopped before anything poisoned was saved."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the previous checkpoint is untouched."""
