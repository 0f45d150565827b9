"""Checks of a run as a whole - model, data, device and checkpoint together - made before any training step.

Each class checks its own settings when it is built (``GPTConfig``, ``AAHConfig``, ``TextDataModule``); what no
single class can see is checked here: the tokenizer against the model's vocabulary, the backend against the device,
and the ``--ckpt_path`` file against the model about to load it. The CLI calls ``preflight`` before it hands over to
the Trainer; ``AAHModule`` repeats the cheap checks in ``setup`` and ``on_load_checkpoint`` so that code driving a
Trainer directly gets the same errors (those two live lower down, where the module can import them:
``lit/checks.check_run`` and ``checkpoint.check_matches``). Every failure is a ``ConfigError`` naming the setting.
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from aah_lightning.checkpoint import LOG_FOLDER_KEY, check_matches, read_checkpoint
from aah_lightning.errors import ConfigError
from aah_lightning.lit.checkpointing import LastCheckpoint
from aah_lightning.lit.checks import check_run

# --ckpt_path values Lightning resolves itself; "last" is resolved here so that a missing one is an error.
_LIGHTNING_KEYWORDS = ("best", "hpc", "registry")


def resolve_ckpt_path(trainer, ckpt_path: Optional[str]) -> Optional[str]:
    """The file ``--ckpt_path`` names: ``last`` becomes the newest last*.ckpt, exactly as Lightning would choose,
    but finding none is an error here (Lightning only warns and silently starts from scratch)."""
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
    written = {p: _written(p) for p in candidates if p}
    found = [p for p, t in written.items() if t is not None]
    if not found:
        where = (
            ", ".join(dict.fromkeys(str(f) for f in folders)) or "no checkpoint folder (no ModelCheckpoint callback)"
        )
        raise ConfigError(
            f"ckpt_path='last' but there is no last checkpoint in {where}: omit --ckpt_path to start a new run, or "
            f"pass a checkpoint file"
        )
    return max(found, key=written.get)


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


def check_checkpoint(path: str, module, weights_only: Optional[bool] = None) -> None:
    """Verify the file (complete, checksums, safe to unpickle) and that it fits ``module``, reading only the pickle:
    the tensors are memory-mapped, so this costs one checksum pass, not a second full load."""
    if os.path.isdir(path) and os.path.exists(os.path.join(path, ".metadata")):
        return  # a torch.distributed.checkpoint folder: the strategy reads and checks it
    checkpoint = read_checkpoint(path, weights_only=weights_only is not False, mmap=True, setting="ckpt_path")
    check_matches(checkpoint, module, path)


def saved_log_folder(path: str, weights_only: Optional[bool] = None) -> Optional[dict]:
    """The log folder ``{"save_dir", "name", "version"}`` the run saved in checkpoint ``path``, if it says."""
    if path in _LIGHTNING_KEYWORDS or "://" in str(path):
        return None
    if os.path.isdir(path):  # a torch.distributed.checkpoint folder keeps the plain entries in meta.pt
        meta = os.path.join(path, "meta.pt")
        checkpoint = read_checkpoint(meta, setting="ckpt_path") if os.path.isfile(meta) else {}
    else:
        checkpoint = read_checkpoint(path, weights_only=weights_only is not False, mmap=True, setting="ckpt_path")
    return checkpoint.get(LOG_FOLDER_KEY)


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
        existing = os.path.abspath(folder)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        try:
            if not os.path.isdir(existing):
                raise NotADirectoryError(f"{existing} is a file")
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as e:
            setting = "checkpoint.dirpath" if isinstance(cb, LastCheckpoint) else "best_checkpoint.dirpath"
            raise ConfigError(
                f"{setting}={str(folder)!r} cannot be created or written ({e.strerror or e}): choose a folder you can "
                f"write to"
            ) from e


def preflight(trainer, module, datamodule, stage: str, ckpt_path=None, weights_only=None) -> Optional[str]:
    """Everything that can be known before the Trainer starts; returns the checkpoint file to load (if any)."""
    check_run(module, datamodule, trainer.strategy.root_device, stage)
    if stage == "fit":
        check_schedule(trainer)
        check_checkpoint_folders(trainer)
    path = resolve_ckpt_path(trainer, ckpt_path)
    if path and path not in _LIGHTNING_KEYWORDS and "://" not in str(path):
        check_checkpoint(path, module, weights_only)
    return path
