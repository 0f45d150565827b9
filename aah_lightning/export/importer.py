"""``aah import``: a Hugging Face Llama-family folder -> an aah checkpoint, the mirror of ``aah export``
(``exporter.py``, beside it).

    aah import <folder> --out <file.ckpt>      (= python -m aah_lightning.hf_checkpoint <folder> --out <file.ckpt>)

The model is read by ``model/hf_import.py`` (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM; its own windows in the table) and written as a checkpoint that everything reading aah checkpoints
takes (``checkpoint.load_model``: generation, inspection, the export): the GPT's settings and weights, step 0, and
the folder's ``tokenizer.json`` as the data settings' tokenizer (by absolute path). It holds no optimizer or loop
state: it starts runs (``model.init_from``, docs/retrofit.md), it does not resume one. The file is written as
``aah fit`` writes its checkpoints (``atomic.atomic_torch_save``): an interrupted import leaves no
half-written file.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path

from aah_lightning import checkpoint as ck
from aah_lightning.atomic import atomic_torch_save
from aah_lightning.errors import CheckpointWriteError, ConfigError
from aah_lightning.model import hf_import
from aah_lightning.model.gpt import GPT
from aah_lightning.model_source import TOKENIZER_FILE, HFFolder


def checkpoint_of(model: GPT, tokenizer: str) -> dict:
    """The checkpoint dict of a GPT that ``aah fit`` never trained (step 0, no optimizer or loop state)."""
    return {
        ck.GLOBAL_STEP_KEY: 0,
        ck.STATE_DICT_KEY: {ck.MODEL_PREFIX + k: v for k, v in model.state_dict().items()},
        ck.HPARAMS_NAME_KEY: None,
        ck.HYPER_PARAMETERS_KEY: {"gpt": asdict(model.cfg), ck.HPARAMS_FORMAT_ENTRY: ck.HPARAMS_FORMAT},
        ck.DATAMODULE_HYPER_PARAMETERS_KEY: {"tokenizer": tokenizer},
    }


def write_checkpoint(folder, out, seq_len: int | None = None, tokenizer: str | None = None) -> Path:
    """Import ``folder`` and write it to ``out`` as an aah checkpoint; ``tokenizer`` defaults to the folder's
    tokenizer.json. Returns the path written."""
    given = folder
    folder = Path(folder).resolve()
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"{os.fspath(given)!r} {what}: pass a Hugging Face model folder (config.json, safetensors)")
    source = HFFolder(folder)  # config.json read once; every problem with it is one line
    # The settings first (a family or setting aah cannot run), then the tokenizer, then the weights.
    hf_import.gpt_config(source.hf_config, seq_len, where=f"{folder}/{hf_import.CONFIG_FILE}")
    if tokenizer is None:
        if source.tokenizer is None:
            raise ConfigError(f"{folder}: no {TOKENIZER_FILE}: pass --tokenizer (a tokenizer.json or hub name)")
        tokenizer = source.tokenizer
    checkpoint = checkpoint_of(source.model(seq_len), tokenizer)
    # Every refusal before the first byte is written: a tokenizer with more ids than the model's vocabulary too.
    ck.checkpoint_tokenizer(checkpoint, tokenizer, setting="--tokenizer")
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out={os.fspath(out)!r} is a folder: name the checkpoint file to write (.ckpt)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(checkpoint, out)
    except OSError as e:
        raise ConfigError(f"--out={os.fspath(out)!r} could not be written ({e.strerror or e})") from e
    except CheckpointWriteError as e:  # a full disk or a failed write: one line that names the space needed
        raise ConfigError(f"--out={os.fspath(out)!r} could not be written ({e})") from e
    return out


PROG = "aah import"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Write a Hugging Face Llama-family folder (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM) as an aah checkpoint: its settings, weights, own windows and tokenizer, at step 0.",
    )
    parser.add_argument("folder", help="a Hugging Face model folder: config.json and safetensors weights")
    parser.add_argument("--out", required=True, help="the aah checkpoint to write (.ckpt)")
    parser.add_argument("--seq_len", type=int, default=None, help="the context (default: max_position_embeddings)")
    parser.add_argument("--tokenizer", default=None, help="default: the folder's tokenizer.json")
    args = parser.parse_args(argv)
    try:
        path = write_checkpoint(args.folder, args.out, args.seq_len, args.tokenizer)
        model, _ = ck.load_model(path)  # read back as every consumer will
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    cfg = model.cfg
    print(
        f"{path}: {cfg.n_layer} layers x {cfg.n_head} heads ({cfg.kv_heads} key/value), d = {cfg.n_embd}, "
        f"{model.num_params():,} parameters, context {cfg.seq_len}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
