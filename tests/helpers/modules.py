"""The Lightning module of a loaded checkpoint, for tests that compare what was trained with what a tool rebuilt."""

from __future__ import annotations

from aah_lightning.checkpoint import STATE_DICT_KEY, hyperparameters
from aah_lightning.lit.module import AAHModule


def module_of(checkpoint: dict) -> AAHModule:
    """Built from the checkpoint's hyperparameters (any layout), then given its weights and window table."""
    module = AAHModule(**hyperparameters(checkpoint))
    module.load_state_dict(checkpoint[STATE_DICT_KEY])
    return module
