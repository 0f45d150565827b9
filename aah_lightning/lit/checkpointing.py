"""Checkpoint files that survive ``kill -9`` and refuse to load what they should not.

Saving (``AtomicCheckpointIO``, the CLI's default checkpoint plugin): the checkpoint is written to a hidden temporary
file in the destination folder, flushed to disk (fsync), renamed over the destination with ``os.replace`` (atomic
within one file system) and the folder is fsynced so the rename itself is durable. At every moment the destination
holds either the previous complete checkpoint or the new complete one. Lightning's default ``TorchCheckpointIO``
writes through an fsspec transaction whose temporary file lives in the system temp folder: when that is another file
system than the checkpoint folder (local /tmp, shared scratch), the commit is a copy into the destination, which a
kill can truncate; it also never fsyncs. FSDP2's checkpoint folders, which every rank writes outside CheckpointIO,
get the same guarantee from ``AtomicModelParallelStrategy`` (a temporary folder, then an atomic swap of a link).

Stopping on SIGTERM (``LastCheckpoint``): a preemption, ``scontrol requeue``, ``kill`` or torchrun's shutdown sends
SIGTERM. Every rank finishes the optimizer step it is in (the whole accumulation window), the ranks agree at that step
boundary (``reduce_boolean_decision``: one rank's signal is enough), ``last.ckpt`` of that step is written (atomically,
as every checkpoint) and ``SignalStop`` ends the run; the CLI says so in one line and exits with 143. SLURM's requeue
signal (USR1) reaching the tasks does the same, and rank 0 then requeues the job once. SIGINT (Ctrl-C) too, with exit
code 130; a second SIGINT ends the process at once.

Loading: ``AtomicCheckpointIO.load_checkpoint`` goes through ``aah_lightning.checkpoint.load_checkpoint_file``: the file
must be a complete PyTorch archive whose CRC32 checksums match, and it is unpickled with ``weights_only=True`` unless
the user passes ``--weights_only false``. Every failure is a one-line ``ConfigError`` naming the file. The checkpoint's
keys and its reader for everything outside the Trainer (``read_checkpoint``, ``load_model``) live in
``aah_lightning/checkpoint.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from aah_lightning.checkpoint import LOG_FOLDER_KEY, is_remote, load_checkpoint_file
from aah_lightning.errors import CheckpointWriteError, ConfigError, require
from aah_lightning.lit.lightning_private import cluster_environment, inside_accumulation_window, send_step_metrics

# Temporary files are hidden and do not end in .ckpt, so Lightning's "last" search (last*.ckpt) never picks one.
PARTIAL_PREFIX = ".aah-partial-"


def _partial_name() -> str:
    return f"{PARTIAL_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _fsync_dir(folder: str) -> None:
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


def _pid_alive(pid: int) -> bool:
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
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit() or _pid_alive(int(parts[1])):
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
    tmp = os.path.join(folder, _partial_name())
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
    _fsync_dir(folder)


LOCK_NAME = ".aah-lock"  # hidden, not *.ckpt: no checkpoint search ever sees it


class FolderLock:
    """One run per checkpoint folder: ``<folder>/.aah-lock`` holds the writer's host, PID and start time.

    ``acquire`` creates it atomically (``os.link`` of a complete file: it exists whole or not at all) or refuses, in
    one line naming the run that holds it. A lock is stale - its run was killed - when its host is this one and its
    PID is not running, or when its heartbeat is older than ``STALE_AFTER_S`` (another host: a daemon thread of the
    holder touches the file every ``HEARTBEAT_S``); a stale lock is taken over with a warning. ``held`` says whether
    the file is still this lock (a run that was stopped with SIGSTOP past the stale limit may have lost it).
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
            and not _pid_alive(holder["pid"])
        )

    def acquire(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        tmp = os.path.join(self.folder, _partial_name())
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
                aside = os.path.join(self.folder, _partial_name())
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
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def held(self) -> bool:
        holder = self._holder()
        return holder is not None and holder.get("id") == self.record["id"]

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


def _first_process(trainer) -> bool:
    """Whether this is the run's global rank 0, also before the Trainer has set its ranks: processes started by
    torchrun or SLURM know theirs from the environment, those Lightning starts from their node and local rank."""
    environment = cluster_environment(trainer)
    if environment is None:
        return trainer.is_global_zero
    if isinstance(environment, LightningEnvironment):  # its global rank is only set once the Trainer runs
        return environment.node_rank() == 0 and environment.local_rank() == 0
    return environment.global_rank() == 0


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


SIGTERM_EXIT_CODE = 128 + signal.SIGTERM  # 143: what a shell reports for a process ended by SIGTERM
INTERRUPT_EXIT_CODE = 128 + signal.SIGINT  # 130: the same for SIGINT (Ctrl-C)


class SignalStop(SIGTERMException):
    """Training stopped after a signal at the step boundary ``step``; ``path`` is that step's ``last.ckpt``. A
    ``SystemExit`` with code 128 + the signal (SIGTERM: 143; Lightning's own ``SIGTERMException`` carries none, so the
    process would exit 0). ``requeue``: what rank 0 did about SLURM's requeue signal (None for SIGTERM)."""

    def __init__(self, step: int, path: str, signum: int = signal.SIGTERM, requeue: Optional[str] = None):
        super().__init__(128 + signum)
        self.step, self.path, self.signum, self.requeue = step, path, signum, requeue


def slurm_job_id() -> Optional[str]:
    """The id ``scontrol requeue`` takes for this job (``<array job>_<task>`` for an array task), as Lightning forms it."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_slurm_job() -> str:
    """``scontrol requeue`` this job once; what happened, in words. A job that SLURM is already requeueing (the batch
    shell also trapped the signal) answers 'Job is pending execution': still one requeue."""
    job = slurm_job_id()
    if not job:
        return "not requeued: SLURM_JOB_ID is not set"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"not requeued: scontrol requeue {job} failed ({type(e).__name__}: {e})"
    if done.returncode == 0:
        return f"SLURM job {job} requeued: it starts again and resumes from this checkpoint"
    reason = (done.stderr or done.stdout).strip().splitlines()
    return f"scontrol requeue {job} answered: {reason[0] if reason else done.returncode} (no second requeue)"


class LastCheckpoint(ModelCheckpoint):
    """The crash-safety checkpoint: ``last.ckpt`` every ``every_n_train_steps`` steps (or ``train_time_interval``),
    at the end of training, and when the run is stopped by SIGTERM.

    A ``ModelCheckpoint`` that monitors a validation metric defers its step-triggered saves to the next validation
    (Lightning >= 2.5), so its ``last.ckpt`` only moves at validation time. This one monitors nothing, keeps only
    ``last.ckpt`` and also saves the final step, so a finished run's ``last`` is its end state. The best model by
    validation loss is a second, ordinary ``ModelCheckpoint`` (``best_checkpoint`` in the CLI).

    SIGTERM. Lightning's ``_SignalConnector`` only sets ``trainer.received_sigterm``; its loops then raise
    ``SIGTERMException`` after the current micro-batch (mid-accumulation), nothing is saved and the process exits
    with 0. From ``on_train_start`` on (after Lightning has registered its handlers) this callback takes SIGTERM over:
    the handler only counts signals. At every optimizer-step boundary the ranks reduce "any rank was signalled"
    (``strategy.reduce_boolean_decision``; a no-op on one process); when it is true every rank is at the same step
    boundary: ``last.ckpt`` of that step is written (unless it already was) and ``SignalStop`` is raised. A second
    SIGTERM while that happens is counted and changes nothing; Lightning's teardown puts the original handlers back
    afterwards. A signal before ``on_train_start`` (setup, sanity validation) stays Lightning's: no step was trained.

    SIGINT (Ctrl-C) is taken the same way from ``on_train_start`` on (Python would raise ``KeyboardInterrupt``
    anywhere, and Lightning would exit with 1 without saving): the step is finished and saved, exit code 130. A
    second SIGINT ends the process at once (exit code 130, one line), without waiting for the save.

    SLURM's requeue signal (USR1) reaching the tasks (``--signal=USR1@300`` without ``B:``, ``scancel --signal=USR1``
    without ``--batch``): under a ``SLURMEnvironment`` whose Lightning auto-requeue is off (the CLI's), it is taken the
    same way, and after the save rank 0 requeues the job once (``scontrol requeue``), unless some rank also got SIGTERM
    (SLURM is ending the job already: a requeue, preemption or cancel is under way). Exit code 138 (128 + USR1).

    Args:
        dirpath: the checkpoint folder (``--ckpt_path last`` looks here).
        every_n_train_steps: save every this many optimizer steps.
        train_time_interval: save at this wall-time interval instead (e.g. ``"00:30:00"``); overrides the steps.
        verbose: log each save.
    """

    def __init__(
        self,
        dirpath: Optional[str] = None,
        every_n_train_steps: Optional[int] = 100,
        train_time_interval: Optional[timedelta] = None,
        verbose: bool = False,
    ):
        # Lightning takes 0 as "never" (and a fit whose periodic checkpoints silently stopped loses work) and refuses
        # a negative number with a traceback.
        require(
            every_n_train_steps is None or (isinstance(every_n_train_steps, int) and every_n_train_steps > 0),
            "checkpoint.every_n_train_steps",
            every_n_train_steps,
            "a positive number of optimizer steps (or null: at the end of each epoch and when stopped by a signal; "
            "or set checkpoint.train_time_interval)",
        )
        if train_time_interval is not None:  # ModelCheckpoint takes one trigger only
            every_n_train_steps = None
        super().__init__(
            dirpath=dirpath,
            save_last=True,
            save_top_k=0,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            verbose=verbose,
            # Always last.ckpt, never a last-vN.ckpt beside a stale last.ckpt (a resume with another interval, from a
            # copied folder): one file per folder, and --ckpt_path last takes it by step, not by date.
            enable_version_counter=False,
        )

    # -- one run per folder ---------------------------------------------------------------------------------------
    _lock: Optional[FolderLock] = None

    def lock_folder(self, trainer, create: bool = True) -> None:
        """Take the checkpoint folder's ``FolderLock`` for this run (the first process only; once): a second run on
        the folder is refused in one line. The CLI calls this before anything is loaded, with ``create=False`` (a
        folder that does not exist yet is locked by ``setup``, which creates it, after the data is loaded)."""
        if self._lock is not None or not self.dirpath or is_remote(self.dirpath) or not _first_process(trainer):
            return
        if not create and not os.path.isdir(self.dirpath):
            return
        lock = FolderLock(os.fspath(self.dirpath))
        lock.acquire()
        self._lock = lock

    def release_folder(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self.lock_folder(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.release_folder()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self.release_folder()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Where this run logs, so that a resume continues the same log folder (cli.AAHCLI._continue_log_folder).
        logger = trainer.logger
        if logger is not None and len(trainer.loggers) == 1:
            checkpoint[LOG_FOLDER_KEY] = {"save_dir": logger.save_dir, "name": logger.name, "version": logger.version}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # The final step is saved here, like every other step, not only in on_train_end: Lightning restores a
        # checkpoint written after the loop finished as one step and one epoch further on, so a run extended from it
        # (a larger max_steps) would log every point one step late.
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finished = 0 < trainer.max_steps <= trainer.global_step
        if finished and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        if inside_accumulation_window(trainer):  # inside an accumulation window: the step is not finished
            return
        # Every rank is at the same step boundary here: one collective decides for all of them (and, only when they
        # stop, two more say which signal).
        strategy = trainer.strategy
        signalled = self._sigterms + self._sigints + self._requeues > 0
        if not strategy.reduce_boolean_decision(signalled, all=False) or finished:
            return
        terminated = strategy.reduce_boolean_decision(self._sigterms > 0, all=False)
        interrupted = strategy.reduce_boolean_decision(self._sigints > 0, all=False) and not terminated
        requeue = strategy.reduce_boolean_decision(self._requeues > 0, all=False) and not (terminated or interrupted)
        if self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        # Lightning sends a step's metrics to the loggers after this hook, which the stop below skips: send them now,
        # as it would (same step, same log_every_n_steps), so that the curves have no hole at the stop step.
        send_step_metrics(trainer)
        if not requeue:
            signum = signal.SIGINT if interrupted else signal.SIGTERM
            raise SignalStop(trainer.global_step, self.last_model_path, signum)
        done = requeue_slurm_job() if trainer.is_global_zero else None
        raise SignalStop(trainer.global_step, self.last_model_path, self._requeue_signal, done)

    # -- signals -------------------------------------------------------------------------------------------------------
    _sigterms = _sigints = _requeues = 0
    _requeue_signal = signal.SIGUSR1

    @property
    def sigterms(self) -> int:
        """How many times this process has received SIGTERM since training started (from the first on, the run stops
        at the next step boundary)."""
        return self._sigterms

    @property
    def sigints(self) -> int:
        """How many times this process has received SIGINT (Ctrl-C) since training started: the first stops the run
        as SIGTERM does (exit code 130), a second ends the process at once."""
        return self._sigints

    @property
    def requeue_signals(self) -> int:
        """How many times this process has received SLURM's requeue signal (USR1) since training started."""
        return self._requeues

    def on_train_start(self, trainer, pl_module) -> None:
        self._sigterms = self._sigints = self._requeues = 0
        if threading.current_thread() is not threading.main_thread():  # signal handlers can only be set there
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigint)  # instead of Python's KeyboardInterrupt: nothing would be saved
        # As Lightning's _SignalConnector finds it (a single-device run under srun has a cluster environment too).
        environment = cluster_environment(trainer)
        if isinstance(environment, SLURMEnvironment) and not environment.auto_requeue:
            self._requeue_signal = environment.requeue_signal or signal.SIGUSR1
            signal.signal(self._requeue_signal, self._on_requeue_signal)

    # Nothing else in the handlers: no collective, no I/O. The step boundary acts on them.
    def _on_sigterm(self, signum, frame) -> None:
        self._sigterms += 1

    def _on_sigint(self, signum, frame) -> None:
        self._sigints += 1
        if self._sigints == 1:
            return
        # A second Ctrl-C: the user wants the process gone, not the save. Every checkpoint on disk is whole (atomic
        # writes); a temporary file this leaves is removed by the next save.
        if rank_zero_only.rank == 0:
            os.write(
                2,
                f"aah: stopped at once by a second SIGINT: this step is not saved; {self.dirpath} holds the last "
                f"complete checkpoint\n".encode(),
            )
        release_folder_locks()
        os._exit(INTERRUPT_EXIT_CODE)

    def _on_requeue_signal(self, signum, frame) -> None:
        self._requeues += 1

    def on_train_end(self, trainer, pl_module) -> None:
        # Runs that end other than at max_steps (max_epochs, a stop request): their end state resumes exactly.
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def swap_in(tmp: str, final: str) -> None:
    """Make ``final`` the complete checkpoint ``tmp`` (a file or a folder) in one atomic step.

    A file is renamed over ``final``. A folder cannot be renamed over another, so it is kept under a hidden name and
    ``final`` becomes a symbolic link to it, swapped with ``os.replace``; the folder it pointed at before, and any
    left by a writer killed between the swap and the clean-up, are removed afterwards."""
    parent, name = os.path.dirname(os.path.abspath(final)), os.path.basename(final)
    if os.path.isdir(final) and not os.path.islink(final):  # a folder an earlier version saved in place
        os.rename(final, os.path.join(parent, f".{name}.{uuid.uuid4().hex[:8]}"))
    if os.path.isdir(tmp):
        kept = f".{name}.{uuid.uuid4().hex[:8]}"
        os.rename(tmp, os.path.join(parent, kept))
        link = os.path.join(parent, _partial_name())
        os.symlink(kept, link)
        os.replace(link, final)
    else:
        os.replace(tmp, final)
    _fsync_dir(parent)
    current = os.path.basename(os.path.realpath(final))
    for other in os.listdir(parent):  # earlier folders of this checkpoint name, now unreferenced
        if other.startswith(f".{name}.") and other != current:
            shutil.rmtree(os.path.join(parent, other), ignore_errors=True)


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2) whose checkpoints are swapped in whole, as single files are.

    With ``save_distributed_checkpoint`` (the default) a checkpoint is a folder - one shard file per rank, the
    ``.metadata`` of torch.distributed.checkpoint and Lightning's ``meta.pt`` - that every rank writes directly, not
    through a CheckpointIO plugin, so a kill during a save would leave a half-written ``last.ckpt/``. Here every rank
    writes into a hidden temporary folder next to the destination; once all have finished, rank 0 swaps it in
    (``swap_in``): the destination always names a complete checkpoint. Same arguments as ModelParallelStrategy.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if is_remote(filepath):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        final = os.path.abspath(self.broadcast(os.fspath(filepath)))
        if self.is_global_zero:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            remove_stale_partials(os.path.dirname(final))
        tmp = os.path.join(os.path.dirname(final), self.broadcast(_partial_name()))  # rank 0's name, on every rank
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("aah_checkpoint_written")
        if self.is_global_zero:
            swap_in(tmp, final)
        self.barrier("aah_checkpoint_swapped")

    def remove_checkpoint(self, filepath) -> None:
        path = os.fspath(filepath)
        if self.is_global_zero and os.path.islink(path):  # a swapped-in folder: the link and what it names
            target = os.path.realpath(path)
            os.remove(path)
            shutil.rmtree(target, ignore_errors=True)
            return
        super().remove_checkpoint(filepath)
