"""The Lightning behaviour aah relies on where Lightning has no public API for it (pyproject pins the tested range),
and the public replacements of private attributes it used before."""

from __future__ import annotations

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
