"""The check of a run as a whole that the LightningModule repeats in ``setup``: the tokenizer against the model's
vocabulary, the backend against the device. ``validation.preflight`` runs it first, before the Trainer starts; the
checkpoint against the model is ``aah_lightning.checkpoint.check_matches``. Every failure is a ``ConfigError`` naming
the setting."""

from __future__ import annotations

import torch

from aah_lightning.errors import ConfigError
from aah_lightning.model.attention import BackendUnavailable, resolve_backend


def check_run(module, datamodule, device: torch.device, stage: str) -> None:
    """The tokenizer fits the model's vocabulary and the backend can run on ``device`` for ``stage``."""
    cfg = module.gpt_config
    data_vocab, model_vocab = getattr(datamodule, "vocab_size", None), cfg.vocab_size
    if data_vocab is not None and model_vocab is not None and data_vocab > model_vocab:
        tokenizer = getattr(datamodule, "hparams", {}).get("tokenizer")
        raise ConfigError(
            f"data.tokenizer={tokenizer!r} produces ids up to {data_vocab - 1}, but model.gpt.vocab_size={model_vocab}: "
            f"the model needs at least {data_vocab} embeddings (leave model.gpt.vocab_size linked to the data, or use the "
            f"tokenizer the model was built for)"
        )
    try:
        resolve_backend(cfg.backend, torch.device(device), needs_grad=(stage == "fit"), seq_len=cfg.seq_len)
    except BackendUnavailable as e:
        raise ConfigError(str(e)) from e
