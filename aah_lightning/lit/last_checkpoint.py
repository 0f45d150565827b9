"""``LastCheckpoint``: the crash-safety checkpoint ``last.ckpt``, and the callback that stops a run on a signal;
``BestCheckpoint``: the best model by validation loss, in the same folder.

It saves ``last.ckpt`` periodically, at the end of training and at the step boundary where a signal stops the run
(``lit/signals.py``); it holds the checkpoint folder's lock for the run (``lit/folder_lock.py``). Its files are
written by the checkpoint plugin (``lit/atomic_files.py``) or, under FSDP2, by the strategy (``lit/fsdp2_saves.py``).
ModelCheckpoint's private save methods go through ``lit/lightning_private.py``.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from datetime import timedelta
from typing import Optional

from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from aah_lightning.checkpoint import LOG_FOLDER_KEY, is_remote
from aah_lightning.errors import FolderTakenOver, require
from aah_lightning.lit.folder_lock import FolderLock, release_folder_locks
from aah_lightning.lit.lightning_private import (
    cluster_environment,
    inside_accumulation_window,
    last_step_saved,
    save_last_checkpoint,
    send_step_metrics,
    should_skip_saving,
)
from aah_lightning.lit.signals import INTERRUPT_EXIT_CODE, SignalStop, requeue_slurm_job


def checkpoints_in(folder: str) -> tuple[str, ...]:
    """The checkpoints in ``folder`` (files, or an FSDP2 run's folders, named ``*.ckpt``), without aah's own hidden
    files (the lock, temporary files, the folders an FSDP2 link names)."""
    if not os.path.isdir(folder):
        return ()
    return tuple(sorted(n for n in os.listdir(folder) if n.endswith(".ckpt") and not n.startswith(".")))


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (the CLI's ``best_checkpoint``: the best model by ``val/loss``), without
    Lightning's warning that its folder "exists and is not empty": in aah it always is, by the lock of the very run
    that starts (``.aah-lock``), and ``LastCheckpoint`` says in its own words when the folder holds checkpoints of
    another run."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)


def _first_process(trainer) -> bool:
    """Whether this is the run's global rank 0, also before the Trainer has set its ranks: processes started by
    torchrun or SLURM know theirs from the environment, those Lightning starts from their node and local rank."""
    environment = cluster_environment(trainer)
    if environment is None:
        return trainer.is_global_zero
    if isinstance(environment, LightningEnvironment):  # its global rank is only set once the Trainer runs
        return environment.node_rank() == 0 and environment.local_rank() == 0
    return environment.global_rank() == 0


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

    _found: tuple[str, ...] = ()  # the checkpoints in the folder before this run wrote any

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            if trainer.is_global_zero and self.dirpath and not is_remote(self.dirpath):
                self._found = checkpoints_in(self.dirpath)
            self.lock_folder(trainer)

    def _warn_about_earlier_checkpoints(self, trainer) -> None:
        # The folder's own files (the lock, temporary files) are aah's and say nothing; checkpoints of an earlier run
        # that this one does not continue are worth a line (Lightning says "exists and is not empty" for both: see
        # BestCheckpoint). By on_train_start the checkpoint this run resumes from is known, under every strategy.
        resumed = trainer.ckpt_path is not None and os.path.dirname(os.path.abspath(trainer.ckpt_path)) == (
            os.path.abspath(self.dirpath or "")
        )
        if self._found and not resumed:
            names = ", ".join(self._found[:3]) + (f" and {len(self._found) - 3} more" if len(self._found) > 3 else "")
            rank_zero_warn(
                f"checkpoint.dirpath={self.dirpath!r} holds checkpoints of an earlier run ({names}) that this run "
                f"does not continue: its own go beside them, and over those of the same name (last.ckpt); to go on "
                f"from them pass --ckpt_path last, else give this run another checkpoint.dirpath"
            )

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.release_folder()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self.release_folder()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Before every save (this one's and the best checkpoint's, whose state is gathered here too): is the folder
        # still this run's? A run stopped past the lock's heartbeat may find another one writing there. Every rank
        # saves, so every rank learns it from rank 0 and all stop before anything is written.
        lost = self._lock.lost() if self._lock is not None else None
        if trainer.strategy.reduce_boolean_decision(lost is not None, all=False):
            self.release_folder()  # stops the heartbeat; the other run's lock file stays
            raise FolderTakenOver(lost or f"checkpoint.dirpath={self.dirpath!r} was taken over by another run")
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
        if finished and not should_skip_saving(self, trainer):
            save_last_checkpoint(self, trainer)
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
        if last_step_saved(self) != trainer.global_step:
            save_last_checkpoint(self, trainer)
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
        self._warn_about_earlier_checkpoints(trainer)
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
        if not should_skip_saving(self, trainer):
            save_last_checkpoint(self, trainer)
