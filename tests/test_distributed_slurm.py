"""The SLURM batch script, with stand-ins for ``srun`` and ``scontrol``: the ``aah fit`` command it builds parses to
the intended layout, and the time-limit signal requeues the job."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import yaml

from _resume_helpers import PYTHON, REPO, subprocess_env

SCRIPT = os.path.join(REPO, "configs", "cluster", "slurm.sbatch")


def _fake_bin(tmp_path, srun_body: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\n" + srun_body)
    # scontrol stand-in: records its arguments and, like a requeue, ends the running job step.
    scontrol = f'#!/bin/bash\necho "$@" > {tmp_path}/scontrol.args\nkill "$(cat {tmp_path}/srun.pid)"\n'
    (bin_dir / "scontrol").write_text(scontrol)
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    env = subprocess_env()
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_ID="4242", SLURM_NTASKS="16", SLURM_JOB_NUM_NODES="2",
        SLURM_NTASKS_PER_NODE="8", AAH_CONFIGS=os.path.join(REPO, "configs", "cluster"), RUN_DIR=str(tmp_path / "run"),
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
    out = subprocess.run(["bash", SCRIPT, "--model.n_layer=6"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    trainer = cfg["trainer"]
    assert trainer["num_nodes"] == 2 and str(trainer["devices"]) == "8"
    assert cfg["ckpt_path"] == ("last" if resumed else None)  # the first run starts fresh, a requeued one resumes
    assert cfg["checkpoint"]["dirpath"] == f"{tmp_path}/run/checkpoints"
    assert cfg["model"]["n_layer"] == 6  # the script passes extra arguments on
    if strategy == "ddp":
        assert trainer["strategy"]["class_path"].endswith("DDPStrategy")
        assert trainer["strategy"]["init_args"]["broadcast_buffers"] is False
    else:
        assert trainer["strategy"]["class_path"].endswith("ModelParallelStrategy")
        assert trainer["strategy"]["init_args"]["data_parallel_size"] == 16  # the world size: sharded over all GPUs
        assert trainer["strategy"]["init_args"]["tensor_parallel_size"] == 1


def test_the_time_limit_signal_requeues_the_job(tmp_path):
    # srun stand-in: "trains" until the requeue stops it (scontrol's stand-in kills it, as SLURM would).
    env = _fake_bin(tmp_path, f"echo $$ > {tmp_path}/srun.pid\nexec sleep 120\n")
    proc = subprocess.Popen(["bash", SCRIPT], env=env, cwd=tmp_path)
    try:
        deadline = time.time() + 30
        while not (tmp_path / "srun.pid").exists():
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
    assert proc.returncode == 128 + signal.SIGTERM  # the job step ended by the requeue, not normally
