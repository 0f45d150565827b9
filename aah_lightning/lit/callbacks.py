"""Callbacks that observe training: throughput and window diagnostics. Nothing here syncs on the hot path."""

from __future__ import annotations

import time

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from aah_lightning.aah import metrics


def host_window_table(pl_module) -> torch.Tensor:
    """The window table as a CPU tensor, from the planner's host mirror (read back only when the table changed)."""
    model = pl_module.model
    return torch.tensor(model.planner.rows(model.windows), dtype=torch.int64)


def tensorboard(trainer) -> TensorBoardLogger | None:
    return next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)


class Throughput(L.Callback):
    """``perf/tokens_per_sec``: training tokens (all ranks) per second of training wall time.

    Measured over windows of ``window`` optimizer steps, excluding validation; the value is shown in the progress bar.
    Wall-clock intervals need no per-step device sync: queued work is bounded, so the long-run rate is exact.
    """

    def __init__(self, window: int = 10):
        self.window = window
        self._reset()

    def _reset(self):
        self._t0 = None
        self._tokens = 0
        self._steps = 0
        self.tokens_per_sec = None

    def on_train_start(self, trainer, pl_module):
        self._reset()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        tokens = batch["tokens"]
        self._tokens += (tokens.shape[1] - 1) * tokens.shape[0] * trainer.world_size
        self._steps += 1
        if self._steps >= self.window:
            if tokens.is_cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.tokens_per_sec = self._tokens / max(now - self._t0, 1e-9)
            self._t0, self._tokens, self._steps = now, 0, 0
        if self.tokens_per_sec is not None:
            pl_module.log("perf/tokens_per_sec", self.tokens_per_sec, prog_bar=True, on_step=True, on_epoch=False)

    def on_validation_start(self, trainer, pl_module):
        self._t0, self._tokens, self._steps = None, 0, 0  # restart the window after validation


class WindowDiagnostics(L.Callback):
    """``aah/acr``, ``aah/causal_coverage`` and the histogram ``aah/windows``, on rank 0.

    Logged every ``every_n_steps`` optimizer steps and whenever the window table changes. The table is read from the
    attention planner's host mirror, so this costs no device sync.
    """

    def __init__(self, every_n_steps: int = 50):
        self.every_n_steps = every_n_steps
        self._last_table = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.is_global_zero or trainer.logger is None:
            return
        step = trainer.global_step
        table = host_window_table(pl_module)
        changed = self._last_table is None or not torch.equal(table, self._last_table)
        if not changed and step % self.every_n_steps != 0:
            return
        self._last_table = table
        self.log_table(trainer, pl_module, table, step)

    def log_table(self, trainer, pl_module, table: torch.Tensor, step: int) -> None:
        seq_len = pl_module.gpt_config.seq_len
        values = {
            "aah/acr": float(metrics.acr(table, seq_len)),
            "aah/causal_coverage": float(metrics.causal_coverage(table, seq_len)),
        }
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)
        tb = tensorboard(trainer)
        if tb is not None:
            tb.experiment.add_histogram("aah/windows", table.flatten(), global_step=step)
