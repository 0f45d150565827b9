"""Callbacks that observe training: throughput / MFU here, window diagnostics in lit/diagnostics.py (tags:
docs/tensorboard.md), and the progress bar.

Nothing here syncs with the device on the training hot path. The window table is read from the attention planner's
host mirror (read back only when the table changed, which the forward has already done); everything else runs at
log steps, diagnostic steps or when the table changes.
"""

from __future__ import annotations

import time
import warnings
from typing import Optional

import lightning as L
import rich  # noqa: F401  # RichProgressBar draws with rich: imported here so that the dependency is explicit
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities import rank_zero_warn

from aah_lightning import progress
from aah_lightning.data.batch import seq_len_of
from aah_lightning.errors import require
from aah_lightning.lit import flops


def host_rows(pl_module) -> list[tuple[int, ...]]:
    """The window table as rows of ints, from the planner's host mirror (the same list until the table changes)."""
    model = pl_module.model
    return model.planner.rows(model.windows)


def host_window_table(pl_module) -> torch.Tensor:
    """The window table as a CPU int64 tensor, from the planner's host mirror."""
    return torch.tensor(host_rows(pl_module), dtype=torch.int64)


def compute_dtype(precision) -> torch.dtype:
    """The matmul dtype of a Lightning precision setting ("bf16-mixed" -> bfloat16, "32-true" -> float32, ...)."""
    p = str(precision)
    if p.startswith("bf16"):
        return torch.bfloat16
    if p.startswith("16") or p.startswith("transformer-engine"):
        return torch.float16
    if p.startswith("64"):
        return torch.float64
    return torch.float32


def default_peak_flops(device: torch.device, precision) -> float | None:
    """Dense peak FLOP/s of one CUDA device at the training precision: the table of current GPUs in lit/flops.py,
    then Lightning's table for older ones. None on other devices or a GPU neither knows."""
    if device.type != "cuda":
        return None
    dtype = compute_dtype(precision)
    peak = flops.peak_flops(torch.cuda.get_device_name(device), dtype, torch.get_float32_matmul_precision())
    if peak is not None:
        return peak
    from lightning.fabric.utilities.throughput import get_available_flops

    with warnings.catch_warnings():  # Throughput says it once, in its own words
        warnings.simplefilter("ignore")
        peak = get_available_flops(device, dtype)
    return None if peak is None else float(peak)


class Throughput(L.Callback):
    """``perf/tokens_per_sec``, ``perf/flops_per_sec`` and ``perf/mfu``.

    Training tokens and window-aware training FLOPs (lit/flops.py: 6 x matmul weights per token plus 12 x head_dim
    per causal in-window attention pair) of all ranks, per second of training wall time, measured over ``window``
    batches and excluding validation. ``perf/mfu`` = FLOP/s / (``peak_flops`` x world size). Wall-clock intervals need
    no per-step device sync: queued work is bounded, so the long-run rate is exact.
    """

    def __init__(self, window: int = 10, peak_flops: Optional[float] = None):
        """
        Args:
            window: batches per measurement.
            peak_flops: peak FLOP/s of one device, the denominator of perf/mfu. Default: on CUDA, the dense peak of
                the GPU at the training precision (lit/flops.py PEAK_FLOPS for H100, H200, B200; Lightning's table
                for older GPUs); on CPU, or a GPU neither knows, perf/mfu is not logged and one warning says so.
        """
        require(isinstance(window, int) and window >= 1, "throughput.window", window, "a positive number of batches")
        require(peak_flops is None or peak_flops > 0, "throughput.peak_flops", peak_flops, "a positive FLOP/s or null")
        self.window = window
        self.peak_flops = peak_flops
        self.peak = None  # the resolved denominator of perf/mfu
        self._flops_key = None
        self._flops_per_seq = 0
        self._reset()

    def _reset(self):
        self._t0 = None
        self._tokens = 0
        self._flops = 0
        self._steps = 0
        self.tokens_per_sec = None
        self.flops_per_sec = None
        self.mfu = None

    def on_train_start(self, trainer, pl_module):
        self._reset()
        if self.peak_flops is not None:
            self.peak = float(self.peak_flops)
        else:
            self.peak = default_peak_flops(pl_module.device, trainer.precision)
            if self.peak is None:
                device = pl_module.device
                name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
                rank_zero_warn(
                    f"perf/mfu is not logged: no peak FLOP/s is known for {name} at precision {trainer.precision}; "
                    f"set throughput.peak_flops (FLOP/s of one device) to log it"
                )

    def sequence_flops(self, pl_module, seq_len: int) -> int:
        """Training FLOPs of one sequence under the current table (recounted only when the table changes)."""
        rows = host_rows(pl_module)
        if self._flops_key is None or self._flops_key[0] is not rows or self._flops_key[1] != seq_len:
            self._flops_per_seq = flops.training_flops(pl_module.model.cfg, rows, seq_len, pl_module.model.sink)
            self._flops_key = (rows, seq_len)
        return self._flops_per_seq

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        tokens = batch["tokens"]
        batch_size, seq_len = tokens.shape[0], seq_len_of(batch)
        self._tokens += seq_len * batch_size * trainer.world_size
        self._flops += self.sequence_flops(pl_module, seq_len) * batch_size * trainer.world_size
        self._steps += 1
        if self._steps >= self.window:
            if tokens.is_cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            elapsed = max(now - self._t0, 1e-9)
            self.tokens_per_sec = self._tokens / elapsed
            self.flops_per_sec = self._flops / elapsed
            if self.peak:
                self.mfu = self.flops_per_sec / (self.peak * trainer.world_size)
            self._t0, self._tokens, self._flops, self._steps = now, 0, 0, 0
        if self.tokens_per_sec is not None:
            pl_module.log("perf/tokens_per_sec", self.tokens_per_sec, prog_bar=True, on_step=True, on_epoch=False)
            pl_module.log("perf/flops_per_sec", self.flops_per_sec, on_step=True, on_epoch=False)
            if self.mfu is not None:
                pl_module.log("perf/mfu", self.mfu, on_step=True, on_epoch=False)

    def on_validation_start(self, trainer, pl_module):
        self._t0, self._tokens, self._flops, self._steps = None, 0, 0, 0  # restart the window after validation


class ProgressBar(RichProgressBar):
    """Lightning's rich progress bar, whose description of a run without an epoch limit (``max_epochs`` -1: a run
    bounded by ``max_steps``) is "Epoch 3", not "Epoch 3/-2". While training runs, a long stage inside a step (the
    controller's decision) shows as one more task of this bar (``aah_lightning.progress``)."""

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        if self.progress is not None:
            progress.lend_bar(self.progress)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.progress is not None:
            progress.return_bar(self.progress)
        super().teardown(trainer, pl_module, stage)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.progress is not None:
            progress.return_bar(self.progress)
        super().on_exception(trainer, pl_module, exception)

    def _get_train_description(self, current_epoch: int) -> str:
        limit = self.trainer.max_epochs
        description = f"Epoch {current_epoch}" + (f"/{limit - 1}" if limit is not None and limit >= 0 else "")
        return f"{description:{len(self.validation_description)}}"  # padded as Lightning pads it: no flicker
