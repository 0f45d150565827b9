"""``aah import``: a Hugging Face Llama-family folder or GGUF file -> an aah checkpoint, the mirror of ``aah export``
(``exporter.py``, beside it).

    aah import <folder or file.gguf> --out <file.ckpt>      (= python -m aah_lightning.hf_checkpoint ...)

The model is read by ``model/hf_import.py`` (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM; its own windows in the table), opened once as a ``model_source`` kind: ``HFFolder`` for a folder,
``GGUFFile`` for a GGUF file (transformers' GGUF loader dequantises its weights to float32; the 'gguf' extra). It is
written as a checkpoint that everything reading aah checkpoints takes (``checkpoint.load_model``: generation,
inspection, the export): the GPT's settings and weights, step 0, and the tokenizer as the data settings' tokenizer
(by absolute path): the folder's ``tokenizer.json``, or the GGUF file's, built from its metadata and written beside
the checkpoint as ``<name>.tokenizer.json``. It holds no optimizer or loop state: it starts runs
(``model.init_from``, docs/retrofit.md), it does not resume one. Every refusal comes before the first byte is
written, and the files are written as ``aah fit`` writes its checkpoints (``atomic.atomic_torch_save``), under
temporary names that they lose only once the checkpoint has been read back: a refused, failed or interrupted import
leaves nothing under the names it would write. Reading and writing a large model show progress
(``aah_lightning.progress``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from aah_lightning import checkpoint as ck
from aah_lightning.atomic import atomic_torch_save, atomic_write_text, discard, new_folders, publish_file
from aah_lightning.data.tokenizers import load_tokenizer
from aah_lightning.errors import CheckpointWriteError, ConfigError
from aah_lightning.model import hf_import
from aah_lightning.model.gpt import GPT
from aah_lightning.model_source import TOKENIZER_FILE, GGUFFile, HFFolder
from aah_lightning.progress import stage
from aah_lightning.retrofit import longer_context

PROG = "aah import"
# A GGUF file's tokenizer, written beside the checkpoint: <out without .ckpt> + this.
TOKENIZER_SUFFIX = ".tokenizer.json"
WHAT = "pass a Hugging Face model folder (config.json, safetensors) or a GGUF file"


def checkpoint_of(model: GPT, tokenizer: str) -> dict:
    """The checkpoint dict of a GPT that ``aah fit`` never trained (step 0, no optimizer or loop state)."""
    return {
        ck.GLOBAL_STEP_KEY: 0,
        ck.STATE_DICT_KEY: {ck.MODEL_PREFIX + k: v for k, v in model.state_dict().items()},
        ck.HPARAMS_NAME_KEY: None,
        ck.HYPER_PARAMETERS_KEY: {"gpt": asdict(model.cfg), ck.HPARAMS_FORMAT_ENTRY: ck.HPARAMS_FORMAT},
        ck.DATAMODULE_HYPER_PARAMETERS_KEY: {"tokenizer": tokenizer},
    }


def tokenizer_path(out) -> Path:
    """Where the import of a GGUF file writes its tokenizer: beside the checkpoint ``out``."""
    out = Path(out)
    return out.with_name(out.stem + TOKENIZER_SUFFIX)


def open_source(path) -> HFFolder | GGUFFile:
    """The folder or GGUF file ``path`` as the ``model_source`` kind that reads it (its config read once: every
    problem with it is one line)."""
    resolved = Path(path).resolve()
    if resolved.is_dir():
        return HFFolder(resolved)
    if not resolved.exists():
        raise ConfigError(f"{os.fspath(path)!r} does not exist: {WHAT}")
    if not GGUFFile.recognises(resolved):
        raise ConfigError(f"{os.fspath(path)!r} is not a folder or a GGUF file: {WHAT}")
    return GGUFFile(resolved)


def _checked_gguf_tokenizer(source: GGUFFile, vocab_size: int) -> str:
    """The GGUF file's tokenizer.json text, refused in one line if it has more ids than the model."""
    text = source.tokenizer_json()
    with tempfile.TemporaryDirectory() as tmp:  # load_tokenizer reads a file; nothing is written beside --out yet
        (Path(tmp) / TOKENIZER_FILE).write_text(text, encoding="utf-8")
        ids = load_tokenizer(tmp, "--tokenizer").vocab_size
    if ids > vocab_size:
        raise ConfigError(
            f"{source.path}: the tokenizer of its metadata has {ids} ids, its model {vocab_size}: pass --tokenizer "
            f"(the tokenizer the model was trained with)"
        )
    return text


