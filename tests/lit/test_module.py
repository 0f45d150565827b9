"""The model's settings are saved once, one plain dict per settings dataclass (``gpt``, ``aah``, ``optim``) with the
layout's version, and a checkpoint rebuilds the model (also one of the earlier flat layout).

train/loss is the mean loss of the optimizer step's micro-batches, not the last micro-batch's."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger

from aah_lightning.checkpoint import HPARAMS_FORMAT, HPARAMS_FORMAT_ENTRY
from aah_lightning.cli import main
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig


def test_checkpoints_rebuild_the_model_from_its_settings(tmp_path, tiny_args):
    main(tiny_args("--model.gpt.rope_base=500.0", "--model.aah.policy=fixed", "--model.aah.fixed.window=8", steps=3))
    path = tmp_path / "ckpt" / "last.ckpt"
    ckpt = torch.load(path, weights_only=True)
    hp = ckpt["hyper_parameters"]
    assert set(hp) == {"gpt", "aah", "optim", HPARAMS_FORMAT_ENTRY} and hp[HPARAMS_FORMAT_ENTRY] == HPARAMS_FORMAT
    gpt = hp["gpt"]
    assert (
        gpt["n_layer"] == 2 and gpt["n_head"] == 4 and gpt["rope_base"] == 500.0 and hp["aah"]["fixed"]["window"] == 8
    )
    assert gpt["seq_len"] == 32 and gpt["vocab_size"] == 65  # linked: data.seq_len, the synthetic task's vocabulary
    expected = GPTConfig(vocab_size=65, seq_len=32, n_layer=2, n_head=4, n_embd=32, rope_base=500.0)
    # as the CLI writes it, and as checkpoints of earlier versions hold it: the GPT's settings flat
    flat = dict(ckpt, hyper_parameters={**gpt, "aah": hp["aah"], "optim": hp["optim"]})
    torch.save(flat, tmp_path / "flat.ckpt")
    for saved in (path, tmp_path / "flat.ckpt"):
        module = AAHModule.load_from_checkpoint(saved)
        assert module.gpt_config == expected
        assert module.model.windows.tolist() == [[8] * 4] * 2
        assert torch.equal(module.model.wte.weight, ckpt["state_dict"]["model.wte.weight"])


class Recorded(Logger):
    """Keeps what Lightning hands to a logger: {step: {tag: value}}."""

    def __init__(self):
        super().__init__()
        self.metrics: dict[int, dict[str, float]] = {}

    name, version = "recorded", 0

    def log_metrics(self, metrics, step=None):
        self.metrics.setdefault(step, {}).update(metrics)

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class LossesSeen(AAHModule):
    """The module, also keeping every training micro-batch's loss as it computed it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen: list[tuple[int, float]] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.seen.append((self.global_step, float(loss)))
        return loss


def test_train_loss_is_the_mean_over_the_steps_micro_batches(tmp_path):
    model = LossesSeen(gpt=GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32, vocab_size=65))
    data = TextDataModule(source="synthetic", seq_len=32, batch_size=4, synthetic={"documents": 100})
    logger = Recorded()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=data)
    by_step: dict[int, list[float]] = {}
    for step, loss in model.seen:
        by_step.setdefault(step, []).append(loss)
    assert [len(v) for v in by_step.values()] == [2, 2, 2]
    logged = {step: m["train/loss"] for step, m in logger.metrics.items() if "train/loss" in m}
    assert logged == pytest.approx({step: (a + b) / 2 for step, (a, b) in by_step.items()}, rel=1e-6)
    assert all(logged[s] != pytest.approx(by_step[s][1], rel=1e-6) for s in logged)  # not the last micro-batch's
