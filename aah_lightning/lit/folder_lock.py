"""One run per checkpoint folder: the lock file ``<folder>/.aah-lock`` and its heartbeat.

``FolderLock`` takes the lock (atomically, refusing in one line when a live run holds it, taking over a stale one with
a warning); ``release_folder_locks`` lets go of every lock this process holds (the CLI, however a command ends).
``LastCheckpoint`` takes its folder's lock for the run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Optional

from lightning.pytorch.utilities import rank_zero_warn

from aah_lightning.atomic import partial_name, pid_alive
from aah_lightning.errors import ConfigError

LOCK_NAME = ".aah-lock"  # hidden, not *.ckpt: no checkpoint search ever sees it


class FolderLock:
    """One run per checkpoint folder: ``<folder>/.aah-lock`` holds the writer's host, PID and start time.

    ``acquire`` creates it atomically (``os.link`` of a complete file: it exists whole or not at all) or refuses, in
    one line naming the run that holds it. A lock is stale - its run was killed - when its host is this one and its
    PID is not running, or when its heartbeat is older than ``STALE_AFTER_S`` (another host: a daemon thread of the
    holder touches the file every ``HEARTBEAT_S``); a stale lock is taken over with a warning. ``held`` says whether
    the file is still this lock, and ``lost`` who holds it otherwise: a run that was stopped (SIGSTOP, a suspended
    job) past the stale limit may have lost it, and ``LastCheckpoint`` checks before every save.
    """

    HEARTBEAT_S = 30.0
    STALE_AFTER_S = 300.0

    def __init__(self, folder: str, setting: str = "checkpoint.dirpath"):
        self.folder, self.setting = os.path.abspath(folder), setting
        self.path = os.path.join(self.folder, LOCK_NAME)
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "id": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _holder(self) -> Optional[dict]:
        """The lock's record and ``age`` (seconds since its last heartbeat); None if there is no lock."""
        try:
            age = time.time() - os.path.getmtime(self.path)
            with open(self.path) as f:
                holder = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # not a record of ours (it is created whole): stale only by its age
            holder = {}
        holder = holder if isinstance(holder, dict) else {}
        return {"host": "?", "pid": "?", "started": 0, "id": None, **holder, "age": age}

    def _create(self, tmp: str) -> bool:
        """Make the lock, atomically; False if there is one already."""
        try:
            os.link(tmp, self.path)  # the complete record appears at once
            return True
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: exclusive creation, then the record
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                json.dump(self.record, f)
            return True

    def _stale(self, holder: dict) -> bool:
        if holder["age"] > self.STALE_AFTER_S:
            return True
        return (
            holder.get("host") == socket.gethostname()
            and isinstance(holder.get("pid"), int)
            and not pid_alive(holder["pid"])
        )

    def acquire(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        tmp = os.path.join(self.folder, partial_name())
        with open(tmp, "w") as f:
            json.dump(self.record, f)
        try:
            for _ in range(3):  # a lock that disappears or turns stale between two looks: look again
                if self._create(tmp):
                    break
                holder = self._holder()
                if holder is None:
                    continue
                if holder.get("id") == self.record["id"]:
                    break
                if not self._stale(holder):
                    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("started", 0)))
                    raise ConfigError(
                        f"{self.setting}={self.folder!r} is in use by another run: PID {holder.get('pid')} on host "
                        f"{holder.get('host')} (started {started}, alive {holder['age']:.0f} s ago); wait for it to "
                        f"end, stop it, or give this run another {self.setting}"
                    )
                # Set the stale lock aside under a name of our own; only one of two runs racing for it succeeds.
                aside = os.path.join(self.folder, partial_name())
                with contextlib.suppress(FileNotFoundError):
                    os.rename(self.path, aside)
                    with contextlib.suppress(OSError):
                        os.remove(aside)
                    rank_zero_warn(
                        f"{self.setting}={self.folder!r}: took over the lock of PID {holder.get('pid')} on host "
                        f"{holder.get('host')}, which is no longer running (no heartbeat for {holder['age']:.0f} s or "
                        f"no such process)"
                    )
            else:
                raise ConfigError(f"{self.setting}={self.folder!r}: could not take its lock {self.path}")
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name="aah-lock-heartbeat", daemon=True)
        self._thread.start()
        _HELD.add(self)
        atexit.register(self.release)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.HEARTBEAT_S):
            if not self.held():  # taken over while this process was stopped: that run's lock is not ours to touch
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def held(self) -> bool:
        holder = self._holder()
        return holder is not None and holder.get("id") == self.record["id"]

    def lost(self) -> Optional[str]:
        """None while this process holds the lock; else one line saying who holds it now (a run that took it over
        while this one was stopped past ``STALE_AFTER_S``, SIGSTOP or a suspended job), for a run that must stop."""
        holder = self._holder()
        if holder is not None and holder.get("id") == self.record["id"]:
            return None
        if holder is None:
            now = "nobody holds it now (its lock file was removed)"
        else:
            started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("started", 0)))
            now = f"PID {holder.get('pid')} on host {holder.get('host')} holds it now (started {started})"
        return (
            f"{self.setting}={self.folder!r} is no longer this run's: {now}; this run was not heard from for over "
            f"{self.STALE_AFTER_S:.0f} s (stopped or suspended?) and its lock was taken over, so it stops here and "
            f"writes nothing more there"
        )

    def release(self) -> None:
        self._stop.set()
        if self.held():
            with contextlib.suppress(OSError):
                os.remove(self.path)
        _HELD.discard(self)
        atexit.unregister(self.release)


_HELD: set[FolderLock] = set()  # the locks this process holds


def release_folder_locks() -> None:
    """Release every checkpoint-folder lock this process holds (the CLI, when a command ends in any way)."""
    for lock in list(_HELD):
        lock.release()