def write_checkpoint(source, out, seq_len: int | None = None, tokenizer: str | None = None) -> Path:
    """Import ``source`` (a Hugging Face folder or a GGUF file) and write it to ``out`` as an aah checkpoint;
    ``tokenizer`` defaults to the folder's tokenizer.json, or the GGUF file's, written beside ``out``
    (``tokenizer_path``). Returns the path written."""
    return imported(source, out, seq_len, tokenizer)[0]


def imported(source, out, seq_len: int | None = None, tokenizer: str | None = None) -> tuple[Path, GPT]:
    """``write_checkpoint``, and the model as the checkpoint written gives it back (``checkpoint.load_model``).

    Every check comes before the first byte is written; the last, the written checkpoint read back as every consumer
    reads it, runs on the files under their temporary names, which get their names only once it has passed. A
    refusal or a failed write leaves nothing: no file, no temporary file, not the folders made for ``out``."""
    source = open_source(source)
    where = f"{source.path}/{hf_import.CONFIG_FILE}" if isinstance(source, HFFolder) else str(source.path)
    # The settings first (a family or setting aah cannot run), then the output, the tokenizer, the weights.
    hf_import.gpt_config(source.hf_config, seq_len, where=where)
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out={os.fspath(out)!r} is a folder: name the checkpoint file to write (.ckpt)")
    longer = None if seq_len is None else longer_context(seq_len, source, "--seq_len")
    if longer is not None:  # allowed (a context is extended by fine-tuning at it), but worth a line
        print(f"{PROG}: warning: {longer}", file=sys.stderr)
    tokenizer_text = None
    if tokenizer is None and isinstance(source, GGUFFile):
        tokenizer_text = _checked_gguf_tokenizer(source, source.config.vocab_size)
        tokenizer = str(tokenizer_path(out).resolve())
    elif tokenizer is None:
        if source.tokenizer is None:
            raise ConfigError(f"{source.path}: no {TOKENIZER_FILE}: pass --tokenizer (a tokenizer.json or hub name)")
        tokenizer = source.tokenizer
    with stage(f"reading {source.path}"):
        checkpoint = checkpoint_of(source.model(seq_len), tokenizer)
    if tokenizer_text is None:
        # Every refusal before the first byte is written: a tokenizer with more ids than the model's vocabulary too.
        ck.checkpoint_tokenizer(checkpoint, tokenizer, setting="--tokenizer")
    staged: list[tuple[str, Path]] = []  # (temporary name, name), in the order they are published
    try:
        with new_folders(out.parent):
            try:
                with stage(f"writing {out}"):
                    if tokenizer_text is not None:  # first, so that the checkpoint never names a file that is not there
                        staged.append((atomic_write_text(tokenizer, tokenizer_text, publish=False), Path(tokenizer)))
                    staged.append((atomic_torch_save(checkpoint, out, publish=False), out))
                del checkpoint  # the read-back below holds the model once, not twice
                written = staged[-1][0]
                try:  # read back as every consumer will, before it has its name
                    model, _ = ck.load_model(written, tokenizer=staged[0][0] if tokenizer_text else None)
                except ConfigError as e:
                    raise ConfigError(str(e).replace(written, os.fspath(out))) from e
                for tmp, path in staged:
                    publish_file(tmp, path)
            except BaseException:
                for tmp, _ in staged:
                    discard(tmp)
                raise
    except (OSError, CheckpointWriteError) as e:  # a full disk or a failed write: one line that names the space needed
        reason = e.reason if isinstance(e, CheckpointWriteError) else (e.strerror or e)
        raise ConfigError(
            f"--out={os.fspath(out)!r} could not be written: {reason}; nothing was left there: free space there or "
            f"choose another --out"
        ) from e
    return out, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Write a Hugging Face Llama-family folder (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM) or a GGUF file of those families (pip install 'aah-lightning[gguf]') as an aah checkpoint: "
        "its settings, float32 weights, own windows and tokenizer, at step 0.",
    )
    parser.add_argument(
        "source", help="a Hugging Face model folder (config.json and safetensors weights) or a GGUF file (.gguf)"
    )
    parser.add_argument("--out", required=True, help="the aah checkpoint to write (.ckpt)")
    parser.add_argument("--seq_len", type=int, default=None, help="the context (default: max_position_embeddings)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help=f"default: the folder's tokenizer.json, or the GGUF file's, written beside --out as <name>{TOKENIZER_SUFFIX}",
    )
    args = parser.parse_args(argv)
    try:
        path, model = imported(args.source, args.out, args.seq_len, args.tokenizer)
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
