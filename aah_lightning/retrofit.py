"""Start a run from a trained model's weights: ``model.init_from`` (docs/retrofit.md).

The source is an aah checkpoint (a ``.ckpt`` file of ``aah fit`` or of ``python -m aah_lightning.hf_checkpoint``, or
the checkpoint folder of an FSDP2 run: each process reads its shards whole) or a Hugging Face model
folder (``config.json`` and safetensors weights, read by ``model/hf_import.py``). Only its
weights are taken: the window table comes from the run's policy, and no optimizer, step or data position is read,
so a run with ``init_from`` is a fine-tune that starts at step 0 (a resume is ``--ckpt_path``).

* ``source_config(path)``: the GPT settings the source was trained with;
* ``padded_vocabulary(cfg, path)``: the run's settings with the source's ``vocab_size`` where the source's embedding
  has more rows than the run's tokenizer has ids (a padded vocabulary, as Qwen2 / Qwen3 ship): the rows are kept;
* ``check_source(cfg, path)``: the run's ``model.gpt`` settings build that model, or one ``ConfigError`` line naming
  every setting that differs with both values;
* ``load_weights(gpt, path)``: the source's weights into a GPT built with those settings (its window table is kept);
* ``python -m aah_lightning.retrofit SOURCE``: prints a config overlay with the source's ``model.gpt`` settings,
  ``model.init_from`` and, where it has one, its tokenizer as ``data.tokenizer``, to pass as ``--config``.

Layer: under ``lit/`` (``AAHModule`` loads through it), over ``checkpoint`` and ``model/``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch
import yaml

from aah_lightning import checkpoint as ck
from aah_lightning.data.sources import is_text
from aah_lightning.errors import ConfigError
from aah_lightning.inputs import first_line
from aah_lightning.model import hf_import
from aah_lightning.model.config import WEIGHT_SHAPE_SETTINGS, GPTConfig
from aah_lightning.model.gpt import GPT

SETTING = "model.init_from"
# A torch.distributed.checkpoint folder (an FSDP2 run's last.ckpt/): its index, and Lightning's file of the plain entries.
SHARDS_INDEX, SHARDS_META = ".metadata", "meta.pt"
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


def _where(path) -> str:
    return f"{SETTING}={os.fspath(path)!r}"


def is_hf_folder(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, hf_import.CONFIG_FILE))


def is_sharded_checkpoint(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, SHARDS_INDEX))


def _read_aah(path) -> dict:
    """The checkpoint dict of an aah source file (verified, weights-only, tensors memory-mapped); of a sharded folder,
    its plain entries (the weights stay in the shards)."""
    if not os.path.exists(path):
        raise ConfigError(f"{_where(path)} does not exist: pass an aah checkpoint or a Hugging Face model folder")
    if is_sharded_checkpoint(path):
        meta = os.path.join(path, SHARDS_META)
        if not os.path.isfile(meta):
            raise ConfigError(
                f"{_where(path)} is a sharded checkpoint folder without {SHARDS_META}: not written by aah"
            )
        checkpoint = ck.read_checkpoint(meta, mmap=True, setting=SETTING)
        needed = (ck.HYPER_PARAMETERS_KEY,)
    elif os.path.isdir(path):
        raise ConfigError(
            f"{_where(path)} is a folder without {hf_import.CONFIG_FILE}: pass an aah checkpoint or a Hugging Face "
            f"model folder"
        )
    else:
        checkpoint = ck.read_checkpoint(path, mmap=True, setting=SETTING)
        needed = (ck.HYPER_PARAMETERS_KEY, ck.STATE_DICT_KEY)
    if any(key not in checkpoint for key in needed):
        raise ConfigError(f"{_where(path)} is not a checkpoint written by aah (no {'/'.join(needed)})")
    return checkpoint


def _load_shards(gpt: GPT, path) -> None:
    """The weights of a sharded checkpoint folder into ``gpt``'s own tensors, whole, in this process alone."""
    import torch.distributed.checkpoint as dcp

    prefix = ck.WINDOWS_STATE_KEY[: -len("windows")]
    wanted = {prefix + k: v for k, v in gpt.state_dict().items() if k != "windows"}
    try:
        with torch.no_grad():
            dcp.load({ck.STATE_DICT_KEY: wanted}, checkpoint_id=os.fspath(path), no_dist=True)
    except Exception as e:  # torch.distributed.checkpoint's CheckpointException wraps what each read raised
        raise ConfigError(f"{_where(path)}: its shards do not hold this model's weights ({first_line(e)})") from e


