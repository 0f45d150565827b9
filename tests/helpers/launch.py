"""``aah`` processes for the tests, forked from a server that imported aah once (multiprocessing's forkserver).

Starting Python, torch and Lightning costs about 8 s of CPU per process on a 2-core CI machine: most of what a tiny
run costs, and a test of resuming on two processes starts up to ten of them. ``start_aah`` forks a new process from
a server that has imported ``aah_lightning.cli`` (one server per test worker, started on first use; each process is
a fresh fork of that clean state, nothing carries over from one to the next) and runs ``aah ARGS`` in it
(``aah_lightning.cli.main``, what the console script runs) with its own environment, working directory and output
file. It is an ``aah`` process in all but the import; the object it returns answers like ``subprocess.Popen``.

Several processes of one run are started the way torchrun or a cluster starts ranks (``rank_env``: ``LOCAL_RANK``,
``NODE_RANK``, ``MASTER_ADDR``...), so Lightning starts none itself (``LightningEnvironment``). What only real
processes show keeps them: Lightning's own launcher (``aah fit`` starting its ranks: the DDP reference run and the
DDP SIGTERM test), the SLURM jobs, and tests of what a fresh interpreter imports.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys

from helpers.cli import REPO

_CONTEXT = multiprocessing.get_context("forkserver")
# Imported once in the server: the CLI (with torch and Lightning) and the test callbacks runs name by class path.
_CONTEXT.set_forkserver_preload(
    ["aah_lightning.cli", "helpers.launch", "helpers.nodes", "helpers.resume", "helpers.signals"]
)

# Variables of a launcher or cluster that would make Lightning pick another environment (SLURM, torchelastic, LSF,
# MPI) or that an enclosing job may have left; rank_env sets its own.
_FOREIGN = ("SLURM_", "TORCHELASTIC_", "LSB_", "JSM_", "OMPI_", "PMI_", "PMIX_")
_RANKS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE")


def aah_env() -> dict:
    """The environment of an ``aah`` process: this one's, with the repository and tests/ on PYTHONPATH (callbacks given
    by class path, ``helpers.resume.Recorder``) and without any launcher's or cluster's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN) and k not in _RANKS}
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")])
    return env


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, nodes: int = 1) -> dict:
    """The environment a launcher gives process ``rank`` of ``world`` (``nodes`` nodes of ``world // nodes``
    processes): ``LOCAL_RANK`` tells Lightning that the processes are created externally; ``NODE_RANK`` and the
    trainer's ``num_nodes`` x ``devices`` give it its global rank; the process group meets at ``MASTER_ADDR``:``port``."""
    per_node = world // nodes
    env = aah_env()
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NODE_RANK=str(rank // per_node),
        LOCAL_RANK=str(rank % per_node),
        RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    return env


def _run(argv: list[str], env: dict, cwd: str, output: str) -> None:
    """In the forked process: become ``aah ARGV`` started with ``env`` in ``cwd``, stdout and stderr to ``output``."""
    os.environ.clear()
    os.environ.update(env)
    for path in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if path and path not in sys.path:
            sys.path.insert(0, path)
    os.chdir(cwd)
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a new interpreter (the server ignores it)
    # Lightning reads the process's rank from the environment when it is imported; the server imported it without one.
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from aah_lightning.lit.lightning_private import rank_from_environment

    rank_zero_only.rank = rank_from_environment() or 0
    sys.argv = ["aah", *argv]
    from aah_lightning.cli import main

    main(argv)


class AahProcess:
    """A started ``aah`` process, answering like ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``send_signal``,
    ``kill``, ``returncode`` (negative: ended by that signal)."""

    def __init__(self, argv: list[str], env: dict, cwd, output):
        self.args = ["aah", *argv]
        open(output, "w").close()  # a new file, as Popen's stdout=open(output, "w")
        self._process = _CONTEXT.Process(target=_run, args=(list(argv), dict(env), str(cwd), str(output)))
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_aah(argv: list[str], env: dict, cwd, output) -> AahProcess:
    """``aah ARGV`` in a new process (``argv`` without the program: ``["fit", "--config", ...]``)."""
    return AahProcess(argv, env, cwd, output)


def start_ranks(argv: list[str], world: int, cwd, output_prefix) -> tuple[list[AahProcess], list[str]]:
    """``aah ARGV`` on ``world`` processes of one node, started as a launcher starts them (one process: a plain
    ``aah``). Returns the processes and their output files (``{output_prefix}.rank{r}.txt``), rank 0's first."""
    outputs = [f"{output_prefix}.rank{r}.txt" for r in range(world)]
    port = free_port()
    envs = [aah_env()] if world == 1 else [rank_env(r, world, port) for r in range(world)]
    return [start_aah(argv, env, cwd, out) for env, out in zip(envs, outputs)], outputs


def read_outputs(paths: list[str]) -> str:
    """The output files joined, in order."""
    text = []
    for path in paths:
        with open(path, errors="replace") as f:
            text.append(f.read())
    return "".join(text)


def run_ranks(argv: list[str], world: int, cwd, output_prefix, timeout: float, grace: float = 60.0):
    """``start_ranks``, then wait for every process. Returns ``(exit codes, output of every rank)``, rank 0's output
    first. A rank still running ``grace`` seconds after rank 0 ended (waiting for a collective that will never come)
    is killed, as Lightning's own launcher would."""
    procs, outputs = start_ranks(argv, world, cwd, output_prefix)
    try:
        procs[0].wait(timeout)
        for p in procs[1:]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(grace)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], read_outputs(outputs)
