"""A callback that prints how long after its process started the first training batch began (Linux), for the
start-up measurements in docs/data.md:

    PYTHONPATH=tools aah fit --config configs/quickstart.yaml --trainer.callbacks+=first_step.FirstStepTime ...
"""

from __future__ import annotations

import os
import sys
import time

import lightning as L


def process_age() -> float:
    """Seconds since this process started."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class FirstStepTime(L.Callback):
    def __init__(self):
        self.done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.done and trainer.is_global_zero:
            self.done = True
            print(
                f"first_step: the first training batch began {process_age():.1f} s after the process started "
                f"({time.strftime('%H:%M:%S')})",
                file=sys.stderr,
            )
