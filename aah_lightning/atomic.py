"""Files aah writes that a kill never leaves half-written, and the one-line error of a write that fails.

Every file aah writes goes through here. ``atomic_write`` writes to a hidden temporary file in the destination folder
(``partial_name``), flushes it to disk (fsync), renames it over the destination with ``os.replace`` (atomic within
one file system) and fsyncs the folder so that the rename itself is durable: at every moment the destination holds
either the previous complete file or the new complete one. ``atomic_torch_save`` (checkpoints, ``aah import``) and
``atomic_write_text`` (predictions, reports, tables) use it; a folder written as a whole (``aah export``, a token
folder) is written under a temporary name beside its destination and published with ``publish_folder``. Temporary
files that killed writers left behind are removed by the next write (``remove_stale_partials``). A failed write (a
full disk, a quota) is a ``CheckpointWriteError`` naming the folder and the space needed. The one exception is the
checkpoint folder's lock (``lit/folder_lock.py``), whose create-if-absent and heartbeat are a protocol of their own.

Lightning's default ``TorchCheckpointIO`` writes through an fsspec transaction whose temporary file lives in the
system temp folder: when that is another file system than the checkpoint folder, the commit is a copy, which a kill
can truncate, and it never fsyncs; ``lit/atomic_files.AtomicCheckpointIO`` saves through ``atomic_torch_save``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import uuid
from collections.abc import Callable
from typing import IO, Any, Optional

import torch

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


def _plain_mode(path: str) -> int:
    """The mode a plain ``open(path, "w")`` gives: the replaced file's, else 0o666 less the umask (a temporary file
    is created owner-only)."""
    if os.path.exists(path):
        return os.stat(path).st_mode & 0o7777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path, write: Callable[[IO[bytes]], None], needed: int = 0) -> None:
    """Write ``path`` through ``write(file)`` such that ``path`` is never seen half-written, even after a SIGKILL: a
    hidden temporary file in the same folder, fsynced, renamed over ``path``, the folder fsynced. A failed write is a
    ``CheckpointWriteError`` line (a full disk names the folder and about ``needed`` bytes)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_partials(folder)
    tmp = os.path.join(folder, partial_name())
    try:
        mode = _plain_mode(path)
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as e:
        written = os.path.getsize(tmp) if os.path.isfile(tmp) else 0
        with contextlib.suppress(OSError):
            os.remove(tmp)
        needed = max(needed, os.path.getsize(path) if os.path.isfile(path) else 0)  # the previous one's size
        error = _write_error(e, path, folder, needed, written)
        if error is not None:
            raise error from e
        raise
    fsync_dir(folder)


def atomic_torch_save(obj: Any, path) -> None:
    """``torch.save(obj, path)`` through ``atomic_write``."""
    atomic_write(path, lambda f: torch.save(obj, f), needed=_nbytes(obj))


def atomic_write_text(path, text: str) -> None:
    """``text`` (UTF-8) into ``path`` through ``atomic_write``: all of it or, after a failure, what was there."""
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data), needed=len(data))


def publish_folder(tmp: str, out: str) -> None:
    """Rename the finished folder ``tmp`` (written next to ``out``) to ``out`` and make the rename durable: a reader
    sees no folder or the whole one. Raises ``OSError`` where ``out`` exists and is not empty."""
    tmp, out = os.path.abspath(tmp), os.path.abspath(out)
    for root, _dirs, files in os.walk(tmp):  # every file's data on disk before the name appears
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)
    os.rename(tmp, out)
    fsync_dir(os.path.dirname(out))
