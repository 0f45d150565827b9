"""The Lightning behaviour aah relies on where Lightning has no public API for it (pyproject pins the tested range),
and the public replacements of private attributes it used before."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.cli import LightningArgumentParser
from torch.nn.parallel import DistributedDataParallel

from aah_lightning.cli import main
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig


def test_a_resume_keeps_the_given_config_not_the_checkpoints(tmp_path, tiny_args):
    # LightningCLI._parse_ckpt_path is switched off: the checkpoint's hyperparameters never override the config.
    main(tiny_args("--model.optim.lr=0.002", steps=2))
    main(tiny_args("--model.optim.lr=0.0005", "--ckpt_path=last", steps=3))
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 3 and saved["hyper_parameters"]["optim"]["lr"] == 0.0005


@dataclass(frozen=True)
class _Shape:
    """Shape.

    Attributes:
        n_layer: blocks.
        seq_len: T.
        vocab_size: V.
    """

    n_layer: int = 4
    seq_len: int = 256
    vocab_size: int = 257


class _Model:
    def __init__(self, gpt: _Shape = _Shape()):
        self.gpt = gpt


class _Data:
    def __init__(self, seq_len: int = 64, vocab: int = 300):
        self.seq_len, self.vocab_size = seq_len, vocab


def test_links_reach_the_fields_of_a_nested_dataclass(capsys):
    # The CLI links data.seq_len (on parse) and the data module's vocabulary (on instantiation) into model.gpt, the GPT's
    # settings dataclass; a dataclass argument with a default is a group of its own (--model.gpt.n_layer, ...).
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_class_arguments(_Model, "model")
    parser.add_class_arguments(_Data, "data")
    parser.link_arguments("data.seq_len", "model.gpt.seq_len")
    parser.link_arguments("data", "model.gpt.vocab_size", compute_fn=lambda d: d.vocab_size, apply_on="instantiate")
    config = parser.parse_args(["--model.gpt.n_layer=2", "--data.seq_len=32", "--data.vocab=500"])
    assert config.model.gpt.seq_len == 32 and config.model.gpt.n_layer == 2
    built = parser.instantiate_classes(config)
    assert built.model.gpt == _Shape(n_layer=2, seq_len=32, vocab_size=500)
    parser.print_help()
    assert "--model.gpt.n_layer N_LAYER" in capsys.readouterr().out


def test_a_finished_epoch_based_run_saves_its_end_state(tmp_path, tiny_args):
    # LastCheckpoint saves the end of a run that stops at max_epochs through ModelCheckpoint's own save of "last".
    main(
        tiny_args(
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=3",
            "--checkpoint.every_n_train_steps=100",
            steps=-1,
        )
    )
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 3 and saved["epoch"] == 1  # the trainer's epoch after the finished one


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("broadcast", [True, False])
def test_ddp_that_broadcasts_buffers_is_warned_about(one_process_group, broadcast):
    module = AAHModule(gpt=GPTConfig(n_layer=1, n_head=2, n_embd=8, seq_len=16, vocab_size=11))
    ddp = DistributedDataParallel(module, broadcast_buffers=broadcast)
    module.trainer = SimpleNamespace(strategy=SimpleNamespace(model=ddp), world_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.on_fit_start()
    said = [str(w.message) for w in caught if "broadcasts buffers" in str(w.message)]
    assert len(said) == (1 if broadcast else 0)


# -- the private API of lit/lightning_private.py, against the installed Lightning --------------------------------------
def _boring_fit(*callbacks, **trainer_args):
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer_args = {"logger": False, "enable_checkpointing": False, **trainer_args}
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **trainer_args,
    )
    trainer.fit(BoringModel())
    return trainer


def test_inside_accumulation_window_says_which_batches_end_a_step():
    import lightning as L

    from aah_lightning.lit.lightning_private import inside_accumulation_window

    class Record(L.Callback):
        seen: list = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append(inside_accumulation_window(trainer))

    record = Record()
    _boring_fit(record, accumulate_grad_batches=3)
    assert record.seen == [True, True, False, True, True, False]


def test_send_step_metrics_hands_a_steps_metrics_to_the_logger_inside_the_hook():
    import lightning as L
    from lightning.pytorch.loggers import Logger

    from aah_lightning.lit.lightning_private import send_step_metrics

    class Recorder(Logger):
        name, version, calls = "recorder", 0, []

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.calls.append(dict(metrics))

    class SendEarly(L.Callback):
        sent: list = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pl_module.log("probe", float(trainer.global_step), on_step=True, on_epoch=False)
            before = len(trainer.logger.calls)
            send_step_metrics(trainer)
            self.sent.append([c["probe"] for c in trainer.logger.calls[before:] if "probe" in c])

    callback = SendEarly()
    _boring_fit(callback, logger=Recorder(), log_every_n_steps=1)
    assert callback.sent == [[1.0], [2.0]]


def test_cluster_environment_is_the_one_lightning_chose(monkeypatch):
    import lightning as L
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    from aah_lightning.lit.lightning_private import cluster_environment, rank_from_environment

    plain = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    assert isinstance(cluster_environment(plain), LightningEnvironment)
    assert cluster_environment(object()) is None
    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                       "SLURM_NODEID": "0", "SLURM_NODELIST": "node1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    under_slurm = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    assert isinstance(cluster_environment(under_slurm), SLURMEnvironment)
    monkeypatch.setenv("RANK", "3")
    assert rank_from_environment() == 3


def test_model_checkpoint_saves_last_on_demand_through_the_trainer_and_knows_the_step_it_saved(tmp_path):
    # LastCheckpoint saves "last" itself at the final step and at a signal stop (should_skip_saving,
    # save_last_checkpoint), and skips a save when this step is saved already (last_step_saved).
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from aah_lightning.lit.lightning_private import last_step_saved, save_last_checkpoint, should_skip_saving

    class RecordedIO(TorchCheckpointIO):
        written: list = []

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.written.append((os.path.basename(path), checkpoint["global_step"]))
            super().save_checkpoint(checkpoint, path, storage_options)

    # No trigger of its own (every_n_epochs=0); "last" named from the step, so each save has its own file.
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_epochs=0)
    checkpoint.CHECKPOINT_NAME_LAST = "last-{step}"
    never_saved = ModelCheckpoint(dirpath=tmp_path / "other", save_last=True, save_top_k=0, every_n_epochs=0)

    class SaveEveryStep(L.Callback):
        seen: list = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            before = (last_step_saved(checkpoint), should_skip_saving(checkpoint, trainer))
            save_last_checkpoint(checkpoint, trainer)
            after = (last_step_saved(checkpoint), should_skip_saving(checkpoint, trainer))
            files = sorted(os.listdir(tmp_path))
            self.seen.append((trainer.global_step, before, after, os.path.basename(checkpoint.last_model_path), files))

        def on_validation_start(self, trainer, pl_module):
            self.seen.append(("validate", should_skip_saving(never_saved, trainer)))

    probe = SaveEveryStep()
    trainer = _boring_fit(probe, checkpoint, enable_checkpointing=True, plugins=[RecordedIO()], num_sanity_val_steps=0)
    assert probe.seen == [
        (1, (0, False), (1, True), "last-step=1.ckpt", ["last-step=1.ckpt"]),
        (2, (1, False), (2, True), "last-step=2.ckpt", ["last-step=2.ckpt"]),  # the previous "last" removed
    ]
    assert RecordedIO.written == [("last-step=1.ckpt", 1), ("last-step=2.ckpt", 2)]  # the trainer's plugin wrote them
    trainer.validate(trainer.lightning_module, verbose=False)
    assert probe.seen[-1] == ("validate", True)  # never outside fit, even when this step was not saved


def test_attached_trainer_is_none_until_a_trainer_runs_the_module():
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from aah_lightning.lit.lightning_private import attached_trainer

    alone = BoringModel()
    assert attached_trainer(alone) is None
    with pytest.raises(RuntimeError, match="not attached"):  # why the private attribute: the property raises
        _ = alone.trainer

    class Probe(L.Callback):
        seen: list = []

        def on_train_start(self, trainer, pl_module):
            self.seen.append(attached_trainer(pl_module) is trainer)

    probe = Probe()
    _boring_fit(probe)
    assert probe.seen == [True]
