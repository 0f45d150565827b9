"""The NaN/Inf guard: stops at the first non-finite loss, names its step, keeps the last good checkpoint."""

from __future__ import annotations

import json
import os
import re
import subprocess

import lightning as L
import pytest
import torch

from aah_lightning.checkpoint import load_checkpoint_file
from aah_lightning.cli import main
from aah_lightning.errors import TrainingDiverged
from aah_lightning.lit.atomic_files import AtomicCheckpointIO
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.guards import NonFiniteGuard
from aah_lightning.lit.last_checkpoint import LastCheckpoint
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig
from helpers.cli import PYTHON, REPO, subprocess_env, tiny_config


class PoisonAt(L.Callback):
    """Overflows one weight before training step ``step`` (as a bad batch or an fp overflow would): that step's loss
    is non-finite. Remembers every batch's indices so the test knows which batch was the offending one."""

    def __init__(self, step: int):
        self.step, self.indices = step, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.indices[trainer.global_step] = batch["index"].tolist()
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.wte.weight[batch["tokens"][0, 0]] = float("inf")


def tiny_run(tmp_path, max_steps: int, callbacks: list, every_n_train_steps: int = 2):
    model = AAHModule(gpt=GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32, vocab_size=65))
    data = TextDataModule(source="synthetic", seq_len=32, batch_size=4, synthetic={"documents": 100})
    last = LastCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=every_n_train_steps)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
        plugins=[AtomicCheckpointIO()],
        callbacks=[*callbacks, last],
    )
    return model, data, trainer


def test_poisoned_step_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
    # Checks every 4 steps, checkpoints every 2: the step-6 save comes before the step-8 check, so the pre-save check
    # must be what catches the loss of step 5.
    poison, guard = PoisonAt(step=5), NonFiniteGuard(check_every_n_steps=4)
    model, data, trainer = tiny_run(tmp_path, max_steps=12, callbacks=[poison, guard])
    with pytest.raises(TrainingDiverged) as exc:
        trainer.fit(model, datamodule=data)
    msg = str(exc.value)
    assert "global step 5 " in msg and re.search(r"loss became (inf|nan)", msg)
    assert trainer.global_step == 6  # stopped at the first save after the bad step, not at max_steps

    last = load_checkpoint_file(tmp_path / "ckpts" / "last.ckpt")
    assert last["global_step"] == 4 and str(tmp_path / "ckpts" / "last.ckpt") in msg
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values() if t.is_floating_point())

    report = json.load(open(guard.report_path))
    assert guard.report_path == str(tmp_path / "nonfinite_batch.json") and guard.report_path in msg
    assert report["global_step"] == 5 and report["batches"][0]["indices"] == poison.indices[5]
    assert report["batches"][0]["loss"] in ("nan", "inf")


def test_nonfinite_parameters_block_the_save_even_when_the_loss_was_finite(tmp_path):
    class PoisonAfterLoss(L.Callback):  # runs before the checkpoint callback in on_train_batch_end
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 4:
                with torch.no_grad():
                    pl_module.model.lm_head.weight[0, 0] = float("nan")

    model, data, trainer = tiny_run(
        tmp_path, max_steps=8, callbacks=[NonFiniteGuard(check_every_n_steps=100), PoisonAfterLoss()]
    )
    with pytest.raises(TrainingDiverged, match="parameters became non-finite by global step 4"):
        trainer.fit(model, datamodule=data)
    assert load_checkpoint_file(tmp_path / "ckpts" / "last.ckpt")["global_step"] == 2


def test_a_healthy_run_is_checked_only_at_check_steps(tmp_path):
    guard = NonFiniteGuard(check_every_n_steps=4)
    model, data, trainer = tiny_run(tmp_path, max_steps=8, callbacks=[guard], every_n_train_steps=100)
    trainer.fit(model, datamodule=data)
    # Steps 4 and 8, the final save of last.ckpt, and the end of training: not once per step.
    assert guard.checks == 4 and guard.tripped is None
    assert not guard._pending


def test_cli_run_forced_to_diverge_by_a_huge_learning_rate(tmp_path, capsys):
    config = tiny_config(
        tmp_path, trainer={"max_steps": 20, "val_check_interval": 10, "default_root_dir": str(tmp_path)}
    )
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", config, "--model.optim.lr", "1e30", "--model.optim.warmup_steps", "0"])
    assert exc.value.code == 3
    line = [l for l in capsys.readouterr().err.splitlines() if l.startswith("aah:")][-1]
    step = int(re.search(r"global step (\d+)", line).group(1))
    assert line.startswith("aah: stopped: the training loss became") and "nonfinite_batch.json" in line
    report = json.load(open(os.path.join(tmp_path, "nonfinite_batch.json")))
    assert report["global_step"] == step and len(report["batches"][0]["indices"]) == 4
    last = load_checkpoint_file(tmp_path / "ckpts" / "last.ckpt")  # checkpoints every step: the last one before it
    assert last["global_step"] == step
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values() if t.is_floating_point())


@pytest.mark.heavy
def test_ddp_ranks_stop_together_when_one_rank_diverges(tmp_path):
    run = subprocess.run(
        [PYTHON, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_nonfinite_run.py"), str(tmp_path)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["global_step"] == r1["global_step"] == 4  # both stopped at the first check after step 3
    assert "global step 3 on another rank" in r0["stopped"]
    assert "global step 3 (epoch 0, batch 3)" in r1["stopped"] and "nonfinite_batch_rank1.json" in r1["stopped"]
    assert json.load(open(tmp_path / "nonfinite_batch_rank1.json"))["global_step"] == 3
    assert not (tmp_path / "nonfinite_batch_rank0.json").exists()
    last = load_checkpoint_file(tmp_path / "ckpts" / "last.ckpt")
    assert last["global_step"] == 3
