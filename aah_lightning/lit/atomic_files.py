"""Checkpoint files that a kill never leaves half-written, and the one-line error of a write that fails.

``atomic_torch_save`` writes a checkpoint to a hidden temporary file in the destination folder (``partial_name``),
flushes it to disk (fsync), renames it over the destination with ``os.replace`` (atomic within one file system) and
fsyncs the folder so that the rename itself is durable: at every moment the destination holds either the previous
complete checkpoint or the new complete one. Lightning's default ``TorchCheckpointIO`` writes through an fsspec
transaction whose temporary file lives in the system temp folder: when that is another file system than the
checkpoint folder (local /tmp, shared scratch), the commit is a copy into the destination, which a kill can truncate;
it also never fsyncs. Temporary files that killed writers left behind are removed by the next save
(``remove_stale_partials``). A failed write (a full disk, a quota) is a ``CheckpointWriteError`` naming the folder and
the space needed.

``AtomicCheckpointIO`` is the CLI's checkpoint plugin: it saves through ``atomic_torch_save`` and loads through
``aah_lightning.checkpoint.load_checkpoint_file`` (a complete PyTorch archive whose CRC32 checksums match, unpickled
with ``weights_only=True`` unless the user passes ``--weights_only false``; every failure is a one-line
``ConfigError`` naming the file). FSDP2's checkpoint folders get the same guarantee from ``lit/fsdp2_saves.py``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import uuid
from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from aah_lightning.checkpoint import is_remote, load_checkpoint_file
from aah_lightning.errors import CheckpointWriteError

# Temporary files are hidden and do not end in .ckpt, so Lightning's "last" search (last*.ckpt) never picks one.
PARTIAL_PREFIX = ".aah-partial-"


def partial_name() -> str:
    return f"{PARTIAL_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not supported on this platform (Windows): the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(folder: str) -> list[str]:
    """Delete temporary files (and checkpoint folders) that writers on this host left when they were killed
    mid-write."""
    host, removed = socket.gethostname(), []
    for name in os.listdir(folder):
        if not name.startswith(PARTIAL_PREFIX):
            continue
        parts = name[len(PARTIAL_PREFIX) :].rsplit("-", 2)  # host-pid-random; the host may contain '-'
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit() or pid_alive(int(parts[1])):
            continue
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(name)
    return removed


def _nbytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` (dicts, lists, tuples): about what ``torch.save`` writes for it."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes() if obj.device.type != "meta" else 0
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# torch.save reports a failed write of its archive as a RuntimeError without an errno (torch 2.13: "[enforce fail at
# inline_container.cc:...] . unexpected pos 704 vs 598"; earlier: "PytorchStreamWriter failed writing file ...").
_TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")


_FULL_SLACK = 16 * 2**20


def _write_error(e: BaseException, path: str, folder: str, needed: int, written: int) -> Optional[CheckpointWriteError]:
    """``e`` (raised while ``path`` was written) as one line, if it is a failed write; None otherwise. A full disk
    (ENOSPC or a quota, or torch's errno-less write failure with less room left than the rest of the file) names the
    folder, the space the checkpoint needs and what is free."""
    torch_write = isinstance(e, RuntimeError) and any(m in str(e) for m in _TORCH_WRITE_FAILED)
    if not isinstance(e, OSError) and not torch_write:
        return None
    try:
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
    except (OSError, AttributeError):  # no statvfs (Windows)
        free = None
    # A failed write leaves up to a buffer's worth of room unused: some slack over the rest of the file.
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
        torch_write and free is not None and free < needed - written + _FULL_SLACK
    )
    if full:
        room = f", {_mib(free)} free" if free is not None else ""
        return CheckpointWriteError(
            f"could not write checkpoint {path}: no space left in {folder} (the checkpoint needs about "
            f"{_mib(needed)}{room}); the previous checkpoint there (if any) is intact: free space there, or set "
            f"checkpoint.dirpath to a folder with room"
        )
    reason = e.strerror or e if isinstance(e, OSError) else str(e).strip().splitlines()[0]
    return CheckpointWriteError(
        f"could not write checkpoint {path}: {reason}; the previous checkpoint there (if any) is intact"
    )


def atomic_torch_save(obj: Any, path) -> None:
    """``torch.save(obj, path)`` such that ``path`` is never seen half-written, even after a SIGKILL."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_partials(folder)
    tmp = os.path.join(folder, partial_name())
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        written = os.path.getsize(tmp) if os.path.isfile(tmp) else 0
        with contextlib.suppress(OSError):
            os.remove(tmp)
        needed = max(_nbytes(obj), os.path.getsize(path) if os.path.isfile(path) else 0)  # the previous one's size
        error = _write_error(e, path, folder, needed, written)
        if error is not None:
            raise error from e
        raise
    fsync_dir(folder)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint plugin with crash-safe saving and verified, weights-only loading."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options!r}")
        if is_remote(path):  # object stores have their own atomic put
            return super().save_checkpoint(checkpoint, path)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(
        self,
        path,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        return load_checkpoint_file(path, map_location=map_location, weights_only=weights_only)
