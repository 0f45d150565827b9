"""Start a run from a trained model's weights: ``model.init_from`` (docs/retrofit.md).

The source is an aah checkpoint (a ``.ckpt`` file of ``aah fit`` or of ``aah import``, or the checkpoint folder of an
FSDP2 run: each process reads its shards whole) or a Hugging Face model folder (``config.json`` and safetensors
weights), opened once as a ``model_source.ModelSource``, which knows each kind's files. Only its
weights are taken: the window table comes from the run's policy, and no optimizer, step or data position is read,
so a run with ``init_from`` is a fine-tune that starts at step 0 (a resume is ``--ckpt_path``).

* ``source_config(path)``: the GPT settings the source was trained with;
* ``padded_vocabulary(cfg, path)``: the run's settings with the source's ``vocab_size`` where the source's embedding
  has more rows than the run's tokenizer has ids (a padded vocabulary, as Qwen2 / Qwen3 ship): the rows are kept;
* ``check_source(cfg, path)``: the run's ``model.gpt`` settings build that model, or one ``ConfigError`` line naming
  every setting that differs with both values;
* ``longer_context(seq_len, path)``: the warning line for a run at a longer context than the source was trained for;
* ``load_weights(gpt, path)``: the source's weights into a GPT built with those settings (its window table is kept);
* ``python -m aah_lightning.retrofit SOURCE``: prints a config overlay with the source's ``model.gpt`` settings,
  ``model.init_from`` and, where it has one, its tokenizer as ``data.tokenizer``, to pass as ``--config``.

Layer: under ``lit/`` (``AAHModule`` loads through it), over ``model_source``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import yaml

from aah_lightning.errors import ConfigError
from aah_lightning.model.config import WEIGHT_SHAPE_SETTINGS, GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.model_source import HFFolder, ModelSource, ShardedCheckpoint

# What the source's weights were trained to compute: their shapes, and the settings that give the same shapes another
# function (the norm's epsilon, RoPE). The others (seq_len, backend, compilation, ...) say how the model runs.
SOURCE_SETTINGS = WEIGHT_SHAPE_SETTINGS + (
    "norm_eps",
    "rope_base",
    "rope_scaling",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_seq_len",
)

# Each function below takes a path or a source already opened (``ModelSource.open``): a run opens its source once
# and asks it everything (lit/module.py).


def is_hf_folder(path) -> bool:
    return HFFolder.recognises(path)


def is_sharded_checkpoint(path) -> bool:
    return ShardedCheckpoint.recognises(path)


def source_config(source) -> GPTConfig:
    """The GPT settings the source was trained with (its ``seq_len``: the context it was trained at, or a Hugging
    Face config's ``max_position_embeddings``)."""
    return ModelSource.open(source).config


def padded_vocabulary(cfg: GPTConfig, source) -> GPTConfig:
    """``cfg`` with the source's ``vocab_size`` where it is larger: ``model.gpt.vocab_size`` follows the tokenizer,
    and a model may have more embedding rows than its tokenizer has ids (Qwen2 / Qwen3 pad theirs to a round number).
    The padded rows are kept, never read by the data (every id is below the tokenizer's count); a tokenizer with more
    ids than the source's rows is still refused by ``check_source``."""
    return ModelSource.open(source).padded(cfg)


def check_source(cfg: GPTConfig, source) -> None:
    """``cfg`` builds the model the source was trained as; otherwise one line naming each setting that differs."""
    source = ModelSource.open(source)
    theirs, ours = asdict(source.config), asdict(cfg)
    diffs = [k for k in SOURCE_SETTINGS if theirs[k] != ours[k]]
    if not diffs:
        return
    both = "; ".join(f"model.gpt.{k}: source {theirs[k]!r}, this run {ours[k]!r}" for k in diffs)
    hint = " (model.gpt.vocab_size follows data.tokenizer / data.source)" if "vocab_size" in diffs else ""
    raise ConfigError(
        f"{source.where} was trained with other model settings ({both}){hint}: set them to the source's "
        f"(python -m aah_lightning.retrofit {os.fspath(source.path)} prints them)"
    )


def longer_context(seq_len: int, source, setting: str = "data.seq_len") -> str | None:
    """One warning line when a run's context ``seq_len`` is longer than the one the source was trained for (its
    ``seq_len``, a Hugging Face config's ``max_position_embeddings``); None otherwise. Allowed: fine-tuning at a
    longer context is how a context is extended, but positions past the trained ones are new to the model."""
    source = ModelSource.open(source)
    theirs = source.config.seq_len
    if seq_len <= theirs:
        return None
    return (
        f"{setting}={seq_len} is longer than the context {os.fspath(source.path)} was trained for ({theirs} tokens): "
        f"positions past {theirs} are new to it, and until a fine-tune at {seq_len} has taught them it may do worse "
        f"there; {setting}={theirs} keeps to what it knows"
    )


def source_weights(source, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The source's weights in the names of a GPT's ``state_dict``, without its window table."""
    return ModelSource.open(source).weights(cfg)


def load_weights(gpt: GPT, source) -> None:
    """Copy the source's weights into ``gpt`` (built with the source's settings: ``check_source``); its window table
    stays what the policy set."""
    ModelSource.open(source).load_into(gpt)


def source_tokenizer(source) -> str | None:
    """The tokenizer the source was trained with, as ``data.tokenizer`` takes it: a Hugging Face folder's
    tokenizer.json (the folder), or an aah checkpoint's ``data.tokenizer``; None for a model of token ids (the
    synthetic and recall tasks) and a folder without one."""
    return ModelSource.open(source).tokenizer


def overlay(path) -> dict:
    """A config overlay that fine-tunes from ``path``: its ``model.gpt`` settings, ``model.init_from`` (by absolute
    path) and, where it has one, its tokenizer as ``data.tokenizer``."""
    path = Path(path).resolve()
    source = ModelSource.open(path)
    cfg = asdict(source.config)
    config = {"model": {"init_from": str(path), "gpt": {k: cfg[k] for k in SOURCE_SETTINGS if k != "vocab_size"}}}
    tokenizer = source.tokenizer
    if tokenizer is not None:
        config["data"] = {"tokenizer": tokenizer}
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aah_lightning.retrofit",
        description="Print the config overlay that fine-tunes from a trained model (its model.gpt settings and "
        "model.init_from): aah fit --config <yours> --config <this overlay>",
    )
    parser.add_argument(
        "source", help="an aah checkpoint (a file or a folder of shards) or a Hugging Face model folder"
    )
    args = parser.parse_args(argv)
    try:
        config = overlay(args.source)
    except ConfigError as e:
        print(f"aah: error: {e}", file=sys.stderr)
        return 2
    print(f"# Fine-tune from {args.source} (python -m aah_lightning.retrofit); model.gpt.vocab_size follows the data.")
    print(yaml.safe_dump(config, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
