"""The SLURM batch script without SLURM: the ``aah fit`` command it builds for two nodes of eight GPUs parses to the
intended layout (``srun`` is a stand-in), and under SLURM the batch script alone requeues the job.
tests/distributed/test_slurm_real.py runs the script on a real one-node SLURM cluster: requeue, signals and resume."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml
from lightning.fabric.plugins.environments import SLURMEnvironment

from aah_lightning.cli import AAHCLI
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.lightning_private import cluster_environment
from aah_lightning.lit.module import AAHModule
from helpers.cli import PYTHON, REPO, subprocess_env, tiny_config

SCRIPT = os.path.join(REPO, "configs", "cluster", "slurm.sbatch")


def _fake_bin(tmp_path, srun_body: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\n" + srun_body)
    (bin_dir / "srun").chmod(0o755)
    env = subprocess_env()
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_NTASKS="16",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NTASKS_PER_NODE="8",
        AAH_CONFIGS=os.path.join(REPO, "configs", "cluster"),
        RUN_DIR=str(tmp_path / "run"),
    )
    return env


# srun stand-in: drop srun's own options, run `aah ...` as `python -m aah_lightning ... --print_config`.
PRINT_CONFIG = f"""while [[ "$1" == --* ]]; do shift; done
shift  # aah
exec {PYTHON} -m aah_lightning "$@" --print_config
"""


@pytest.mark.parametrize("strategy,resumed", [("ddp", False), ("fsdp2", True)])
def test_the_batch_script_builds_the_intended_run(tmp_path, strategy, resumed):
    env = _fake_bin(tmp_path, PRINT_CONFIG)
    env["STRATEGY"] = strategy
    if resumed:  # a requeued job: the last checkpoint is there (under FSDP2 a folder of shards)
        (tmp_path / "run" / "checkpoints" / "last.ckpt").mkdir(parents=True)
    out = subprocess.run(
        ["bash", SCRIPT, "--model.gpt.n_layer=6"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    trainer = cfg["trainer"]
    assert trainer["num_nodes"] == 2 and str(trainer["devices"]) == "8"
    assert cfg["ckpt_path"] == ("last" if resumed else None)  # the first run starts fresh, a requeued one resumes
    assert cfg["checkpoint"]["dirpath"] == f"{tmp_path}/run/checkpoints"
    assert cfg["model"]["gpt"]["n_layer"] == 6  # the script passes extra arguments on
    if strategy == "ddp":
        assert trainer["strategy"]["class_path"].endswith("DDPStrategy")
        assert trainer["strategy"]["init_args"]["broadcast_buffers"] is False
    else:
        assert trainer["strategy"]["class_path"].endswith("ModelParallelStrategy")
        assert trainer["strategy"]["init_args"]["data_parallel_size"] == 16  # the world size: sharded over all GPUs
        assert trainer["strategy"]["init_args"]["tensor_parallel_size"] == 1


@pytest.mark.parametrize("own_plugin", [False, True])
def test_under_slurm_lightning_leaves_the_requeue_to_the_batch_script(tmp_path, monkeypatch, own_plugin):
    # Lightning's auto-requeue would also requeue on a USR1 that reaches the tasks, after saving a mid-step hpc_ckpt.
    # Off, unless the config brings its own cluster environment.
    for name, value in dict(
        SLURM_NTASKS="1",
        SLURM_JOB_NAME="aah",
        SLURM_JOB_ID="4242",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_NODELIST="node1",
    ).items():
        monkeypatch.setenv(name, value)
    args = ["--config", tiny_config(tmp_path)]
    if own_plugin:
        args.append("--trainer.plugins=lightning.fabric.plugins.environments.SLURMEnvironment")
    cli = AAHCLI(AAHModule, TextDataModule, run=False, args=args, auto_configure_optimizers=False)
    environment = cluster_environment(cli.trainer)
    assert isinstance(environment, SLURMEnvironment) and environment.auto_requeue is own_plugin
