"""A trained model's files, opened once: ``ModelSource.open(path)``.

A source is one of ``KINDS``, each a subclass that knows how to recognise its files and read them:

* ``CheckpointFile``: an aah checkpoint file (``.ckpt`` of ``aah fit`` or of ``aah import``), verified and read
  weights-only with its tensors memory-mapped;
* ``ShardedCheckpoint``: the checkpoint folder of an FSDP2 run (torch.distributed.checkpoint): its plain entries
  from ``meta.pt``, its weights read from the shards straight into a model's tensors;
* ``HFFolder``: a Hugging Face model folder (``config.json`` and safetensors weights, read by ``model/hf_import.py``);
* ``GGUFFile``: a GGUF file (llama.cpp's format) of the same families, read through transformers' GGUF loader
  (``model/hf_import.py`` too). ``aah import`` reads it; a run does not (``IMPORT_FIRST``): ``ModelSource.open``
  refuses it in one line that says to import it first, since a run needs its tokenizer as a file and should not
  dequantise the weights again in every run and process.

Each answers the same questions: ``config`` (the GPT settings it was trained with), ``padded(cfg)`` (a run's settings
with the source's larger vocabulary), ``tokenizer`` (what ``data.tokenizer`` takes, or None for a model of token ids),
``weights(cfg)`` (its weights in a GPT's names) and ``load_into(gpt)``. Opening reads what every answer needs (the
checkpoint dict, the config) once; the weights of a folder or GGUF file are read when asked for. Another kind of file
is one more subclass with ``recognises`` and the readers, in ``KINDS``.

Every problem is one ``ConfigError`` line that names ``setting`` (``model.init_from`` unless the caller says).

Layer: over ``checkpoint`` and ``model/``, under ``retrofit`` and ``lit/``.
"""

from __future__ import annotations

import os
from dataclasses import fields, replace
from functools import cached_property

import torch

from aah_lightning import checkpoint as ck
from aah_lightning.errors import ConfigError
from aah_lightning.extras import install_hint
from aah_lightning.inputs import first_line
from aah_lightning.model import hf_import
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT

SETTING = "model.init_from"
# A torch.distributed.checkpoint folder (an FSDP2 run's last.ckpt/): its index, and Lightning's file of the plain entries.
SHARDS_INDEX, SHARDS_META = ".metadata", "meta.pt"
TOKENIZER_FILE = "tokenizer.json"


class ModelSource:
    """A trained model's files at ``path``, opened by ``ModelSource.open``."""

    # A kind that only ``aah import`` reads: ``open`` refuses it with ``import_first``'s line.
    IMPORT_FIRST = False

    def __init__(self, path, setting: str = SETTING):
        self.path, self.setting = path, setting

    @staticmethod
    def recognises(path) -> bool:
        raise NotImplementedError

    @classmethod
    def open(cls, path, setting: str = SETTING) -> ModelSource:
        """The source at ``path``, of the first kind in ``KINDS`` that recognises it (a source already opened is
        returned as it is, so a caller that holds one never reads the files again)."""
        if isinstance(path, ModelSource):
            return path
        if not os.path.exists(path):
            raise ConfigError(
                f"{where(path, setting)} does not exist: pass an aah checkpoint or a Hugging Face model folder"
            )
        for kind in KINDS:
            if kind.recognises(path):
                if kind.IMPORT_FIRST:
                    raise ConfigError(kind.import_first(path, setting))
                return kind(path, setting)
        raise ConfigError(
            f"{where(path, setting)} is a folder without {hf_import.CONFIG_FILE}: pass an aah checkpoint or a Hugging "
            f"Face model folder"
        )

    @classmethod
    def import_first(cls, path, setting: str = SETTING) -> str:
        """The line that refuses a source of an ``IMPORT_FIRST`` kind."""
        raise NotImplementedError

    @property
    def where(self) -> str:
        return where(self.path, self.setting)

    # -- what every kind answers -----------------------------------------------------------------------------------
    @property
    def config(self) -> GPTConfig:
        """The GPT settings the source was trained with (its ``seq_len``: the context it was trained at, or a Hugging
        Face config's ``max_position_embeddings``)."""
        raise NotImplementedError

    @property
    def tokenizer(self) -> str | None:
        """The tokenizer the source was trained with, as ``data.tokenizer`` takes it; None for a model of token ids
        and a folder without one."""
        raise NotImplementedError

    def weights(self, cfg: GPTConfig) -> dict[str, torch.Tensor]:
        """The source's weights in the names of a GPT's ``state_dict``, without its window table."""
        raise NotImplementedError

    def padded(self, cfg: GPTConfig) -> GPTConfig:
        """``cfg`` with the source's ``vocab_size`` where it is larger (a padded vocabulary: its rows are kept)."""
        theirs = self.config.vocab_size
        return replace(cfg, vocab_size=theirs) if theirs > cfg.vocab_size else cfg

    def load_into(self, gpt: GPT) -> None:
        """Copy the source's weights into ``gpt`` (built with the source's settings); its window table is kept."""
        weights = self.weights(gpt.cfg)
        try:
            missing, unexpected = gpt.load_state_dict(weights, strict=False)
        except RuntimeError as e:  # a tensor of another shape than the source's own settings say
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            raise ConfigError(f"{self.where}: its weights do not fit its settings ({lines[-1][:200]})") from e
        problems = [f"missing {k}" for k in missing if k != "windows"] + [f"unexpected {k}" for k in unexpected]
        if problems:
            more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
            raise ConfigError(f"{self.where}: its weights do not fit the model ({'; '.join(problems[:3])}{more})")


