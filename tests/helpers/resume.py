"""Shared by the resume and distributed tests: callbacks that record a run and interrupt it, an in-process run
interrupted and resumed, and the comparison of two runs.

The callbacks are importable by the ``aah`` subprocesses of the multi-process tests (PYTHONPATH holds tests/):
``--trainer.callbacks+=helpers.resume.Recorder``."""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch
from torch._dynamo.utils import counters

from aah_lightning.cli import main


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


# -- one process: a run interrupted at step INTERRUPT_AT and resumed, next to one never interrupted -----
STEPS, INTERRUPT_AT = 8, 4
POLICY = ["--model.aah.policy=random", "--model.aah.candidates=[8,16,32]", "--model.aah.random.redraw_interval=3"]


def run_args(tiny_args, folder, *extra):
    return tiny_args(
        *POLICY,
        "--trainer.accumulate_grad_batches=2",
        "--checkpoint.every_n_train_steps=1",
        f"--checkpoint.dirpath={folder}/ckpt",
        "--trainer.callbacks+=helpers.resume.Recorder",
        f"--trainer.callbacks.folder={folder}/rec",
        f"--trainer.logger.init_args.save_dir={folder}/runs",
        *extra,
        steps=STEPS,
    )


def interrupted_then_resumed(tiny_args, folder, *extra):
    with pytest.raises(RuntimeError, match="simulated preemption"):
        main(
            run_args(
                tiny_args,
                folder,
                *extra,
                "--trainer.callbacks+=helpers.resume.Interrupt",
                f"--trainer.callbacks.at_step={INTERRUPT_AT}",
            )
        )
    saved = torch.load(f"{folder}/ckpt/last.ckpt", weights_only=True)
    assert saved["global_step"] == INTERRUPT_AT
    main(run_args(tiny_args, folder, *extra, "--ckpt_path=last"))
    return saved


def assert_same_training(whole: list[dict], parts: list[dict], rel=1e-6):
    assert [r["step"] for r in parts] == [r["step"] for r in whole]
    assert [r["index"] for r in parts] == [r["index"] for r in whole]
    assert [r["tokens"] for r in parts] == [r["tokens"] for r in whole]  # the same batches
    assert [r["table"] for r in parts] == [r["table"] for r in whole]
    assert [r["rand"] for r in parts] == [r["rand"] for r in whole]  # the RNG continued, not restarted
    assert [r["loss"] for r in parts] == pytest.approx([r["loss"] for r in whole], rel=rel, abs=1e-7)


def assert_same_checkpoint(a: str, b: str, rel=1e-6):
    sa, sb = (torch.load(p, weights_only=True)["state_dict"] for p in (a, b))
    assert sa.keys() == sb.keys()
    assert torch.equal(sa["model.windows"], sb["model.windows"])
    for key in sa:
        torch.testing.assert_close(sb[key], sa[key], rtol=rel, atol=1e-7, msg=key)


def check_resumed(tmp_path):
    whole, parts = read_run(tmp_path / "whole" / "rec"), read_run(tmp_path / "parts" / "rec")
    assert len(whole) == STEPS * 2  # micro-batches
    assert len({str(r["table"]) for r in whole}) > 1  # the table changed during the run, also after the resume
    assert_same_training(whole, parts)
    assert_same_checkpoint(tmp_path / "whole/ckpt/last.ckpt", tmp_path / "parts/ckpt/last.ckpt")
