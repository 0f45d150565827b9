"""Shared by the resume and distributed tests: callbacks that record a run and interrupt it, and run comparison.

The callbacks are importable by the ``aah`` subprocesses of the multi-process tests (PYTHONPATH holds tests/)."""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from torch._dynamo.utils import counters

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Recorder(L.Callback):
    """Appends one JSON line per training micro-batch to ``{folder}/rank{r}.jsonl``: the optimizer step, the loss,
    the batch's block indices (or, for streams, a fingerprint of its tokens), the window table and one draw from the
    global torch RNG (a restored RNG state must continue the same sequence)."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._rand = torch.rand(1).item()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        tokens = batch["tokens"]
        row = {
            "step": trainer.global_step,
            "loss": float(outputs["loss"]),
            "index": batch["index"].tolist(),
            "tokens": (tokens * torch.arange(1, tokens.shape[1] + 1, device=tokens.device)).sum(1).tolist(),
            "table": pl_module.model.windows.tolist(),
            "rand": self._rand,
            "graphs": counters["stats"]["unique_graphs"],  # graphs compiled so far in this process
        }
        if trainer.global_step == 1 and batch_idx < trainer.accumulate_grad_batches:
            row["sharded"] = _sharding(pl_module)
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, f"rank{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def _sharding(pl_module) -> dict:
    """For each parameter: its local and global number of elements (DTensor shards are smaller than the whole)."""
    out = {}
    for name, p in pl_module.model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = [local.numel(), p.numel()]
    return out


class Interrupt(L.Callback):
    """Ends the run with an exception when optimizer step ``at_step + 1`` begins: the checkpoint of step ``at_step``
    is on disk, the work after it is lost, as when a job is preempted."""

    def __init__(self, at_step: int):
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at_step:
            raise RuntimeError(f"simulated preemption at step {self.at_step}")


def read_run(folder: str, rank: int = 0) -> list[dict]:
    with open(os.path.join(folder, f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def subprocess_env() -> dict:
    """PYTHONPATH for ``python -m aah_lightning`` subprocesses: the repository (when not pip-installed) and tests/."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")])
    return env


PYTHON = sys.executable
