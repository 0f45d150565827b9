"""Two processes on CPU (gloo) through ``aah fit`` and the shipped cluster configs: the tiny run's settings, a run, a
run preempted and resumed, and what every rank of a run must agree on."""

from __future__ import annotations

import os
import subprocess

import yaml

from helpers.cli import REPO
from helpers.launch import run_ranks

STEPS, INTERRUPT_AT = 6, 3


def cpu_config(folder) -> str:
    """Overrides that turn the GPU cluster configs into a tiny two-process CPU run."""
    cfg = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "precision": "32-true",
            "max_steps": STEPS,
            "accumulate_grad_batches": 2,
            "val_check_interval": 4,
            "limit_val_batches": 2,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": False,
            "default_root_dir": str(folder),
        },
        "checkpoint": {"dirpath": str(folder / "ckpt"), "every_n_train_steps": 1},
        "model": {
            "gpt": {"n_layer": 2, "n_head": 4, "n_embd": 32, "backend": "auto", "compile_blocks": False},
            "aah": {"policy": "random", "candidates": [8, 16, 32], "random": {"redraw_interval": 2}},
        },
        # No test split. 3 validation blocks (of 64) on 1 or 2 processes alike (held out: at least one per process),
        # so the 61 training blocks, and their global order, are the same on either. The epoch boundary inside step 3
        # falls where the two ranks' micro-batches do not meet the same block twice (check_ranks).
        "data": {
            "source": "synthetic",
            "seq_len": 32,
            "batch_size": 4,
            "synthetic": {"documents": 64},
            "test_fraction": 0.0,
            "val_fraction": 0.05,
        },
    }
    os.makedirs(folder, exist_ok=True)
    (folder / "cpu.yaml").write_text(yaml.safe_dump(cfg))
    return str(folder / "cpu.yaml")


def fit_args(folder, configs: list[str], *extra: str) -> list[str]:
    """``aah fit`` arguments for the configs, on the CPU overrides, with the Recorder writing to ``{folder}/rec``."""
    args = ["fit"]
    for c in [*configs, cpu_config(folder)]:
        args += ["--config", c if os.path.isabs(c) else os.path.join(REPO, c)]
    return args + ["--trainer.callbacks+=helpers.resume.Recorder", f"--trainer.callbacks.folder={folder}/rec", *extra]


def world_size(args: list[str]) -> int:
    """The number of processes a run of ``args`` has: the last ``--trainer.devices=N``, else the CPU overrides' 2."""
    given = [a.split("=", 1)[1] for a in args if a.startswith("--trainer.devices=")]
    return int(given[-1]) if given else 2


def fit(folder, configs: list[str], *extra: str, expect_ok=True) -> subprocess.CompletedProcess:
    """``aah fit`` on two processes (or ``--trainer.devices``), started as a launcher starts ranks, forked from the
    pre-imported server (``helpers.launch``). The result: rank 0's exit code, every rank's output as ``stderr`` (rank
    0's first)."""
    args = fit_args(folder, configs, *extra)
    codes, output = run_ranks(args, world_size(args), folder, os.path.join(folder, "fit"), timeout=600)
    if expect_ok:
        assert codes == [0] * len(codes), output[-4000:]
    return subprocess.CompletedProcess(["aah", *args], codes[0], "", output)


def preempted_then_resumed(folder, configs, *extra):
    proc = fit(
        folder,
        configs,
        *extra,
        "--trainer.callbacks+=helpers.resume.Interrupt",
        f"--trainer.callbacks.at_step={INTERRUPT_AT}",
        expect_ok=False,
    )
    assert proc.returncode != 0 and "simulated preemption" in proc.stderr, proc.stderr[-4000:]
    fit(folder, configs, *extra, "--ckpt_path=last")


def sigterm_then_resumed(folder, configs, rank: int, *extra, lightning_launch=False):
    """SIGTERM to rank ``rank`` alone, inside the accumulation window of step INTERRUPT_AT + 1: every rank finishes that
    step, last.ckpt holds it, rank 0 says so in one line, the exit code is 143. Then ``--ckpt_path last``.
    ``lightning_launch``: the signalled run is one ``aah fit`` process that starts the other rank itself."""
    from helpers.signals import hold_args, run_and_sigterm, sigterm_lines

    args = fit_args(folder, configs, *extra, *hold_args(folder, INTERRUPT_AT, rank=rank))
    code, stderr = run_and_sigterm(args, folder, ranks=world_size(args), lightning_launch=lightning_launch)
    lines = sigterm_lines(stderr)
    assert code == 143 and len(lines) == 1, stderr[-4000:]
    assert lines[0].startswith(f"aah: stopped by SIGTERM after step {INTERRUPT_AT + 1}: its checkpoint is "), lines
    assert "Traceback" not in stderr, stderr[-4000:]
    fit(folder, configs, *extra, "--ckpt_path=last")


DDP = ["configs/cluster/ddp.yaml"]
FSDP2 = ["configs/cluster/ddp.yaml", "configs/cluster/fsdp2.yaml"]


def check_ranks(runs):
    r0, r1 = runs
    assert len(r0) == len(r1) == STEPS * 2
    for a, b in zip(r0, r1):
        assert a["table"] == b["table"]  # one window table on every rank, at every step
        assert not set(a["index"]) & set(b["index"])  # each rank trains on its own blocks
    assert len({str(r["table"]) for r in r0}) > 1  # the table did change, before and after the interruption
