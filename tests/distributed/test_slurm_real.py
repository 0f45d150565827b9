"""The SLURM batch script on a real one-node SLURM cluster (munged, slurmctld and slurmd from Debian's packages, started
by ``tools/slurm_local.sh`` in a temporary folder): two ranks train under ``SLURMEnvironment``, a preemption
(``scontrol requeue``) and the time-limit signal (``scancel --signal=USR1 --batch``) each requeue the job exactly once,
SLURM's SIGTERM makes the tasks finish the step they are in and write its ``last.ckpt``, every restart resumes from
that step, and the job ends COMPLETED with the weights of a job that was never interrupted, under DDP and FSDP2.

Runs as root on Linux (the daemons and the jobs run as root). Installs the packages with apt-get when they are
missing; where that is impossible the test fails rather than skipping."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import yaml

from helpers.cli import REPO, subprocess_env
from helpers.slurm import TIMEOUT

pytestmark = pytest.mark.heavy

SCRIPT = os.path.join(REPO, "configs", "cluster", "slurm.sbatch")
SLURM_LOCAL = os.path.join(REPO, "tools", "slurm_local.sh")
STEPS = 6
PREEMPT_AT, TIME_LIMIT_AT = 2, 4  # the first run is preempted inside step 3, the second signalled inside step 5


# -- the cluster ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm():
    """A running one-node cluster; yields the environment its commands need. Stops the daemons by their process ids
    and deletes every file it made."""
    if not sys.platform.startswith("linux"):
        pytest.skip("a local SLURM cluster needs Linux")
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root (its daemons and jobs run as root; packages are installed)")
    folder = tempfile.mkdtemp(prefix="aah-slurm-")
    # Nothing of an enclosing job or process group: SLURM and the job's Lightning set these themselves.
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("SLURM_") and not k.startswith("MASTER_")}
    env["SLURM_CONF"] = os.path.join(folder, "slurm.conf")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # `aah` of this environment
    pids = []
    try:
        started = subprocess.run(
            [SLURM_LOCAL, "start", folder], capture_output=True, text=True, timeout=600, check=False
        )
        for path in glob.glob(os.path.join(folder, "*.pid")):
            with open(path) as f:
                pids.append(int(f.read()))
        assert started.returncode == 0, started.stderr + _logs(folder)
        yield env, folder
    finally:
        subprocess.run([SLURM_LOCAL, "stop", folder], timeout=300, check=False)
        for pid in pids:
            assert not _alive(pid), f"daemon {pid} still running"
        shutil.rmtree(folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _logs(folder) -> str:
    """For a failure message: the end of the job's output (``folder``: a job's folder) and of the daemons' logs."""
    paths = glob.glob(os.path.join(folder, "*.out"))
    for base in (folder, os.path.dirname(folder)):
        paths += glob.glob(os.path.join(base, "log", "*.log"))
    out = []
    for path in paths:
        with open(path, errors="replace") as f:
            out.append(f"\n--- {path}\n" + "".join(f.readlines()[-40:]))
    return "".join(out)


def _job(env, job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True, check=True)
    return dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)


STARTED = time.monotonic()


def _wait(condition, what: str, folder) -> None:
    print(f"{time.monotonic() - STARTED:6.1f} s: waiting for {what}", file=sys.stderr)  # shown if the test fails
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + _logs(folder))
        time.sleep(0.5)


