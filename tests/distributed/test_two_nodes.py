"""Two nodes on one machine, started the way a cluster starts them: one ``aah fit`` process per node
(``trainer.num_nodes=2``, ``trainer.devices=1``, DDP over gloo on CPU).

By hand: each process with its own working directory and the environment of ``helpers.nodes.node_env``
(MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK, WORLD_SIZE). Lightning takes the processes as created externally
(``LightningEnvironment``), gives node n global rank n, and the two nodes train on disjoint blocks. One node (node 1,
or node 0, the rendezvous store's host) is SIGKILLed after a checkpoint; the other ends by itself with gloo's error;
both started again with ``--ckpt_path last`` resume from the checkpoint's step and finish with the batches, losses
and weights of an uninterrupted two-node run.

Through SLURM: a local cluster of two nodes (``tools/slurm_local.sh start DIR --nodes 2``: two slurmd daemons on
this machine) runs ``configs/cluster/slurm.sbatch`` with one task per node; the job trains like the launch by hand,
node 1's task is SIGKILLed, srun ends the job (FAILED), and the script submitted again resumes and completes with the
same weights. Needs root on Linux, like test_slurm_real.py.

Both nodes share one filesystem here (one machine): the checkpoint folder is the same path for both."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from helpers.cli import REPO
from helpers.distributed import STEPS, check_ranks, cpu_config
from helpers.launch import aah_env, free_port, start_aah
from helpers.nodes import TIMEOUT, node_env
from helpers.resume import assert_same_training, read_run

pytestmark = pytest.mark.heavy

NODES = 2
KILL_AT = 3  # a node is killed inside optimizer step KILL_AT + 1; last.ckpt holds step KILL_AT


def _command(folder, run: str, *extra: str) -> list[str]:
    """A node's ``aah fit`` arguments: the shipped DDP config, on the tiny CPU run of the two-process tests, on two nodes
    of one device each; the Recorder writes to ``{folder}/{run}/rec``, the NodeProbe to ``{folder}/{run}/probe``."""
    return [
        "fit",
        "--config",
        os.path.join(REPO, "configs", "cluster", "ddp.yaml"),
        "--config",
        cpu_config(folder),
        f"--trainer.num_nodes={NODES}",
        "--trainer.devices=1",
        *_callbacks(folder, run),
        *extra,
    ]


def _callbacks(folder, run: str) -> list[str]:
    return [
        "--trainer.callbacks+=helpers.resume.Recorder",
        f"--trainer.callbacks.folder={folder}/{run}/rec",
        "--trainer.callbacks+=helpers.nodes.NodeProbe",
        f"--trainer.callbacks.folder={folder}/{run}/probe",
    ]


def _start(folder, run: str, *extra: str) -> list:
    """Both nodes' processes (``helpers.launch``: forked from a server that imported aah), node n in
    ``{folder}/node{n}`` with its output in ``{folder}/{run}/node{n}.err``."""
    port = free_port()
    argv = _command(folder, run, *extra)
    procs = []
    for node in range(NODES):
        cwd = os.path.join(folder, f"node{node}")
        os.makedirs(cwd, exist_ok=True)
        output = os.path.join(folder, run, f"node{node}.err")
        procs.append(start_aah(argv, node_env(node, port, NODES), cwd, output))
    return procs


def _stderr(folder, run: str) -> str:
    out = []
    for node in range(NODES):
        with open(os.path.join(folder, run, f"node{node}.err"), errors="replace") as f:
            out.append(f"--- node {node}\n" + f.read()[-3000:])
    return "\n".join(out)


def _wait_all(procs) -> list[int]:
    try:
        return [p.wait(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _fit(folder, run: str, *extra: str) -> None:
    os.makedirs(os.path.join(folder, run), exist_ok=True)
    codes = _wait_all(_start(folder, run, *extra))
    assert codes == [0] * NODES, _stderr(folder, run)


def _starts(folder, run: str) -> list[dict]:
    out = []
    for node in range(NODES):
        with open(os.path.join(folder, run, "probe", f"start.node{node}.json")) as f:
            out.append(json.load(f))
    return out


def _weights(folder) -> dict:
    return torch.load(os.path.join(folder, "ckpt", "last.ckpt"), weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted two-node run (environment launch): its folder and each node's records."""
    whole = tmp_path_factory.mktemp("whole")
    _fit(whole, "run")
    for node, start in enumerate(_starts(whole, "run")):
        assert start["environment"] == "LightningEnvironment" and start["creates_processes_externally"], start
        assert (start["node_rank"], start["global_rank"], start["local_rank"]) == (node, node, 0), start
        assert (start["world_size"], start["num_nodes"], start["step"]) == (NODES, NODES, 0), start
        assert start["cwd"] == str(whole / f"node{node}"), start
    runs = [read_run(whole / "run" / "rec", r) for r in range(NODES)]
    check_ranks(runs)  # one window table everywhere; each node trains on its own blocks
    return whole, runs


