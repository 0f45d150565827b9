"""Lightning's checkpoint plugin over aah's atomic writer (``aah_lightning/atomic.py``).

``AtomicCheckpointIO`` is the CLI's checkpoint plugin: it saves through ``atomic_torch_save`` (a kill never leaves a
half-written checkpoint; a full disk is one line) and loads through ``aah_lightning.checkpoint.load_checkpoint_file``
(a complete PyTorch archive whose CRC32 checksums match, unpickled with ``weights_only=True`` unless the user passes
``--weights_only false``; every failure is a one-line ``ConfigError`` naming the file). FSDP2's checkpoint folders
get the same guarantee from ``lit/fsdp2_saves.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch.plugins.io import TorchCheckpointIO

from aah_lightning.atomic import atomic_torch_save
from aah_lightning.checkpoint import is_remote, load_checkpoint_file


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint plugin with crash-safe saving and verified, weights-only loading."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options!r}")
        if is_remote(path):  # object stores have their own atomic put
            return super().save_checkpoint(checkpoint, path)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(
        self,
        path,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        return load_checkpoint_file(path, map_location=map_location, weights_only=weights_only)