# -- the job ----------------------------------------------------------------------------------------------------------
def _cpu_config(folder) -> str:
    """On top of the shipped cluster configs: a tiny model on the synthetic task, on CPU. Devices, nodes and folders
    come from the batch script."""
    cfg = {
        "trainer": {
            "accelerator": "cpu",
            "precision": "32-true",
            "max_steps": STEPS,
            "accumulate_grad_batches": 2,
            "val_check_interval": 4,
            "limit_val_batches": 1,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        },
        "checkpoint": {"every_n_train_steps": 1},
        "model": {
            "gpt": {
                "n_layer": 2,
                "n_head": 4,
                "n_embd": 32,
                "backend": "auto",
                "compile_blocks": False,
                "activation_checkpointing": False,
            },
            "aah": {"policy": "random", "candidates": [8, 16, 32], "random": {"redraw_interval": 2}},
        },
        "data": {"source": "synthetic", "seq_len": 32, "batch_size": 4, "synthetic": {"documents": 64}},
    }
    path = os.path.join(folder, "cpu.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _submit(slurm, name: str, strategy: str, hold_at: list[int]) -> tuple[str, str]:
    env, root = slurm
    folder = os.path.join(root, name)
    os.makedirs(folder)
    env = dict(
        env,
        STRATEGY=strategy,
        RUN_DIR=os.path.join(folder, "run"),
        AAH_CONFIGS=os.path.join(REPO, "configs", "cluster"),
    )
    probe = [
        "--trainer.callbacks+=helpers.slurm.SlurmProbe",
        f"--trainer.callbacks.folder={folder}",
        f"--trainer.callbacks.hold_at={hold_at}",
    ]
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--ntasks-per-node=2",
            "--gpus-per-node=0",
            "--cpus-per-task=1",
            "--oversubscribe",  # the test's jobs share the node's CPUs: they run side by side
            f"--job-name={name}",
            f"--output={folder}/slurm-%j.out",
            SCRIPT,
            "--config",
            _cpu_config(folder),
            *probe,
        ],
        env=env,
        cwd=folder,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip(), folder


def _held(folder, restart: int) -> bool:
    return all(os.path.exists(os.path.join(folder, f"held.{restart}.rank{r}.json")) for r in (0, 1))


def _starts(folder, restart: int) -> list[dict]:
    out = []
    for rank in (0, 1):
        with open(os.path.join(folder, f"start.{restart}.rank{rank}.json")) as f:
            out.append(json.load(f))
    return out


def _weights(folder) -> dict:
    """The model's state dict in ``last.ckpt``: a file (DDP) or a distributed checkpoint folder (FSDP2)."""
    last = os.path.join(folder, "run", "checkpoints", "last.ckpt")
    if os.path.isdir(last):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(last, os.path.join(folder, "whole.pt"))
        last = os.path.join(folder, "whole.pt")
    return torch.load(last, weights_only=True)["state_dict"]


def _finished(env, job_id: str, folder) -> dict:
    _wait(
        lambda: _job(env, job_id)["JobState"] not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"),
        f"job {job_id} to end",
        folder,
    )
    return _job(env, job_id)


