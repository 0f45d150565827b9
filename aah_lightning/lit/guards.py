"""Stop at the first NaN/Inf loss, name its step, keep the last good checkpoint, save the batch for debugging."""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import lightning as L
import torch
from torch.distributed import ReduceOp

from aah_lightning.atomic import atomic_write_text
from aah_lightning.errors import ConfigError, TrainingDiverged

_NO_STEP = 2**62


def _params_finite(pl_module) -> bool:
    flags = []
    for p in pl_module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 shards are DTensors: check this rank's part
        if local.numel():
            flags.append(torch.isfinite(local).all())
    return bool(torch.stack(flags).all()) if flags else True


def _number(x: float):
    return x if math.isfinite(x) else str(x)  # JSON has no NaN/Inf


class NonFiniteGuard(L.Callback):
    """Watches the training loss without a host sync per step.

    Every micro-batch's loss (a device scalar) and its ``batch["index"]`` are kept until the next check; a check reads
    them all back at once (one sync) and finds the first non-finite one, so the step it names is exact. Checks run
    every ``check_every_n_steps`` optimizer steps (default: the trainer's ``log_every_n_steps``, where Lightning syncs
    anyway), before validation, at the end of training and - most important - before every checkpoint is written,
    where the parameters are checked too. So no checkpoint is ever written from a poisoned model: ``last.ckpt`` stays
    the last good one. On a hit, the offending batch's indices go to ``nonfinite_batch.json`` (one file per rank under
    multi-process training) in ``dirpath`` and training stops with ``TrainingDiverged``, the same step on every rank.

    Args:
        check_every_n_steps: optimizer steps between checks; None = ``trainer.log_every_n_steps``.
        dirpath: folder for the batch report; None = the logger's log_dir (else the trainer's default_root_dir).
    """

    def __init__(self, check_every_n_steps: Optional[int] = None, dirpath: Optional[str] = None):
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ConfigError(
                f"nonfinite_guard.check_every_n_steps={check_every_n_steps!r} is not allowed: a positive integer or null"
            )
        self.check_every_n_steps = check_every_n_steps
        self.dirpath = dirpath
        self._pending: list[tuple] = []  # (step, epoch, batch_idx, loss, indices) since the last check
        self._step = 0
        self.checks = 0  # host reads so far (tests use it to show checks are not per step)
        self.tripped: Optional[str] = None
        self.report_path: Optional[str] = None
        self._folder = dirpath or "."

    def setup(self, trainer, pl_module, stage):
        # trainer.log_dir is a collective under DDP: resolve it here, on every rank, not when one rank trips.
        self._folder = self.dirpath or trainer.log_dir or trainer.default_root_dir

    def on_train_start(self, trainer, pl_module):
        self._pending, self.tripped, self.report_path = [], None, None

    # -- recording ---------------------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            indices = batch.get("index") if isinstance(batch, dict) else None
            self._pending.append((self._step, trainer.current_epoch, batch_idx, loss.detach(), indices))
        stepped = trainer.global_step != self._step  # the optimizer stepped (last micro-batch of the step)
        every = self.check_every_n_steps or trainer.log_every_n_steps or 1
        if stepped and (trainer.global_step % every == 0 or trainer.global_step == trainer.max_steps):
            self.check(trainer, pl_module)

    # -- checking ----------------------------------------------------------------------------------------------------
    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self.check(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self.check(trainer, pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        # Raising here aborts the save before anything is written: the previous checkpoint file stays in place.
        self.check(trainer, pl_module, params=True)

    def check(self, trainer, pl_module, params: bool = False) -> None:
        if self.tripped:
            raise TrainingDiverged(self.tripped)
        pending, self._pending = self._pending, []
        self.checks += 1
        bad = []
        if pending:
            finite = torch.stack([torch.isfinite(p[3]).all() for p in pending]).tolist()  # the one host sync
            bad = [p for p, ok in zip(pending, finite) if not ok]
        params_bad = params and not bad and not _params_finite(pl_module)
        if not trainer.strategy.reduce_boolean_decision(bool(bad) or params_bad, all=False):
            return
        local_step = bad[0][0] if bad else _NO_STEP
        step_t = torch.tensor(local_step, device=trainer.strategy.root_device)
        first_step = int(trainer.strategy.reduce(step_t, reduce_op=ReduceOp.MIN))
        self._trip(trainer, first_step, [p for p in bad if p[0] == first_step], params_bad)

    def _trip(self, trainer, step: int, batches: list[tuple], params_bad: bool) -> None:
        if step != _NO_STEP:
            loss = batches[0][3].float().mean().item() if batches else float("nan")
            what = f"the training loss became {loss if batches else 'non-finite'} at global step {step}"
            if batches:
                what += f" (epoch {batches[0][1]}, batch {batches[0][2]})"
            elif trainer.world_size > 1:
                what += " on another rank"
        elif params_bad:
            what = f"the model's parameters became non-finite by global step {trainer.global_step} (every checked loss was finite)"
        else:
            what = f"another rank's parameters became non-finite by global step {trainer.global_step}"
        saved_paths = [
            path
            for cb in trainer.checkpoint_callbacks
            for path in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", ""))
            if path and os.path.isfile(path)
        ]
        good = max(saved_paths, key=os.path.getmtime) if saved_paths else ""
        saved = f"the last good checkpoint is {good}" if good else "no checkpoint had been saved yet"
        msg = f"{what}; nothing after it was saved, {saved}"
        if batches:
            self.report_path = self._write_report(trainer, step, batches, what)
            msg += f"; the batch's indices are in {self.report_path}"
        msg += ". Try a lower model.optim.lr, more warmup, or inspect that batch"
        self.tripped = msg
        raise TrainingDiverged(msg)

    def _write_report(self, trainer, step: int, batches: list[tuple], what: str) -> str:
        folder = self._folder
        os.makedirs(folder, exist_ok=True)
        name = "nonfinite_batch.json" if trainer.world_size == 1 else f"nonfinite_batch_rank{trainer.global_rank}.json"
        path = os.path.join(folder, name)
        report = {
            "what": what,
            "global_step": step,
            "rank": trainer.global_rank,
            "batches": [
                {
                    "epoch": epoch,
                    "batch_idx": batch_idx,
                    "loss": _number(loss.float().mean().item()),
                    "indices": None if indices is None else torch.as_tensor(indices).flatten().tolist(),
                }
                for _, epoch, batch_idx, loss, indices in batches
            ],
        }
        atomic_write_text(path, json.dumps(report, indent=1))
        return path
