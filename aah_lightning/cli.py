"""The ``aah`` command: a LightningCLI over AAHModule and TextDataModule.

``aah fit|validate|test --config X.yaml`` (``--print_config``, ``--ckpt_path last``). Settings the user gives once are
linked: ``data.seq_len`` sets the model's T, the tokenizer sets the model's vocabulary. Bad settings end the run with
one line naming the setting, before any compute is spent.
"""

from __future__ import annotations

import sys

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from aah_lightning.errors import ConfigError
from aah_lightning.lit.callbacks import Throughput, WindowDiagnostics
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.module import AAHModule


def _vocab_of(datamodule) -> int:
    return datamodule.vocab_size


class AAHCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.seq_len", "model.seq_len")
        parser.link_arguments("data", "model.vocab_size", compute_fn=_vocab_of, apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.dirpath": "runs/aah/checkpoints",
                "checkpoint.filename": "best-step{step}",
                "checkpoint.auto_insert_metric_name": False,
                "checkpoint.monitor": "val/loss",
                "checkpoint.mode": "min",
                "checkpoint.save_top_k": 1,
                "checkpoint.save_last": True,
            }
        )
        parser.add_lightning_class_args(Throughput, "throughput")
        parser.add_lightning_class_args(WindowDiagnostics, "diagnostics")
        parser.set_defaults(
            {
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs", "name": "aah"},
                },
                "trainer.max_steps": 1000,
                "trainer.log_every_n_steps": 10,
                "trainer.gradient_clip_val": 1.0,
                "trainer.use_distributed_sampler": False,  # the data module shards by rank itself
            }
        )

    def before_instantiate_classes(self) -> None:
        # bf16-mixed on a GPU, fp32 on CPU, unless the config says otherwise.
        cfg = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        trainer = cfg["trainer"]
        if trainer.get("precision") is None:
            on_gpu = torch.cuda.is_available() and trainer.get("accelerator") in ("auto", "gpu", "cuda", None)
            trainer["precision"] = "bf16-mixed" if on_gpu else "32-true"


def main(args=None) -> None:
    try:
        AAHCLI(
            AAHModule,
            TextDataModule,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=1234,
            auto_configure_optimizers=False,
            args=args,
        )
    except ConfigError as e:
        print(f"aah: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
