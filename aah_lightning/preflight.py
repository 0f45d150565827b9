"""Checks of a run as a whole - model, data, device and checkpoint together - made before any training step.

Each class checks its own settings when it is built (``GPTConfig``, ``AAHConfig``, ``TextDataModule``); what no
single class can see is checked here: the tokenizer against the model's vocabulary, the backend against the device,
and the ``--ckpt_path`` file against the model about to load it. The CLI calls ``preflight`` before it hands over to
the Trainer; ``AAHModule`` repeats the cheap checks in ``setup`` and ``on_load_checkpoint`` so that code driving a
Trainer directly gets the same errors (those two live lower down, where the module can import them:
``lit/checks.check_run`` and ``checkpoint.check_matches``). Every failure is a ``ConfigError`` naming the setting.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from aah_lightning.checkpoint import (
    DATAMODULE_STATE_KEY,
    check_matches,
    checkpoint_step,
    read_checkpoint,
)
from aah_lightning.errors import ConfigError
from aah_lightning.inputs import cuda_count, writable_folder
from aah_lightning.lit.checks import check_run
from aah_lightning.lit.last_checkpoint import LastCheckpoint
from aah_lightning.windows.config import POLICY_SETTINGS

# --ckpt_path values Lightning resolves itself; "last" is resolved here so that a missing one is an error.
_LIGHTNING_KEYWORDS = ("best", "hpc", "registry")


def resolve_ckpt_path(trainer, ckpt_path: Optional[str], weights_only: Optional[bool] = None) -> Optional[str]:
    """The file ``--ckpt_path`` names. ``last`` becomes the last*.ckpt of the highest step that verifies (never the
    newest by modification time, which a copy or a ``touch`` changes); finding none is an error here (Lightning only
    warns and silently starts from scratch), and a damaged one beside a good one is skipped with a warning."""
    if not ckpt_path or ckpt_path in _LIGHTNING_KEYWORDS or "://" in str(ckpt_path):
        return ckpt_path
    if ckpt_path != "last":
        if not os.path.exists(ckpt_path):
            raise ConfigError(f"ckpt_path={ckpt_path!r} does not exist: pass an existing checkpoint file, or 'last'")
        return os.fspath(ckpt_path)
    candidates, folders = set(), []
    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint):
            candidates |= _last_checkpoints(cb)
            folders.append(cb.dirpath or "the logger's new version folder (checkpoint.dirpath is not set)")
        elif isinstance(cb, OnExceptionCheckpoint):
            candidates.add(cb.ckpt_path)
    found = sorted(p for p in candidates if p and _written(p) is not None)
    if not found:
        where = (
            ", ".join(dict.fromkeys(str(f) for f in folders)) or "no checkpoint folder (no ModelCheckpoint callback)"
        )
        raise ConfigError(
            f"ckpt_path='last' but there is no last checkpoint in {where}: omit --ckpt_path to start a new run, or "
            f"pass a checkpoint file"
        )
    steps = {p: checkpoint_step(p, weights_only) for p in found}
    good = [p for p in found if steps[p] is not None]
    if not good:  # the one-line error of the newest damaged file, which names what verifies beside it
        newest = max(found, key=_written)
        read_checkpoint(newest, weights_only=weights_only is not False, mmap=True, setting="ckpt_path")
        raise ConfigError(f"ckpt_path='last' is {newest}, which holds no global_step: not a checkpoint of aah fit")
    damaged = [p for p in found if steps[p] is None]
    if damaged:
        rank_zero_warn(f"ckpt_path='last': skipping {', '.join(damaged)}: it does not verify (damaged or partial)")
    return max(good, key=lambda p: (steps[p], _written(p)))


def _last_checkpoints(cb: ModelCheckpoint) -> set[str]:
    """The last*.ckpt files (or FSDP2 folders) in a ModelCheckpoint's folder: the ones Lightning's 'last' picks from."""
    folder = cb.dirpath
    if not folder or "://" in str(folder) or not os.path.isdir(folder):
        return set()
    last, ext = cb.CHECKPOINT_NAME_LAST, cb.FILE_EXTENSION
    return {os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(last) and n.endswith(ext)}


def _written(path: str) -> Optional[float]:
    """When a checkpoint was last written: a file, or a torch.distributed.checkpoint folder (FSDP2's last.ckpt/),
    dated by its metadata, which every save rewrites. None if there is no checkpoint at ``path``."""
    if os.path.isfile(path):
        return os.path.getmtime(path)
    metadata = os.path.join(path, ".metadata")
    return os.path.getmtime(metadata) if os.path.isfile(metadata) else None


@dataclasses.dataclass
class Resumed:
    """The checkpoint a command starts from (``--ckpt_path``), read once before the Trainer starts; every check and
    lookup before the run reads this copy. Lightning then loads the file itself, once, through the run's
    ``AtomicCheckpointIO``: where the tensors go (which device, which shards) is the strategy's to decide, so that
    second read is deliberate.

    ``checkpoint``: the dict as read (verified, weights-only unless ``--weights_only false``, tensors memory-mapped:
    only the pickle is read); for a torch.distributed.checkpoint folder (FSDP2), the plain entries of its ``meta.pt``,
    and ``sharded`` is True (the strategy reads and checks the weights)."""

    path: str
    checkpoint: dict
    sharded: bool = False

    @classmethod
    def read(cls, path: Optional[str], weights_only: Optional[bool] = None) -> Optional[Resumed]:
        """None for no checkpoint, a keyword Lightning resolves itself (``best``, ``hpc``) or a remote path."""
        if not path or path in _LIGHTNING_KEYWORDS or "://" in str(path):
            return None
        if os.path.isdir(path) and not os.path.exists(os.path.join(path, ".metadata")):
            read_checkpoint(path, setting="ckpt_path")  # a folder that is no distributed checkpoint: its one line
        if os.path.isdir(path):  # a torch.distributed.checkpoint folder keeps the plain entries in meta.pt
            meta = os.path.join(path, "meta.pt")
            checkpoint = read_checkpoint(meta, setting="ckpt_path") if os.path.isfile(meta) else {}
            return cls(path, checkpoint, sharded=os.path.exists(os.path.join(path, ".metadata")))
        checkpoint = read_checkpoint(path, weights_only=weights_only is not False, mmap=True, setting="ckpt_path")
        return cls(path, checkpoint)

    def entry(self, key: str):
        return self.checkpoint.get(key)

    def check(self, module, datamodule, trainer, stage: str) -> None:
        """The checkpoint against the model about to load it (shapes, settings), and for ``fit`` the data position
        against this run's data layout (``DataPosition.check_resume``)."""
        if not self.sharded:
            check_matches(self.checkpoint, module, self.path)
            if hasattr(module, "checked_checkpoint"):  # its on_load_checkpoint need not check this file again
                module.checked_checkpoint = os.path.realpath(self.path)
        saved = self.entry(DATAMODULE_STATE_KEY)
        if stage == "fit" and hasattr(datamodule, "check_resume") and saved and "layout" in saved:
            datamodule.check_resume(saved["layout"], trainer)
            if hasattr(datamodule, "position"):  # nor its load_state_dict this layout
                datamodule.position.checked_layout = saved["layout"]


def check_schedule(trainer) -> None:
    """An integer val_check_interval longer than the run would make Lightning stop with a ValueError after loading
    the data (the data module's step-based loader is max_steps long). A short smoke run of a long config should just
    run: it validates once, at its end, and says so in one warning."""
    interval, steps = trainer.val_check_interval, trainer.max_steps
    batches = steps * trainer.accumulate_grad_batches
    if (
        isinstance(interval, int)
        and steps > 0
        and trainer.check_val_every_n_epoch is not None
        and trainer.limit_val_batches
        and interval > batches
    ):
        rank_zero_warn(
            f"trainer.val_check_interval={interval} is more than the run's {batches} training batches "
            f"(trainer.max_steps={steps}): validating once, at the end of the run"
        )
        trainer.val_check_interval = batches


def check_checkpoint_folders(trainer) -> None:
    """Every checkpoint folder can be created and written, so a bad ``checkpoint.dirpath`` is one line now rather
    than a traceback at the first save. Nothing is created: the nearest folder that exists gets a temporary file."""
    for cb in trainer.callbacks:
        folder = getattr(cb, "dirpath", None) if isinstance(cb, ModelCheckpoint) else None
        if not folder or "://" in str(folder):
            continue
        setting = "checkpoint.dirpath" if isinstance(cb, LastCheckpoint) else "best_checkpoint.dirpath"
        writable_folder(str(folder), setting)


def _accelerators() -> dict[str, bool]:
    """Lightning's accelerator names and whether each can run here."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    return {name: AcceleratorRegistry[name]["accelerator"].is_available() for name in AcceleratorRegistry}


def _count(value) -> Optional[int]:
    """An int, or the int a string of digits (with an optional '-') spells; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _indices(value) -> Optional[list[int]]:
    """The device indices of a list, or of a string 'i,j,...' (Lightning's form); None for anything else."""
    if isinstance(value, (list, tuple)) and all(_count(v) is not None for v in value):
        return [_count(v) for v in value]
    if isinstance(value, str) and "," in value:
        parts = [p for p in value.split(",") if p.strip()]
        if parts and all(_count(p) is not None for p in parts):
            return [_count(p) for p in parts]
    return None


def check_devices(accelerator, devices) -> None:
    """``trainer.accelerator`` names an accelerator this machine has, and ``trainer.devices`` devices it has: one
    line naming the setting and what is allowed here, instead of Lightning's traceback from inside the Trainer
    (``Torch not compiled with CUDA enabled``, ``No supported gpu backend found!``, ``You requested gpu: [3]``)."""
    if accelerator is not None and not isinstance(accelerator, str):
        return  # an Accelerator object from a class_path: Lightning checks it
    known = _accelerators()
    here = [name for name in ("cpu", "cuda", "mps", "tpu") if known.get(name)]
    here_text = ", ".join(here[:-1]) + " or " + here[-1] if len(here) > 1 else here[0]
    name = (accelerator or "auto").lower()
    if name not in known and name not in ("auto", "gpu"):
        raise ConfigError(
            f"trainer.accelerator={accelerator!r} is not allowed: one of auto, cpu, gpu, "
            f"{', '.join(sorted(n for n in known if n != 'cpu'))} (available on this machine: {here_text})"
        )
    if name == "gpu":
        name = "mps" if known.get("mps") else "cuda" if known.get("cuda") else None
        if name is None:
            raise ConfigError(
                f"trainer.accelerator={accelerator!r} is not allowed: no GPU (CUDA or Apple MPS) is available on this "
                f"machine: use cpu or auto (available here: {here_text})"
            )
    elif name == "auto":
        name = "cuda" if known.get("cuda") else "mps" if known.get("mps") else "cpu"
    elif not known[name]:
        what = {"cuda": "no CUDA device", "mps": "no Apple GPU (MPS)", "tpu": "no TPU (torch_xla)"}.get(name, "it")
        raise ConfigError(
            f"trainer.accelerator={accelerator!r} is not allowed: {what} is available on this machine: use "
            f"{here_text} (or auto)"
        )
    if devices is None or devices == "auto":
        return
    count, indices = _count(devices), _indices(devices)
    where = f"with trainer.accelerator={accelerator or 'auto'!r}" + (f" ({name})" if name != accelerator else "")
    if name == "cpu":
        if count is None or count < 1:
            raise ConfigError(
                f"trainer.devices={devices!r} is not allowed {where}: a positive number of processes, or auto"
            )
    elif name == "cuda":
        n = cuda_count()
        allowed = (
            f"this machine has {n} CUDA device{'s' if n != 1 else ''}: use a number from 1 to {n}, -1 (all), auto, "
            f"or a list of indices from 0 to {n - 1}"
        )
        if indices is not None:
            if not indices or any(i < 0 or i >= n for i in indices) or len(set(indices)) != len(indices):
                raise ConfigError(f"trainer.devices={devices!r} is not allowed {where}: {allowed}")
        elif count is None or count == 0 or count < -1 or count > n:
            raise ConfigError(f"trainer.devices={devices!r} is not allowed {where}: {allowed}")
    elif name == "mps" and not (count == 1 or count == -1 or indices == [0]):
        raise ConfigError(f"trainer.devices={devices!r} is not allowed {where}: an Apple GPU is one device (1)")


# A model whose embeddings outweigh the rest this many times over is rarely what a recall run means to train.
EMBEDDING_WARN_RATIO = 10


def warn_questionable(module, datamodule) -> None:
    """One warning line per setting that is legal but probably not meant: settings of ``model.aah`` that the chosen
    policy does not read (``candidates`` under ``fixed``, another policy's block: ``AAHConfig.ignored``); a recall
    vocabulary (``data.recall.keys``, ``data.recall.values``) that makes the embeddings
    many times the rest of the model."""
    aah = getattr(module, "aah_config", None)
    ignored = aah.ignored() if aah is not None else []
    if ignored:
        reads = [f"model.aah.{name}" for name in POLICY_SETTINGS if name in aah.reads()]
        rank_zero_warn(
            f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect with "
            f"model.aah.policy={aah.policy!r}, which reads {' and '.join(reads) or 'none of these settings'}: "
            f"{'it is' if len(ignored) == 1 else 'they are'} ignored"
        )
    data = getattr(datamodule, "config", None)
    if data is not None and (data.source == "recall" or data.recall.fraction > 0):
        gpt = module.gpt_config
        embeddings = gpt.vocab_size * gpt.n_embd  # the input embedding, tied to the output head
        total = sum(p.numel() for p in module.parameters())
        rest = max(total - embeddings, 1)
        if embeddings > EMBEDDING_WARN_RATIO * rest:
            rank_zero_warn(
                f"data.recall.keys={data.recall.keys} (with data.recall.values={data.recall.values}) makes a "
                f"vocabulary of {gpt.vocab_size} tokens: the embeddings hold {embeddings / 1e6:.1f} M of the model's "
                f"{total / 1e6:.1f} M parameters, {embeddings / rest:.0f} times the rest; fewer keys train faster"
            )


def preflight(
    trainer, module, datamodule, stage: str, ckpt_path=None, weights_only=None
) -> tuple[Optional[str], Optional[Resumed]]:
    """Everything that can be known before the Trainer starts; returns the checkpoint file to load (if any) and the
    one read of it that the checks used (``Resumed``; None where Lightning resolves the path itself).

    In order: the run as a whole (model, data, device); for ``fit`` the settings that are derived rather than given
    (``trainer.accumulate_grad_batches`` from ``data.global_batch_size``: the one place a check sets something), the
    schedule and the checkpoint folders; the checkpoint; last, the checkpoint folder's lock."""
    check_run(module, datamodule, trainer.strategy.root_device, stage)
    if stage == "fit":
        warn_questionable(module, datamodule)
        if hasattr(datamodule, "resolve_accumulation"):  # derived: data.global_batch_size sets the accumulation
            datamodule.resolve_accumulation(trainer)
        check_schedule(trainer)
        check_checkpoint_folders(trainer)
    path = resolve_ckpt_path(trainer, ckpt_path, weights_only)
    resumed = Resumed.read(path, weights_only)
    if resumed is not None:
        resumed.check(module, datamodule, trainer, stage)
    if stage == "fit":  # last: a run refused by a check above holds no lock
        for cb in trainer.callbacks:
            if isinstance(cb, LastCheckpoint):
                cb.lock_folder(trainer, create=False)
    return path, resumed
