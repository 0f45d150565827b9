"""aah: Asymmetric Attention Heads for GPT training on PyTorch Lightning.

The public names, imported on first use (``import aah_lightning`` itself loads nothing else)::

    from aah_lightning import load_model

    model, tokenizer = load_model("runs/quickstart/checkpoints/last.ckpt")  # the GPT with its window table
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "read_checkpoint": "aah_lightning.checkpoint",
    "load_model": "aah_lightning.checkpoint",
    "GPT": "aah_lightning.model.gpt",
    "GPTConfig": "aah_lightning.model.config",
    "AAHModule": "aah_lightning.lit.module",
    "TextDataModule": "aah_lightning.lit.datamodule",
    "AAHConfig": "aah_lightning.windows.config",
    "ConfigError": "aah_lightning.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
