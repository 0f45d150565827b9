"""A callback that records the model's weights as training starts and ends (given by class path to ``aah``
processes: ``--trainer.callbacks+=helpers.weights.Weights``)."""

from __future__ import annotations

import os

import lightning as L
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX


class Weights(L.Callback):
    """Saves ``{folder}/start_rank{r}.pt`` and ``{folder}/end_rank{r}.pt``: every parameter of the GPT when training
    starts and ends, whole (FSDP2's shards are gathered: every rank takes part), by its name in a checkpoint (without
    activation checkpointing's wrapper)."""

    def __init__(self, folder: str):
        self.folder = folder

    def _save(self, trainer, pl_module, when: str) -> None:
        weights = {}
        for name, p in pl_module.model.named_parameters():
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            weights[name.replace(_CHECKPOINT_PREFIX, "")] = whole.detach().cpu().clone()
        os.makedirs(self.folder, exist_ok=True)
        torch.save(weights, os.path.join(self.folder, f"{when}_rank{trainer.global_rank}.pt"))

    def on_train_start(self, trainer, pl_module):
        self._save(trainer, pl_module, "start")

    def on_train_end(self, trainer, pl_module):
        self._save(trainer, pl_module, "end")
