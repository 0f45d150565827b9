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
import re
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


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` (dicts, lists, tuples): about what ``torch.save`` writes for it. Of a
    sharded tensor (a DTensor), this process's shard."""
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "to_local", None)
        if callable(local):
            obj = local()
        return obj.untyped_storage().nbytes() if obj.device.type != "meta" else 0
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# torch.save reports a failed write of its archive as a RuntimeError without an errno (torch 2.13: "[enforce fail at
# inline_container.cc:...] . unexpected pos 704 vs 598"; earlier: "PytorchStreamWriter failed writing file ...").
_TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")


_FULL_SLACK = 16 * 2**20


# A writer in Rust (safetensors) reports an I/O error as its text: "... No space left on device (os error 28)".
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_error(
    e: BaseException, path: str, folder: str, needed: int, written: int = 0, what: str = "checkpoint"
) -> Optional[CheckpointWriteError]:
    """``e`` (raised while ``path`` was written) as one line, if it is a failed write; None otherwise. A full disk
    (ENOSPC or a quota, or torch's errno-less write failure with less room left than the rest of the file) names the
    folder, the space the ``what`` needs and what is free."""
    torch_write = isinstance(e, RuntimeError) and any(m in str(e) for m in _TORCH_WRITE_FAILED)
    code = getattr(e, "errno", None)
    if code is None and isinstance(e, Exception) and (found := _OS_ERROR.search(str(e))):
        code = int(found.group(1))
    if not isinstance(e, OSError) and not torch_write and code is None:
        return None
    try:
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
    except (OSError, AttributeError):  # no statvfs (Windows)
        free = None
    # A failed write leaves up to a buffer's worth of room unused: some slack over the rest of the file.
    full = code in (errno.ENOSPC, errno.EDQUOT) or (
        torch_write and free is not None and free < needed - written + _FULL_SLACK
    )
    if full:
        room = f", {_mib(free)} free" if free is not None else ""
        reason = f"no space left in {folder} (the {what} needs about {_mib(needed)}{room})"
        return CheckpointWriteError(
            f"could not write checkpoint {path}: {reason}; the previous checkpoint there (if any) is intact: free "
            f"space there, or set checkpoint.dirpath to a folder with room",
            reason,
        )
    if isinstance(e, OSError):
        reason = e.strerror or e
    elif not torch_write:
        reason = os.strerror(code)
    else:
        reason = str(e).strip().splitlines()[0]
    return CheckpointWriteError(
        f"could not write checkpoint {path}: {reason}; the previous checkpoint there (if any) is intact", str(reason)
    )


def _plain_mode(path: str) -> int:
    """The mode a plain ``open(path, "w")`` gives: the replaced file's, else 0o666 less the umask (a temporary file
    is created owner-only)."""
    if os.path.exists(path):
        return os.stat(path).st_mode & 0o7777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path, write: Callable[[IO[bytes]], None], needed: int = 0, publish: bool = True) -> str:
    """Write ``path`` through ``write(file)`` such that ``path`` is never seen half-written, even after a SIGKILL: a
    hidden temporary file in the same folder, fsynced, renamed over ``path``, the folder fsynced. A failed write is a
    ``CheckpointWriteError`` line (a full disk names the folder and about ``needed`` bytes).

    With ``publish`` False the finished file keeps its hidden temporary name, which is returned: the caller checks it
    and then names it with ``publish_file`` (or drops it with ``discard``), so that a file refused by a check after
    its write never appears under ``path``. Returns the name the file has."""
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
        if publish:
            os.replace(tmp, path)
    except BaseException as e:
        written = os.path.getsize(tmp) if os.path.isfile(tmp) else 0
        with contextlib.suppress(OSError):
            os.remove(tmp)
        needed = max(needed, os.path.getsize(path) if os.path.isfile(path) else 0)  # the previous one's size
        error = write_error(e, path, folder, needed, written)
        if error is not None:
            raise error from e
        raise
    if not publish:
        return tmp
    fsync_dir(folder)
    return path


def publish_file(tmp: str, path) -> None:
    """Give the finished temporary file ``tmp`` (``atomic_write(..., publish=False)``) its name ``path``, durably."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def discard(tmp: str) -> None:
    """Remove a temporary file or folder that will not be published."""
    with contextlib.suppress(OSError):
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp)
        else:
            os.remove(tmp)


def atomic_torch_save(obj: Any, path, publish: bool = True) -> str:
    """``torch.save(obj, path)`` through ``atomic_write``."""
    return atomic_write(path, lambda f: torch.save(obj, f), needed=tensor_bytes(obj), publish=publish)


def atomic_write_text(path, text: str, publish: bool = True) -> str:
    """``text`` (UTF-8) into ``path`` through ``atomic_write``: all of it or, after a failure, what was there."""
    data = text.encode("utf-8")
    return atomic_write(path, lambda f: f.write(data), needed=len(data), publish=publish)


@contextlib.contextmanager
def new_folders(folder):
    """Create ``folder`` and every folder above it that is missing; if the body fails, remove again those of them
    that are still empty, so that a refused or failed write leaves no trace."""
    folder = os.path.abspath(os.fspath(folder))
    missing = []
    while not os.path.isdir(folder) and folder != os.path.dirname(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    for created in reversed(missing):
        os.makedirs(created, exist_ok=True)
    try:
        yield
    except BaseException:
        for created in missing:  # the deepest first
            with contextlib.suppress(OSError):
                os.rmdir(created)
        raise


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
