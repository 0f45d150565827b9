"""Histograms, images and text for the loggers that can show them.

Scalars reach every logger through ``log_metrics`` / ``LightningModule.log``. The rest - the window histograms, the
window map, the hierarchy text and ``val/sample`` - goes to the loggers that have a place for it:

* ``TensorBoardLogger``: ``add_histogram`` / ``add_image`` / ``add_text`` (the tags docs/tensorboard.md lists);
* ``WandbLogger``: ``wandb.Histogram``, ``log_image`` and a one-row table per text, keyed by the same tags and
  ``trainer/global_step`` (the step Lightning's W&B logger records with every value);
* any other logger (``CSVLogger``, ...): nothing. A run that logs only there skips drawing and generating these.
"""

from __future__ import annotations

from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from torch import Tensor

from aah_lightning.extras import need


class TensorBoardMedia:
    def __init__(self, logger: TensorBoardLogger):
        self.logger = logger

    def histogram(self, tag: str, values: Tensor, step: int) -> None:
        self.logger.experiment.add_histogram(tag, values, global_step=step)

    def image(self, tag: str, rgb, step: int) -> None:
        """``rgb``: ``[H, W, 3]`` uint8."""
        self.logger.experiment.add_image(tag, rgb, global_step=step, dataformats="HWC")

    def text(self, tag: str, text: str, step: int) -> None:
        # Indented four spaces: TensorBoard renders text as Markdown, and this keeps it a preformatted block.
        self.logger.experiment.add_text(tag, "\n".join("    " + line for line in text.split("\n")), step)


class WandbMedia:
    def __init__(self, logger: WandbLogger):
        self.logger = logger

    def histogram(self, tag: str, values: Tensor, step: int) -> None:
        wandb = need("wandb", "trainer.logger=WandbLogger")

        self.logger.experiment.log({tag: wandb.Histogram(values.double().numpy()), "trainer/global_step": step})

    def image(self, tag: str, rgb, step: int) -> None:
        self.logger.log_image(tag, [rgb], step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.logger.log_text(tag, columns=["step", "text"], data=[[step, text]], step=step)


def media_loggers(trainer) -> list:
    """The trainer's loggers that take histograms, images and text, wrapped in one interface."""
    out = []
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            out.append(TensorBoardMedia(logger))
        elif isinstance(logger, WandbLogger):
            out.append(WandbMedia(logger))
    return out
