"""How a run stopped by a signal ends, and SLURM's requeue.

A preemption, ``scontrol requeue``, ``kill`` or torchrun's shutdown sends SIGTERM; Ctrl-C sends SIGINT; SLURM's
requeue signal (USR1) may reach the tasks. ``LastCheckpoint`` counts them and stops the run at the next optimizer-step
boundary, after saving that step, by raising ``SignalStop``: the process exits with 128 + the signal
(``SIGTERM_EXIT_CODE``, ``INTERRUPT_EXIT_CODE``). After SLURM's requeue signal rank 0 requeues the job once
(``requeue_slurm_job``).
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Optional

from lightning.pytorch.utilities.exceptions import SIGTERMException

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