def where(path, setting: str = SETTING) -> str:
    return f"{setting}={os.fspath(path)!r}"


class _AahCheckpoint(ModelSource):
    """What the two kinds of aah checkpoint share: the settings and data settings of their checkpoint dict."""

    NEEDED: tuple[str, ...] = ()

    def __init__(self, path, setting: str = SETTING):
        super().__init__(path, setting)
        self.checkpoint = self._read()
        if any(key not in self.checkpoint for key in self.NEEDED):
            raise ConfigError(f"{self.where} is not a checkpoint written by aah (no {'/'.join(self.NEEDED)})")

    def _read(self) -> dict:
        raise NotImplementedError

    @cached_property
    def config(self) -> GPTConfig:
        settings = ck.gpt_settings(self.checkpoint)
        known = {f.name for f in fields(GPTConfig)}
        try:
            return GPTConfig(**{k: v for k, v in settings.items() if k in known})
        except (ConfigError, TypeError, ValueError) as e:
            raise ConfigError(f"{self.where} does not describe an aah GPT ({e})") from e

    @property
    def tokenizer(self) -> str | None:
        data = ck.data_settings(self.checkpoint)
        return data.get("tokenizer") if ck.has_text_tokenizer(data) else None


class CheckpointFile(_AahCheckpoint):
    """An aah checkpoint file: verified, weights-only, tensors memory-mapped."""

    NEEDED = (ck.HYPER_PARAMETERS_KEY, ck.STATE_DICT_KEY)

    @staticmethod
    def recognises(path) -> bool:
        return not os.path.isdir(path)

    def _read(self) -> dict:
        return ck.read_checkpoint(self.path, mmap=True, setting=self.setting)

    def weights(self, cfg: GPTConfig) -> dict[str, torch.Tensor]:
        return {k: v for k, v in ck.gpt_state(self.checkpoint[ck.STATE_DICT_KEY]).items() if k != "windows"}


class ShardedCheckpoint(_AahCheckpoint):
    """The checkpoint folder of an FSDP2 run: each process reads the shards whole."""

    NEEDED = (ck.HYPER_PARAMETERS_KEY,)

    @staticmethod
    def recognises(path) -> bool:
        return os.path.isdir(path) and os.path.isfile(os.path.join(path, SHARDS_INDEX))

    def _read(self) -> dict:
        meta = os.path.join(self.path, SHARDS_META)
        if not os.path.isfile(meta):
            raise ConfigError(f"{self.where} is a sharded checkpoint folder without {SHARDS_META}: not written by aah")
        return ck.read_checkpoint(meta, mmap=True, setting=self.setting)

    def weights(self, cfg: GPTConfig) -> dict[str, torch.Tensor]:
        gpt = GPT(cfg)
        self.load_into(gpt)
        return {k: v for k, v in gpt.state_dict().items() if k != "windows"}

    def load_into(self, gpt: GPT) -> None:
        """Into ``gpt``'s own tensors, whole, in this process alone: no second copy of the weights."""
        import torch.distributed.checkpoint as dcp

        wanted = {ck.MODEL_PREFIX + k: v for k, v in gpt.state_dict().items() if k != "windows"}
        try:
            with torch.no_grad():
                dcp.load({ck.STATE_DICT_KEY: wanted}, checkpoint_id=os.fspath(self.path), no_dist=True)
        except Exception as e:  # torch.distributed.checkpoint's CheckpointException wraps what each read raised
            raise ConfigError(f"{self.where}: its shards do not hold this model's weights ({first_line(e)})") from e


