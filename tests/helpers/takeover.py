"""Another run taking over the checkpoint folder of a run that was stopped past its lock's heartbeat: the
``TakeOver`` callback, given to an ``aah fit`` by class path."""

from __future__ import annotations

import os
import subprocess
import textwrap
import time

import lightning as L

from aah_lightning.lit.folder_lock import LOCK_NAME
from helpers.cli import PYTHON, subprocess_env

HOLDER = textwrap.dedent(
    """
    import sys, time
    from aah_lightning.lit.folder_lock import FolderLock

    FolderLock(sys.argv[1]).acquire()
    print("HELD", flush=True)
    time.sleep(600)
    """
)


class TakeOver(L.Callback):
    """As step ``at_step`` + 1 starts (its predecessor saved): the run's lock heartbeat made an hour old by hand, as
    a run suspended past the stale limit leaves it, then another process takes the folder over and keeps it.
    ``holders``: those processes, for the test to check and end."""

    holders: list[subprocess.Popen] = []

    def __init__(self, at_step: int = 1, folder: str = "."):
        self.at_step, self.folder = at_step, folder

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.at_step or not trainer.is_global_zero:
            return
        lock = os.path.join(trainer.checkpoint_callback.dirpath, LOCK_NAME)
        hour_ago = time.time() - 3600
        os.utime(lock, (hour_ago, hour_ago))
        script = os.path.join(self.folder, "holder.py")
        with open(script, "w") as f:
            f.write(HOLDER)
        proc = subprocess.Popen(
            [PYTHON, script, os.path.dirname(lock)], stdout=subprocess.PIPE, text=True, env=subprocess_env()
        )
        TakeOver.holders.append(proc)
        assert proc.stdout.readline().strip() == "HELD"
