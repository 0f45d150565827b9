"""Two "nodes" on one machine: one ``aah fit`` process per node, started with the environment Lightning reads for a
multi-node job whose processes something else created (``LightningEnvironment``), and the callback inside them.

``--trainer.callbacks+=helpers.nodes.NodeProbe`` (PYTHONPATH holds tests/, as for ``helpers.resume``)."""

from __future__ import annotations

import json
import os
import time

import lightning as L

from aah_lightning.lit.lightning_private import cluster_environment, inside_accumulation_window
from helpers.launch import rank_env

# Seconds for any one wait: only a guard against a hang. On a machine whose cores are taken by higher-priority work
# (the tests run niced next to experiments), starting two processes and training four tiny steps took over 300 s.
TIMEOUT = 900


def node_env(node_rank: int, port: int, nodes: int = 2) -> dict:
    """The environment of node ``node_rank``'s process (one process per node): what a launcher sets
    (``helpers.launch.rank_env``). ``LOCAL_RANK`` tells Lightning that the processes are created externally (it starts
    none itself); ``NODE_RANK`` and the trainer's ``num_nodes`` x ``devices`` give each process its global rank and the
    world size; ``MASTER_ADDR``/``MASTER_PORT`` are node 0's address and a free port on it, where the process group
    meets."""
    return rank_env(node_rank, nodes, port, nodes=nodes)


def _write(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # seen whole or not at all


class NodeProbe(L.Callback):
    """Writes ``{folder}/start.node{n}.json`` when training starts: how Lightning placed this process (cluster
    environment, ranks, world size, the step it starts from). With ``hold_at``: on node ``hold_node``, after the first
    micro-batch of optimizer step ``hold_at + 1`` (the checkpoint of step ``hold_at`` is written), writes
    ``{folder}/held.json`` with the process id and waits there to be killed."""

    def __init__(self, folder: str, hold_at: int = -1, hold_node: int = 1):
        self.folder, self.hold_at, self.hold_node = folder, hold_at, hold_node

    def on_train_start(self, trainer, pl_module):
        env = cluster_environment(trainer)
        os.makedirs(self.folder, exist_ok=True)
        _write(
            os.path.join(self.folder, f"start.node{trainer.node_rank}.json"),
            {
                "environment": type(env).__name__,
                "creates_processes_externally": env.creates_processes_externally,
                "global_rank": trainer.global_rank,
                "node_rank": trainer.node_rank,
                "local_rank": trainer.local_rank,
                "world_size": trainer.world_size,
                "num_nodes": trainer.num_nodes,
                "pid": os.getpid(),
                "cwd": os.getcwd(),
                "slurm_node": os.environ.get("SLURMD_NODENAME"),  # the node SLURM started this task on, if any
                "step": trainer.global_step,
            },
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.node_rank != self.hold_node or trainer.global_step != self.hold_at:
            return
        if not inside_accumulation_window(trainer):
            return
        _write(os.path.join(self.folder, "held.json"), {"pid": os.getpid(), "step": trainer.global_step})
        time.sleep(2 * TIMEOUT)  # longer than the test waits for this file
        raise RuntimeError(f"held after step {self.hold_at} and never killed")
