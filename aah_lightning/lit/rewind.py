"""Calibrate-and-rewind (``model.aah.controller.schedule.rewind``): at the policy's first decision the run goes back
to its initial weights and keeps the table that decision chose.

The policy says at which step (``WindowPolicy.rewind_step``); ``Rewind`` does the rest for the LightningModule:

* it keeps a copy of the parameters as they were when training started at step 0 (after ``model.init_from`` was
  loaded), in memory and in every checkpoint saved before the rewind, so a run resumed before the rewind goes back
  to the same weights;
* at that step, after the policy has set its table and before the step's forward, it puts them back, clears the
  optimizer's state (Adam's moments and step counts start again, as in a fresh optimizer) and restarts the
  learning-rate schedule from that step (``lr_origin``), warmup included;
* the data goes on where it is (the calibration's batches are spent, not replayed), and the calibration's steps and
  their attention cost count in the run's: the run's length and budget are those of a run without calibration.

Under DDP every rank holds the same parameters at step 0, so every rank rewinds to the same weights. Under FSDP2 a
rank would keep only its shards and the checkpoint's copy would be a second distributed state: refused in ``check``.
"""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from aah_lightning.errors import ConfigError

REWIND_KEY = "aah_rewind_initial"  # the initial parameters, by name, in checkpoints saved before the rewind


class Rewind:
    """The rewind at optimizer step ``step`` (None: the policy never rewinds)."""

    def __init__(self, step: int | None):
        self.step = step
        self.initial: dict[str, torch.Tensor] | None = None  # by parameter name, until the rewind

    def lr_origin(self, step: int) -> int:
        """The step the learning-rate schedule counts from at ``step``: the rewind's once it happened, else 0."""
        return self.step if self.step is not None and step >= self.step else 0

    def check(self, strategy) -> None:
        """One line before training under a strategy that shards parameters."""
        from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: PLC0415 - the check needs it only

        if self.step is not None and isinstance(strategy, ModelParallelStrategy):
            raise ConfigError(
                "model.aah.controller.schedule.rewind=true is not supported under FSDP2 (ModelParallelStrategy): the "
                "initial weights it goes back to are kept whole on every rank; use DDP or one device"
            )

    def start(self, model: nn.Module, global_step: int) -> None:
        """Training starts at ``global_step``: at step 0, copy the initial parameters; a run resumed before the rewind
        has them from its checkpoint (``load``)."""
        if self.step is None or global_step > self.step or self.initial is not None:
            return
        if global_step > 0:
            raise ConfigError(
                f"the checkpoint was saved at step {global_step}, before the rewind at step {self.step} "
                f"(model.aah.controller.schedule.rewind), but holds no initial weights to go back to: resume from a "
                f"checkpoint this setting wrote, or start the run again"
            )
        self.initial = {name: p.detach().clone() for name, p in model.named_parameters()}

    def due(self, global_step: int) -> bool:
        return self.initial is not None and global_step == self.step

    @torch.no_grad()
    def apply(self, model: nn.Module, optimizers, schedulers) -> None:
        """Put the initial parameters back, clear the optimizers' state and set this step's learning rate from the
        restarted schedule."""
        for name, p in model.named_parameters():
            p.copy_(self.initial[name])
        for optimizer in optimizers:
            optimizer.state.clear()
        for scheduler in schedulers:  # LambdaLR: the factor of this step, now counted from the rewind
            for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
                group["lr"] = base * factor(scheduler.last_epoch)
        self.initial = None
        rank_zero_info(
            f"aah: calibrate-and-rewind at step {self.step}: weights back to step 0's, optimizer state cleared, "
            f"learning-rate schedule restarted; training goes on with the table the calibration chose"
        )

    def save(self, checkpoint: dict) -> None:
        if self.initial is not None:
            checkpoint[REWIND_KEY] = {name: t.detach().cpu().clone() for name, t in self.initial.items()}

    def load(self, checkpoint: dict) -> None:
        saved = checkpoint.get(REWIND_KEY)
        self.initial = None if saved is None else dict(saved)
