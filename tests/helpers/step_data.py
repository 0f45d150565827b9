"""Training data whose batch is a function of the optimizer step only, and a quiet CPU Trainer: for tests that compare
a resumed run with an uninterrupted one (the data module starts at the step the run resumes from, so the test is
about the state that travels through checkpoints, not about how the text data module finds its position)."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
from torch.utils.data import DataLoader, IterableDataset


class StepBatches(IterableDataset):
    """``batch_of(step)`` for the steps ``start .. steps - 1``."""

    def __init__(self, batch_of: Callable[[int], dict], start: int, steps: int):
        self.batch_of, self.start, self.steps = batch_of, start, steps

    def __iter__(self):
        for step in range(self.start, self.steps):
            yield self.batch_of(step)


class StepData(L.LightningDataModule):
    """The batches of ``batch_of``, from the trainer's step (0, or the step a resumed run continues from)."""

    def __init__(self, batch_of: Callable[[int], dict], steps: int):
        super().__init__()
        self.batch_of, self.steps = batch_of, steps

    def train_dataloader(self):
        return DataLoader(StepBatches(self.batch_of, self.trainer.global_step, self.steps), batch_size=None)


def quiet_trainer(max_steps: int, callbacks: list) -> L.Trainer:
    """One CPU device, no logger, checkpoints, progress bar, summary or validation."""
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
