"""SIGTERM to a running ``aah fit``, at a known point: a callback that holds a rank inside an accumulation window until
its signal has arrived (and, on request, holds the stop's checkpoint save until a second one has), and the test side
that waits for those points and sends the signals. No sleeps decide anything: each side waits for the other's file
or signal.

``--trainer.callbacks+=helpers.signals.HoldForSigterm`` (PYTHONPATH holds tests/, as for ``helpers.resume``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import lightning as L

from aah_lightning.lit.last_checkpoint import LastCheckpoint
from aah_lightning.lit.lightning_private import inside_accumulation_window
from helpers.cli import PYTHON, subprocess_env
from helpers.launch import read_outputs, start_ranks

TIMEOUT = 300  # seconds for any one wait; a busy machine is slow to start processes


def _last_checkpoint(trainer) -> LastCheckpoint:
    return next(cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint))


def _signals(trainer) -> int:
    """The stop signals (SIGTERM, SIGINT) this process has received since training started."""
    stop = _last_checkpoint(trainer)
    return stop.sigterms + stop.sigints


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


class HoldForSigterm(L.Callback):
    """On rank ``rank``: after the first micro-batch of optimizer step ``at_step + 1`` (inside its accumulation
    window: the step is not finished) writes ``{folder}/held.json`` with this process's id and waits until the
    process has received SIGTERM or SIGINT. With ``second_at_save``, the checkpoint save that follows the signal
    writes ``{folder}/saving.json`` and waits for a second signal before it goes on."""

    def __init__(self, folder: str, at_step: int, rank: int = 0, second_at_save: bool = False):
        self.folder, self.at_step, self.rank, self.second_at_save = folder, at_step, rank, second_at_save
        self._held = self._saving = False

    def _write(self, name: str, trainer) -> None:
        record = {"pid": os.getpid(), "rank": trainer.global_rank, "step": trainer.global_step}
        with open(os.path.join(self.folder, f".{name}"), "w") as f:
            json.dump(record, f)
        os.replace(os.path.join(self.folder, f".{name}"), os.path.join(self.folder, name))  # seen whole or not at all

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        mine = trainer.global_rank == self.rank and trainer.global_step == self.at_step
        if self._held or not mine or not inside_accumulation_window(trainer):
            return
        self._held = True
        self._write("held.json", trainer)
        _wait(lambda: _signals(trainer) >= 1, f"SIGTERM or SIGINT after step {self.at_step}")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if not self.second_at_save or not self._held or self._saving or trainer.global_rank != self.rank:
            return
        self._saving = True
        self._write("saving.json", trainer)
        _wait(lambda: _signals(trainer) >= 2, "a second signal during the save")


def hold_args(folder, at_step: int, rank: int = 0, second_at_save: bool = False) -> list[str]:
    return [
        "--trainer.callbacks+=helpers.signals.HoldForSigterm",
        f"--trainer.callbacks.folder={folder}",
        f"--trainer.callbacks.at_step={at_step}",
        f"--trainer.callbacks.rank={rank}",
        f"--trainer.callbacks.second_at_save={str(second_at_save).lower()}",
    ]


def run_and_sigterm(
    argv: list[str], folder, second_at_save=False, ranks=1, lightning_launch=False, signum=signal.SIGTERM
) -> tuple[int, str]:
    """Start ``aah ARGV`` (an ``aah fit`` with ``hold_args(folder, ...)``) on ``ranks`` processes (``helpers.launch``;
    ``lightning_launch``: one real ``aah`` process that starts the other ranks itself), send ``signum`` (SIGTERM
    or SIGINT) to the held rank's process once it holds (and a second one once the stop's save holds), wait for every
    process to end.
    Returns (rank 0's exit code, every process's output, rank 0's first)."""
    os.makedirs(folder, exist_ok=True)
    held, saving = os.path.join(folder, "held.json"), os.path.join(folder, "saving.json")
    if lightning_launch:
        outputs = [os.path.join(folder, "output.rank0.txt")]
        with open(outputs[0], "w") as out:
            command = [PYTHON, "-m", "aah_lightning", *argv]
            procs = [subprocess.Popen(command, env=subprocess_env(), cwd=folder, stdout=out, stderr=out)]
    else:
        procs, outputs = start_ranks(argv, ranks, folder, os.path.join(folder, "output"))

    def output() -> str:
        return read_outputs(outputs)

    def reached(path):
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a process ended ({p.returncode}) before {path}:\n{output()[-4000:]}")
        return os.path.exists(path)

    try:
        _wait(lambda: reached(held), "the run to hold")
        with open(held) as f:
            pid = json.load(f)["pid"]
        os.kill(pid, signum)
        if second_at_save:
            _wait(lambda: reached(saving), "the stop's checkpoint save")
            os.kill(pid, signum)
        for p in procs:
            p.wait(timeout=TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return procs[0].returncode, output()


def sigterm_lines(stderr: str, name: str = "SIGTERM") -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"aah: stopped by {name}")]
