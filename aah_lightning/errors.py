"""One exception type for bad user input.

Every check of a setting raises ``ConfigError`` with a message that names the setting, the bad value and what is
allowed. The CLI turns it into a single line on stderr and a non-zero exit, before any compute is spent.
"""

from __future__ import annotations

import warnings


class ConfigError(ValueError):
    """A setting (config value, file, checkpoint) the run cannot use."""


def require(condition: bool, setting: str, value, allowed: str) -> None:
    """Raise ``ConfigError`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{setting}={value!r} is not allowed: {allowed}")


def move_flat_setting(prefix: str, key: str, value, targets, stacklevel: int = 2) -> None:
    """Move the deprecated flat setting ``prefix.key`` into its blocks, with one deprecation line.

    ``targets`` are ``(block name, block settings, field, the field's default)``; a block whose field was set to
    another value as well is one ConfigError (the user gave both). Shared by ``data.*`` and ``model.aah.*``.
    """
    new = " and ".join(f"{prefix}.{block}.{name}" for block, _, name, _ in targets)
    warnings.warn(f"{prefix}.{key} is deprecated: write {new}", FutureWarning, stacklevel=stacklevel + 1)
    for block, settings, name, default in targets:
        nested = getattr(settings, name)
        if nested != default and nested != value:
            raise ConfigError(
                f"{prefix}.{key}={value!r} and {prefix}.{block}.{name}={nested!r} are both set: give only "
                f"{prefix}.{block}.{name}"
            )
        setattr(settings, name, value)


class TrainingDiverged(RuntimeError):
    """The loss (or the parameters) became NaN/Inf; training stopped before anything poisoned was saved."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the previous checkpoint is untouched. ``reason``:
    what went wrong, without the advice of the whole line (a command other than ``aah fit`` gives its own)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = message if reason is None else reason


class FolderTakenOver(CheckpointWriteError):
    """This run's checkpoint folder was taken over by another run (this one was stopped past its lock's heartbeat):
    it stops before its next save and writes nothing more there."""
