"""Run inside the SLURM jobs of tests/distributed/test_slurm_real.py (``--trainer.callbacks+=helpers.slurm.SlurmProbe``)."""

from __future__ import annotations

import json
import os
import time

import lightning as L

from aah_lightning.lit.last_checkpoint import LastCheckpoint
from aah_lightning.lit.lightning_private import cluster_environment

TIMEOUT = 240  # seconds for any one wait; a busy machine can be slow to start processes


class SlurmProbe(L.Callback):
    """Inside the job: records how each rank of each run started, and holds the run in the middle of an accumulation
    window after step ``hold_at[r]`` (r = the job's restart count) until SLURM's SIGTERM (or USR1) reaches the rank, so
    the test can signal the job at a known point. Released, the rank finishes that step, writes last.ckpt and stops."""

    def __init__(self, folder: str, hold_at: list[int]):
        self.folder, self.hold_at = folder, hold_at
        self.restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))

    def _write(self, name: str, record: dict) -> None:
        with open(os.path.join(self.folder, name), "w") as f:
            json.dump(record, f)

    def on_train_start(self, trainer, pl_module):
        env = cluster_environment(trainer)
        self._write(
            f"start.{self.restart}.rank{trainer.global_rank}.json",
            {
                "environment": type(env).__name__,
                "auto_requeue": getattr(env, "auto_requeue", None),
                "world_size": trainer.world_size,
                "procid": int(os.environ["SLURM_PROCID"]),
                "step": trainer.global_step,
            },
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        at_boundary = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if at_boundary or self.restart >= len(self.hold_at) or trainer.global_step != self.hold_at[self.restart]:
            return
        self._write(f"held.{self.restart}.rank{trainer.global_rank}.json", {"step": trainer.global_step})
        deadline = time.monotonic() + TIMEOUT
        stop = next(cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint))
        # SLURM ends a requeued job's tasks with SIGTERM, or sends them USR1: the run stops after this step.
        while stop.sigterms + stop.requeue_signals == 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"held after step {trainer.global_step} and never stopped")
            time.sleep(0.1)
