"""Two nodes on one machine, started the way a cluster without SLURM starts them: one ``aah fit`` process per node
(``trainer.num_nodes=2``, ``trainer.devices=1``, gloo on CPU), each with its own working directory and the
environment of ``helpers.nodes.node_env`` (MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK, WORLD_SIZE). Lightning
takes the processes as created externally, gives node n global rank n, and the two nodes train on disjoint blocks.
One node is SIGKILLed after a checkpoint; the other ends by itself with an error; both started again with
``--ckpt_path last`` resume from the checkpoint's step and finish with the losses and weights of an uninterrupted
two-node run. Both nodes share one filesystem here (one machine): the checkpoint folder is the same path for both."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from helpers.cli import PYTHON, REPO
from helpers.distributed import STEPS, check_ranks, cpu_config
from helpers.nodes import TIMEOUT, node_env
from helpers.resume import assert_same_training, read_run

pytestmark = pytest.mark.heavy

NODES = 2
KILL_AT = 3  # node 1 is killed inside optimizer step KILL_AT + 1; last.ckpt holds step KILL_AT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(folder, run: str, *extra: str) -> list[str]:
    """A node's ``aah fit``: the shipped DDP config, on the tiny CPU run of the two-process tests, on two nodes of one
    device each; the Recorder writes to ``{folder}/{run}/rec``, the NodeProbe to ``{folder}/{run}/probe``."""
    return [
        PYTHON,
        "-m",
        "aah_lightning",
        "fit",
        "--config",
        os.path.join(REPO, "configs", "cluster", "ddp.yaml"),
        "--config",
        cpu_config(folder),
        f"--trainer.num_nodes={NODES}",
        "--trainer.devices=1",
        "--trainer.callbacks+=helpers.resume.Recorder",
        f"--trainer.callbacks.folder={folder}/{run}/rec",
        "--trainer.callbacks+=helpers.nodes.NodeProbe",
        f"--trainer.callbacks.folder={folder}/{run}/probe",
        *extra,
    ]


def _start(folder, run: str, *extra: str) -> list[subprocess.Popen]:
    """Both nodes' processes, node n in ``{folder}/node{n}`` with its stderr in ``{folder}/{run}/node{n}.err``."""
    port = _free_port()
    command = _command(folder, run, *extra)
    procs = []
    for node in range(NODES):
        cwd = os.path.join(folder, f"node{node}")
        os.makedirs(cwd, exist_ok=True)
        with open(os.path.join(folder, run, f"node{node}.err"), "w") as err:
            procs.append(subprocess.Popen(command, env=node_env(node, port, NODES), cwd=cwd, stdout=err, stderr=err))
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


def test_two_nodes_train_on_their_shares_one_dies_both_resume_exactly(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"

    # An uninterrupted two-node run: the reference.
    _fit(whole, "run")
    for node, start in enumerate(_starts(whole, "run")):
        assert start["environment"] == "LightningEnvironment" and start["creates_processes_externally"], start
        assert (start["node_rank"], start["global_rank"], start["local_rank"]) == (node, node, 0), start
        assert (start["world_size"], start["num_nodes"], start["step"]) == (NODES, NODES, 0), start
        assert start["cwd"] == str(whole / f"node{node}"), start
    reference = [read_run(whole / "run" / "rec", r) for r in range(NODES)]
    check_ranks(reference)  # one window table everywhere; each node trains on its own blocks

    # The same run; node 1's process is SIGKILLed inside step KILL_AT + 1, once last.ckpt holds step KILL_AT.
    os.makedirs(parts / "killed", exist_ok=True)
    procs = _start(parts, "killed", f"--trainer.callbacks.hold_at={KILL_AT}", "--trainer.callbacks.hold_node=1")
    try:
        held = parts / "killed" / "probe" / "held.json"
        deadline = time.monotonic() + TIMEOUT
        while not held.exists():
            assert all(p.poll() is None for p in procs), _stderr(parts, "killed")
            assert time.monotonic() < deadline, "node 1 never reached step " + str(KILL_AT + 1)
            time.sleep(0.2)
        assert json.loads(held.read_text())["pid"] == procs[1].pid  # Lightning started no process of its own
        saved = torch.load(parts / "ckpt" / "last.ckpt", weights_only=True)
        assert saved["global_step"] == KILL_AT
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        assert procs[1].wait(timeout=TIMEOUT) == -signal.SIGKILL
        # Node 0 is blocked in its next collective with node 1 (inside step KILL_AT + 1): gloo reports the closed
        # connection and the process ends with an error by itself, no scheduler needed to end it.
        code = procs[0].wait(timeout=TIMEOUT)
        print(
            f"node 0 ended {time.monotonic() - killed_at:.1f} s after node 1's kill, exit code {code}", file=sys.stderr
        )
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