@pytest.mark.parametrize("victim", [1, 0])  # node 0 also hosts the rendezvous store (MASTER_ADDR:MASTER_PORT)
def test_two_nodes_train_on_their_shares_one_dies_both_resume_exactly(tmp_path, reference, victim):
    whole, reference = reference
    parts, survivor = tmp_path, 1 - victim

    # The same run; the victim's process is SIGKILLed inside step KILL_AT + 1, once last.ckpt holds step KILL_AT.
    os.makedirs(parts / "killed", exist_ok=True)
    hold = [f"--trainer.callbacks.hold_at={KILL_AT}", f"--trainer.callbacks.hold_node={victim}"]
    procs = _start(parts, "killed", *hold)
    try:
        held = parts / "killed" / "probe" / "held.json"
        deadline = time.monotonic() + TIMEOUT
        while not held.exists():
            assert all(p.poll() is None for p in procs), _stderr(parts, "killed")
            assert time.monotonic() < deadline, f"node {victim} never reached step {KILL_AT + 1}"
            time.sleep(0.2)
        assert json.loads(held.read_text())["pid"] == procs[victim].pid  # Lightning started no process of its own
        saved = torch.load(parts / "ckpt" / "last.ckpt", weights_only=True)
        assert saved["global_step"] == KILL_AT
        procs[victim].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        assert procs[victim].wait(timeout=TIMEOUT) == -signal.SIGKILL
        # The survivor is blocked in its next collective with the victim (inside step KILL_AT + 1): gloo reports the
        # closed connection and the process ends with an error by itself, no scheduler needed to end it.
        code = procs[survivor].wait(timeout=TIMEOUT)
        took = time.monotonic() - killed_at
        print(f"node {survivor} ended {took:.1f} s after node {victim}'s kill, exit code {code}", file=sys.stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert code == 1 and "Connection closed by peer" in _stderr(parts, "killed"), _stderr(parts, "killed")
    killed = [read_run(parts / "killed" / "rec", r) for r in range(NODES)]
    for node in range(NODES):
        assert_same_training(reference[node][: 2 * KILL_AT], killed[node][: 2 * KILL_AT])

    # Both nodes again, with --ckpt_path last: from step KILL_AT to the end, as if never interrupted.
    _fit(parts, "resumed", "--ckpt_path=last")
    for node, start in enumerate(_starts(parts, "resumed")):
        assert (start["node_rank"], start["global_rank"], start["step"]) == (node, node, KILL_AT), start
    for node in range(NODES):
        assert_same_training(reference[node][2 * KILL_AT :], read_run(parts / "resumed" / "rec", node))
    expected, got = _weights(whole), _weights(parts)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert torch.load(parts / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == STEPS


# -- the same through SLURM: two slurmd daemons on this machine, one per node ------------------------------------------
SLURM_LOCAL = os.path.join(REPO, "tools", "slurm_local.sh")
SCRIPT = os.path.join(REPO, "configs", "cluster", "slurm.sbatch")


@pytest.fixture
def slurm(tmp_path):
    """A running two-node SLURM cluster (``tools/slurm_local.sh start DIR --nodes 2``); yields the environment its
    commands need and its folder. Stops the daemons by their process ids."""
    if not sys.platform.startswith("linux"):
        pytest.skip("a local SLURM cluster needs Linux")
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root (its daemons and jobs run as root; packages are installed)")
    folder = str(tmp_path / "slurm")
    env = aah_env()  # SLURM and the job's Lightning set ranks and addresses themselves
    env["SLURM_CONF"] = os.path.join(folder, "slurm.conf")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # `aah` of this environment
    pids = []
    try:
        started = subprocess.run(
            [SLURM_LOCAL, "start", folder, "--nodes", str(NODES)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        for name in os.listdir(folder):
            if name.endswith(".pid"):
                with open(os.path.join(folder, name)) as f:
                    pids.append(int(f.read()))
        assert started.returncode == 0, started.stderr
        assert len(pids) == 2 + NODES  # munged, slurmctld, one slurmd per node
        yield env, folder
    finally:
        subprocess.run([SLURM_LOCAL, "stop", folder], timeout=300, check=False)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def _job(env, job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True, check=True)
    return dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)


def _job_ended(env, job_id: str, folder) -> dict:
    deadline = time.monotonic() + TIMEOUT
    while (job := _job(env, job_id))["JobState"] in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
        assert time.monotonic() < deadline, f"job {job_id} never ended\n" + _job_output(folder)
        time.sleep(0.5)
    return job


def _job_output(folder) -> str:
    out = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("slurm-"):
            with open(os.path.join(folder, name), errors="replace") as f:
                out.append(f"--- {name}\n" + f.read()[-3000:])
    return "\n".join(out)


def _sbatch(env, folder, run: str, *extra: str) -> str:
    """configs/cluster/slurm.sbatch on two nodes, one task each, with the tiny CPU run of the environment launch
    (the same training). Every job of the test uses one RUN_DIR: a later job resumes from an earlier one's last.ckpt."""
    with open(cpu_config(folder)) as f:
        cfg = yaml.safe_load(f)
    del cfg["trainer"]["devices"], cfg["checkpoint"]["dirpath"]  # the batch script's: one task per node, RUN_DIR
    with open(os.path.join(folder, "slurm_cpu.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    os.makedirs(os.path.join(folder, run), exist_ok=True)
    job_env = dict(env, STRATEGY="ddp", RUN_DIR=os.path.join(folder, "run"), AAH_CONFIGS=os.path.dirname(SCRIPT))
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--nodes={NODES}",
            "--ntasks-per-node=1",
            "--gpus-per-node=0",
            "--cpus-per-task=1",
            "--oversubscribe",
            f"--output={folder}/slurm-{run}-%j.out",
            SCRIPT,
            "--config",
            os.path.join(folder, "slurm_cpu.yaml"),
            *_callbacks(folder, run),
            *extra,
        ],
        env=job_env,
        cwd=folder,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_slurm_job_on_two_nodes_trains_like_the_environment_launch_and_resumes_after_a_node_dies(
    slurm, tmp_path, reference
):
    env, _ = slurm
    folder = tmp_path / "job"
    os.makedirs(folder)
    whole, reference = reference

    # The job on two nodes; node 1's task is SIGKILLed inside step KILL_AT + 1, once last.ckpt holds step KILL_AT.
    job_id = _sbatch(env, folder, "killed", f"--trainer.callbacks.hold_at={KILL_AT}", "--trainer.callbacks.hold_node=1")
    held = folder / "killed" / "probe" / "held.json"
    deadline = time.monotonic() + TIMEOUT
    while not held.exists():
        assert _job(env, job_id)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), _job_output(folder)
        assert time.monotonic() < deadline, "node 1 never reached step " + str(KILL_AT + 1)
        time.sleep(0.2)
    assert torch.load(folder / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == KILL_AT
    os.kill(json.loads(held.read_text())["pid"], signal.SIGKILL)
    job = _job_ended(env, job_id, folder)
    # srun --kill-on-bad-exit=1 (the batch script's) ends node 0's task too; the job fails (no requeue).
    assert job["JobState"] == "FAILED" and job["ExitCode"] != "0:0", (job, _job_output(folder))
    for node, start in enumerate(_starts(folder, "killed")):
        assert start["environment"] == "SLURMEnvironment", start
        assert start["slurm_node"] == _node_names(env)[node], start  # one task on each of the two nodes
        assert (start["node_rank"], start["global_rank"], start["local_rank"]) == (node, node, 0), start
        assert (start["world_size"], start["num_nodes"], start["step"]) == (NODES, NODES, 0), start
    killed = [read_run(folder / "killed" / "rec", r) for r in range(NODES)]
    for node in range(NODES):  # the same training as the environment launch: same shares, same losses
        assert_same_training(reference[node][: 2 * KILL_AT], killed[node][: 2 * KILL_AT])

    # The job again: the batch script finds last.ckpt and resumes with --ckpt_path last.
    job_id = _sbatch(env, folder, "resumed")
    job = _job_ended(env, job_id, folder)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), _job_output(folder)
    for node, start in enumerate(_starts(folder, "resumed")):
        assert start["slurm_node"] == _node_names(env)[node] and start["step"] == KILL_AT, start
    for node in range(NODES):
        assert_same_training(reference[node][2 * KILL_AT :], read_run(folder / "resumed" / "rec", node))
    expected = _weights(whole)
    got = torch.load(folder / "run" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def _node_names(env) -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()
