"""Generation in Lightning: ``aah predict`` writes completions as JSON Lines, and validation logs a sample text.

* ``GenerationWriter`` (a ``BasePredictionWriter``; CLI section ``generate``) holds the sampling settings, hands them
  to the module's ``predict_step`` and writes one JSON object per prompt, in prompt order, to ``generate.output``.
  Every rank keeps its own rows; at the end they are gathered and rank 0 writes the file at once (a temporary file
  renamed over the target), so an interrupted run leaves no half-written output. The output path is checked before
  anything is generated.
* ``ValidationSample`` (CLI section ``sample``) logs ``val/sample`` (TensorBoard, W&B) after every validation: a short
  greedy continuation of a fixed prompt, to read how the model is doing.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_warn

from aah_lightning.atomic import atomic_write_text
from aah_lightning.data.prompts import encode_prompt
from aah_lightning.errors import ConfigError, require
from aah_lightning.lit.distributed import gather
from aah_lightning.lit.media import media_loggers
from aah_lightning.model.generate import GenerationConfig, generate


def check_writable(path: str, setting: str = "generate.output") -> None:
    """``path`` can be written: its folder exists and takes a new file, and it is not a folder itself."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{setting}={path!r} is a folder: name a file to write, e.g. {os.path.join(path, 'a.jsonl')}")
    if not os.path.isdir(folder):
        raise ConfigError(f"{setting}={path!r} cannot be written: the folder {folder} does not exist")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".aah-write-check-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{setting}={path!r} cannot be written ({e.strerror}): choose a writable path") from e
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{setting}={path!r} exists and is read-only: choose another path")


def write_jsonl(path: str, rows: list[dict]) -> None:
    """All rows or nothing (``atomic_write_text``)."""
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


class GenerationWriter(BasePredictionWriter):
    """Sampling settings for ``aah predict`` and the JSON Lines writer of its completions.

    Each line: ``index`` (the prompt's number in the prompts file), ``prompt``, ``completion``, ``prompt_tokens`` (the
    prompt's tokens the model saw, without the leading end-of-document token), ``prompt_tokens_dropped`` (cut from
    the left of a prompt longer than the model's seq_len), ``completion_tokens``, ``stop`` (``eod``: the model ended
    the document; ``length``: max_new_tokens reached) and ``settings``.
    """

    def __init__(
        self,
        output: str = "predictions.jsonl",
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at_eod: bool = True,
    ):
        """
        Args:
            output: the JSON Lines file to write (replaced if it exists).
            max_new_tokens: tokens to generate per prompt (fewer when it ends its document first).
            temperature: softmax temperature; 0 = greedy.
            top_k: sample among the k most likely tokens only; 0 = no limit.
            top_p: nucleus sampling: the smallest set of tokens whose probability reaches top_p; 1 = off.
            seed: sampling seed; every prompt has its own generator seeded by (seed, prompt number).
            stop_at_eod: stop a prompt at the end-of-document token.
        """
        super().__init__(write_interval="batch")
        self.output = output
        self.settings = GenerationConfig(max_new_tokens, temperature, top_k, top_p, seed, stop_at_eod)
        self.settings.validate()
        self._rows: list[dict] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "predict":
            return
        check_writable(self.output)
        pl_module.generation = self.settings
        self._rows = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        tokenizer = trainer.datamodule.tokenizer
        settings = asdict(self.settings)
        for i, text, ids, dropped, completion in zip(
            batch["index"], batch["text"], batch["tokens"], batch["dropped"], prediction
        ):
            self._rows.append(
                {
                    "index": i,
                    "prompt": text,
                    "completion": tokenizer.decode(completion.tokens),
                    "prompt_tokens": len(ids) - 1,
                    "prompt_tokens_dropped": dropped,
                    "completion_tokens": len(completion.tokens),
                    "stop": completion.stop,
                    "settings": settings,
                }
            )

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        rows = sorted((row for part in gather(self._rows) for row in part), key=lambda row: row["index"])
        if trainer.is_global_zero:
            write_jsonl(self.output, rows)
        self._rows = []


class ValidationSample(L.Callback):
    """``val/sample``: after every validation, a greedy continuation of ``prompt`` as text (rank 0), for the loggers
    that show text (TensorBoard, W&B); with none (e.g. CSVLogger alone) nothing is generated."""

    def __init__(self, prompt: str = "def ", max_new_tokens: int = 48, enabled: bool = True):
        """
        Args:
            prompt: the text to continue.
            max_new_tokens: length of the continuation (tokens).
            enabled: log the sample (false: off).
        """
        require(
            isinstance(max_new_tokens, int) and max_new_tokens > 0,
            "sample.max_new_tokens",
            max_new_tokens,
            "a positive integer",
        )
        self.prompt, self.enabled = prompt, enabled
        self.settings = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0)
        self._skipped = False

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not self.enabled or trainer.sanity_checking or not trainer.is_global_zero:
            return
        media = media_loggers(trainer)
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        # No logger shows text, or a model of token ids (the synthetic and recall tasks): the data module has no
        # tokenizer by the same test of data.source as checkpoint.has_text_tokenizer.
        if not media or tokenizer is None:
            return
        model = pl_module.model
        if any(type(p).__name__ == "DTensor" for p in model.parameters()):
            if not self._skipped:  # FSDP2 shards the weights: one rank alone cannot run the model
                rank_zero_warn("val/sample is not logged under FSDP2 (sharded weights); sample.enabled=false hides it")
                self._skipped = True
            return
        ids, _ = encode_prompt(self.prompt, tokenizer, pl_module.gpt_config.seq_len)
        completion = generate(model, [ids], self.settings, tokenizer.eos_id)[0]
        text = self.prompt + tokenizer.decode(completion.tokens)
        for sink in media:
            sink.text("val/sample", text, trainer.global_step)