def source_config(path) -> GPTConfig:
    """The GPT settings the source at ``path`` was trained with (its ``seq_len``: the context it was trained at, or
    a Hugging Face config's ``max_position_embeddings``)."""
    if is_hf_folder(path):
        return hf_import.gpt_config(hf_import.read_config(path), where=f"{os.fspath(path)}/{hf_import.CONFIG_FILE}")
    settings = ck.gpt_settings(_read_aah(path))
    known = {f.name for f in fields(GPTConfig)}
    try:
        return GPTConfig(**{k: v for k, v in settings.items() if k in known})
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"{_where(path)} does not describe an aah GPT ({e})") from e


def padded_vocabulary(cfg: GPTConfig, path) -> GPTConfig:
    """``cfg`` with the source's ``vocab_size`` where it is larger: ``model.gpt.vocab_size`` follows the tokenizer,
    and a model may have more embedding rows than its tokenizer has ids (Qwen2 / Qwen3 pad theirs to a round number).
    The padded rows are kept, never read by the data (every id is below the tokenizer's count); a tokenizer with more
    ids than the source's rows is still refused by ``check_source``."""
    theirs = source_config(path).vocab_size
    return replace(cfg, vocab_size=theirs) if theirs > cfg.vocab_size else cfg


def check_source(cfg: GPTConfig, path) -> None:
    """``cfg`` builds the model the source was trained as; otherwise one line naming each setting that differs."""
    theirs, ours = asdict(source_config(path)), asdict(cfg)
    diffs = [k for k in SOURCE_SETTINGS if theirs[k] != ours[k]]
    if not diffs:
        return
    both = "; ".join(f"model.gpt.{k}: source {theirs[k]!r}, this run {ours[k]!r}" for k in diffs)
    hint = " (model.gpt.vocab_size follows data.tokenizer / data.source)" if "vocab_size" in diffs else ""
    raise ConfigError(
        f"{_where(path)} was trained with other model settings ({both}){hint}: set them to the source's "
        f"(python -m aah_lightning.retrofit {os.fspath(path)} prints them)"
    )


def source_weights(path, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The source's weights in the names of a GPT's ``state_dict``, without its window table."""
    if is_hf_folder(path):
        return hf_import.gpt_state_dict(hf_import.read_weights(path), cfg, os.fspath(path))
    if is_sharded_checkpoint(path):
        gpt = GPT(cfg)
        _load_shards(gpt, path)
        return {k: v for k, v in gpt.state_dict().items() if k != "windows"}
    state = _read_aah(path)[ck.STATE_DICT_KEY]
    prefix = ck.WINDOWS_STATE_KEY[: -len("windows")]  # "model.": the LightningModule's GPT
    return {
        ck.plain_key(k)[len(prefix) :]: v
        for k, v in state.items()
        if k.startswith(prefix) and ck.plain_key(k) != ck.WINDOWS_STATE_KEY
    }


def load_weights(gpt: GPT, path) -> None:
    """Copy the source's weights into ``gpt`` (built with the source's settings: ``check_source``); its window table
    stays what the policy set."""
    if is_sharded_checkpoint(path):
        _load_shards(gpt, path)  # into the model's tensors: no second copy of the weights
        return
    weights = source_weights(path, gpt.cfg)
    try:
        missing, unexpected = gpt.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # a tensor of another shape than the source's own settings say
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise ConfigError(f"{_where(path)}: its weights do not fit its settings ({lines[-1][:200]})") from e
    problems = [f"missing {k}" for k in missing if k != "windows"] + [f"unexpected {k}" for k in unexpected]
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ConfigError(f"{_where(path)}: its weights do not fit the model ({'; '.join(problems[:3])}{more})")


def source_tokenizer(path) -> str | None:
    """The tokenizer the source was trained with, as ``data.tokenizer`` takes it: a Hugging Face folder's
    tokenizer.json (the folder), or an aah checkpoint's ``data.tokenizer``; None for a model of token ids (the
    synthetic and recall tasks) and a folder without one."""
    if is_hf_folder(path):
        return os.fspath(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    data = ck.data_settings(_read_aah(path))
    return data.get("tokenizer") if is_text(data.get("source", "stdlib")) else None


def overlay(path) -> dict:
    """A config overlay that fine-tunes from ``path``: its ``model.gpt`` settings, ``model.init_from`` (by absolute
    path) and, where it has one, its tokenizer as ``data.tokenizer``."""
    path = Path(path).resolve()
    cfg = asdict(source_config(path))
    config = {"model": {"init_from": str(path), "gpt": {k: cfg[k] for k in SOURCE_SETTINGS if k != "vocab_size"}}}
    tokenizer = source_tokenizer(path)
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
