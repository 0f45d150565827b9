"""A callback that records the model's weights as training starts (given by class path to ``aah`` processes:
``--trainer.callbacks+=helpers.weights.StartWeights``)."""

from __future__ import annotations

import os

import lightning as L
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX


class StartWeights(L.Callback):
    """Saves ``{folder}/rank{r}.pt``: every parameter of the GPT when training starts, whole (FSDP2's shards are
    gathered: every rank takes part), by its name in a checkpoint (without activation checkpointing's wrapper)."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_start(self, trainer, pl_module):
        weights = {}
        for name, p in pl_module.model.named_parameters():
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            weights[name.replace(_CHECKPOINT_PREFIX, "")] = whole.detach().cpu().clone()
        os.makedirs(self.folder, exist_ok=True)
        torch.save(weights, os.path.join(self.folder, f"rank{trainer.global_rank}.pt"))