class HFFolder(ModelSource):
    """A Hugging Face model folder: its config read on opening, its safetensors weights when asked for."""

    def __init__(self, path, setting: str = SETTING):
        super().__init__(path, setting)
        self.hf_config = hf_import.read_config(path)

    @staticmethod
    def recognises(path) -> bool:
        return os.path.isdir(path) and os.path.isfile(os.path.join(path, hf_import.CONFIG_FILE))

    @cached_property
    def config(self) -> GPTConfig:
        return hf_import.gpt_config(self.hf_config, where=f"{os.fspath(self.path)}/{hf_import.CONFIG_FILE}")

    @property
    def tokenizer(self) -> str | None:
        return os.fspath(self.path) if os.path.isfile(os.path.join(self.path, TOKENIZER_FILE)) else None

    def weights(self, cfg: GPTConfig) -> dict[str, torch.Tensor]:
        return hf_import.gpt_state_dict(hf_import.read_weights(self.path), cfg, os.fspath(self.path))

    def model(self, seq_len: int | None = None) -> GPT:
        """The whole model as it stands, for ``aah import``: the GPT at context ``seq_len`` (default its
        ``max_position_embeddings``) with its weights and its own windows (a sliding-window config's)."""
        return hf_import.import_folder(self.path, seq_len, hf=self.hf_config)


class GGUFFile(ModelSource):
    """A GGUF file of a Llama-family model (the 'gguf' extra): its config rebuilt from the metadata on opening, its
    weights dequantised to float32 and its tokenizer built from the metadata when asked for, all by transformers'
    GGUF loader. Read by ``aah import`` (``export/importer.py``), which writes the checkpoint and tokenizer.json that
    a run takes."""

    IMPORT_FIRST = True

    def __init__(self, path, setting: str = SETTING):
        super().__init__(path, setting)
        self.hf_config = hf_import.read_gguf_config(path)

    @staticmethod
    def recognises(path) -> bool:
        return os.path.isfile(path) and hf_import.is_gguf(path)

    @classmethod
    def import_first(cls, path, setting: str = SETTING) -> str:
        out = os.path.splitext(os.path.basename(os.fspath(path)))[0] + ".ckpt"
        return (
            f"{where(path, setting)} is a GGUF file: a run starts from its aah import, so import it once "
            f"(aah import {os.fspath(path)} --out {out}; {install_hint(hf_import.GGUF_EXTRA)}) and pass {out}"
        )

    @cached_property
    def config(self) -> GPTConfig:
        return hf_import.gpt_config(self.hf_config, where=os.fspath(self.path))

    @property
    def tokenizer(self) -> str | None:
        return None  # inside the file, not a file data.tokenizer takes: tokenizer_json() gives it

    def tokenizer_json(self) -> str:
        """The tokenizer of the file's metadata as ``tokenizer.json`` text."""
        return hf_import.read_gguf_tokenizer(self.path)

    def weights(self, cfg: GPTConfig) -> dict[str, torch.Tensor]:
        weights = hf_import.read_gguf_weights(self.path, self.hf_config)
        return hf_import.gpt_state_dict(weights, cfg, os.fspath(self.path))

    def model(self, seq_len: int | None = None) -> GPT:
        """The whole model, as ``HFFolder.model`` gives a folder's."""
        return hf_import.import_gguf(self.path, seq_len, hf=self.hf_config)


# The kinds of source, tried in order by ``ModelSource.open``: folders by their marker file (config.json first), then
# files: a GGUF file by its first bytes, any other file as an aah checkpoint.
KINDS: list[type[ModelSource]] = [HFFolder, ShardedCheckpoint, GGUFFile, CheckpointFile]