class _Signals(threading.Thread):
    """Preempts a job at its first hold point and sends it the time-limit signal at its second, as it reaches them."""

    def __init__(self, env, job_id: str, run: str):
        super().__init__(daemon=True)
        self.env, self.job_id, self.run_dir, self.error = env, job_id, run, None

    def run(self):
        try:
            run = self.run_dir
            # Preemption: SLURM ends the job and puts it back in the queue.
            _wait(lambda: _held(run, 0), "the first run to reach its hold point", run)
            subprocess.run(["scontrol", "requeue", self.job_id], env=self.env, check=True)
            # The time-limit warning (--signal=B:USR1@300 sends the same signal to the batch shell only).
            _wait(lambda: _held(run, 1), "the requeued run to reach its hold point", run)
            subprocess.run(["scancel", "--signal=USR1", "--batch", self.job_id], env=self.env, check=True)
        except BaseException as err:  # raised in the test, by sent()
            self.error = err

    def sent(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


class _Usr1(threading.Thread):
    """Sends USR1 to a job's training tasks (``scancel --signal=USR1``: what ``--signal=USR1@300`` without ``B:`` does
    before the time limit) or, with ``full``, to the batch shell and the tasks alike, at its first hold point."""

    def __init__(self, env, job_id: str, run: str, full: bool):
        super().__init__(daemon=True)
        self.env, self.job_id, self.run_dir, self.full, self.error = env, job_id, run, full, None

    def run(self):
        try:
            _wait(lambda: _held(self.run_dir, 0), "the first run to reach its hold point", self.run_dir)
            full = ["--full"] if self.full else []
            subprocess.run(["scancel", "--signal=USR1", *full, self.job_id], env=self.env, check=True)
        except BaseException as err:
            self.error = err

    sent = _Signals.sent


STRATEGIES = ["ddp", "fsdp2"]
USR1_TARGETS = ["tasks", "full"]


@pytest.fixture(scope="module")
def jobs(slurm):
    """Both strategies' jobs, submitted at once so that they run side by side: per strategy the reference (the same
    job, never interrupted) and the job that is preempted and then time-limited, with the thread that signals it."""
    submitted = {}
    for strategy in STRATEGIES:
        ref = _submit(slurm, f"{strategy}-whole", strategy, hold_at=[])
        job = _submit(slurm, f"{strategy}-requeued", strategy, hold_at=[PREEMPT_AT, TIME_LIMIT_AT])
        signals = _Signals(slurm[0], *job)
        signals.start()
        submitted[strategy] = (ref, job, signals)
    for target in USR1_TARGETS:  # DDP only: the signal path is the same under FSDP2
        job = _submit(slurm, f"usr1-{target}", "ddp", hold_at=[PREEMPT_AT])
        signals = _Usr1(slurm[0], *job, full=target == "full")
        signals.start()
        submitted[f"usr1-{target}"] = (job, signals)
    return submitted


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_preempted_and_time_limited_jobs_requeue_and_resume_exactly(slurm, jobs, strategy):
    env = slurm[0]
    (ref_id, ref), (job_id, run), signals = jobs[strategy]

    job = _finished(env, ref_id, ref)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0"), _logs(ref)

    signals.sent()  # a preemption, then the time-limit warning, each at its hold point
    job = _finished(env, job_id, run)
    with open(os.path.join(run, f"slurm-{job_id}.out"), errors="replace") as f:
        output = f.read()  # all three runs: --open-mode=append
    # One requeue per signal (the USR1 one by the batch script), then one run to the end.
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "2"), _logs(run)
    assert output.count("aah: time limit near, requeueing job") == 1, output[-3000:]
    # Each requeue's SIGTERM: the held step was finished and saved, rank 0 said so once.
    stops = [line for line in output.splitlines() if line.startswith("aah: stopped by SIGTERM")]
    assert [line.split(":")[1] for line in stops] == [
        f" stopped by SIGTERM after step {PREEMPT_AT + 1}",
        f" stopped by SIGTERM after step {TIME_LIMIT_AT + 1}",
    ], output[-3000:]
    for restart, resumed_from in ((0, 0), (1, PREEMPT_AT + 1), (2, TIME_LIMIT_AT + 1)):
        for rank, start in enumerate(_starts(run, restart)):
            assert start["environment"] == "SLURMEnvironment" and start["world_size"] == 2, start
            assert start["procid"] == rank  # SLURM's task ids are Lightning's ranks
            assert start["auto_requeue"] is False  # the batch script requeues, not Lightning
            assert start["step"] == resumed_from  # from the last.ckpt written on SIGTERM: nothing was lost

    expected, got = _weights(ref), _weights(run)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


@pytest.mark.parametrize("target", USR1_TARGETS)
def test_usr1_to_the_training_tasks_requeues_once_and_resumes_exactly(slurm, jobs, target):
    # The batch script traps USR1 (--signal=B:USR1@300). A site that sends it to the tasks instead, or to every
    # process of the job, still gets one requeue and a resume from the step the signal interrupted.
    env = slurm[0]
    (job_id, run), signals = jobs[f"usr1-{target}"]
    signals.sent()
    job = _finished(env, job_id, run)
    with open(os.path.join(run, f"slurm-{job_id}.out"), errors="replace") as f:
        output = f.read()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), _logs(run)
    shell_requeued = output.count("aah: time limit near, requeueing job")
    stops = [line for line in output.splitlines() if line.startswith("aah: stopped by ")]
    assert len(stops) == 1, output[-3000:]
    if target == "tasks":  # the batch shell never saw the signal: rank 0 requeued the job after the save
        assert shell_requeued == 0, output[-3000:]
        assert stops[0].startswith(f"aah: stopped by SIGUSR1 (SLURM's requeue signal) after step {PREEMPT_AT + 1}: ")
        # slurmstepd's own "CANCELLED ... DUE TO JOB REQUEUE" may follow on the same line (one output file, no newline
        # between two writers), so the line holds the message rather than ends with it.
        assert f"SLURM job {job_id} requeued: it starts again and resumes from this checkpoint" in stops[0], stops
    else:  # the batch shell requeued at once; the tasks' SIGTERM (or their own requeue's refusal) made no second one
        assert shell_requeued == 1, output[-3000:]
        assert f"after step {PREEMPT_AT + 1}: " in stops[0], stops
    for restart, resumed_from in ((0, 0), (1, PREEMPT_AT + 1)):
        for start in _starts(run, restart):
            assert start["step"] == resumed_from and start["auto_requeue"] is False, start

    ref = jobs["ddp"][0][1]
    _finished(env, jobs["ddp"][0][0], ref)
    expected, got = _weights(ref), _weights(run)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
