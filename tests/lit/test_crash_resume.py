"""kill -9 a training run at a random moment: every checkpoint left behind is complete, and ``--ckpt_path last``
resumes from the newest one with exactly the data an uninterrupted run would have seen next."""

from __future__ import annotations

import os
import random
import signal
import time

import lightning as L
import pytest
import torch

from aah_lightning.atomic import PARTIAL_PREFIX
from aah_lightning.checkpoint import load_checkpoint_file
from aah_lightning.cli import main
from aah_lightning.data.packing import EndlessSampler
from aah_lightning.lit.datamodule import TextDataModule
from helpers.cli import tiny_config
from helpers.launch import aah_env, read_outputs, run_ranks, start_aah, start_ranks


class Recorder(L.Callback):
    """Records (global step, batch indices) of every training batch of the resumed run."""

    seen: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        Recorder.seen.append((trainer.global_step, batch["index"].tolist()))


@pytest.mark.heavy
def test_sigkill_then_resume_from_last(tmp_path):
    config = tiny_config(tmp_path, trainer={"max_steps": 100000})
    ckpts = tmp_path / "ckpts"
    output = tmp_path / "output.txt"
    proc = start_aah(["fit", "--config", config], aah_env(), tmp_path, output)
    try:
        deadline = time.time() + 300
        while not (ckpts / "last.ckpt").exists():
            assert proc.poll() is None, output.read_text()[-2000:]
            assert time.time() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        time.sleep(random.uniform(0.0, 2.0))  # checkpoints are written every step: any moment will do
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # Nothing truncated is left where a checkpoint should be (checksums verified, weights-only unpickling).
    names = os.listdir(ckpts)
    for name in names:
        if name.endswith(".ckpt"):
            load_checkpoint_file(ckpts / name)
    step = load_checkpoint_file(ckpts / "last.ckpt")["global_step"]
    assert step >= 1

    Recorder.seen = []
    main(
        [
            "fit",
            "--config",
            config,
            "--ckpt_path",
            "last",
            "--trainer.max_steps",
            str(step + 3),
            "--trainer.callbacks+=test_crash_resume.Recorder",
        ]
    )
    resumed = load_checkpoint_file(ckpts / "last.ckpt")
    assert resumed["global_step"] == step + 3
    assert all(torch.isfinite(t).all() for t in resumed["state_dict"].values() if t.is_floating_point())
    assert not [n for n in os.listdir(ckpts) if n.startswith(PARTIAL_PREFIX)]  # a killed writer's leftover is gone

    # The resumed run continues the seeded data order where the killed one stopped.
    data = TextDataModule(source="synthetic", seq_len=32, batch_size=4, synthetic={"documents": 100})
    data.setup("fit")
    order = list(EndlessSampler(len(data.train_set), seed=1234, length=(step + 3) * 4))
    assert [s for s, _ in Recorder.seen] == [step, step + 1, step + 2]
    assert [i for _, i in Recorder.seen] == [order[s * 4 : (s + 1) * 4] for s in (step, step + 1, step + 2)]


@pytest.mark.heavy
def test_sigkill_of_two_fsdp2_processes_then_resume_from_last(tmp_path):
    # Two processes on CPU (gloo) with the shipped FSDP2 config: last.ckpt is a folder of per-rank shards written by
    # both ranks. Killed at any moment, it names a complete checkpoint that resumes.
    from helpers.distributed import FSDP2, fit_args

    args = fit_args(tmp_path, FSDP2, "--trainer.strategy.init_args.data_parallel_size=2")
    args.append("--trainer.val_check_interval=1000")
    ckpts, last = tmp_path / "ckpt", tmp_path / "ckpt" / "last.ckpt"
    procs, outputs = start_ranks([*args, "--trainer.max_steps=100000"], 2, tmp_path, tmp_path / "output")
    try:
        deadline = time.time() + 300
        while not last.exists():
            assert all(p.poll() is None for p in procs), read_outputs(outputs)[-4000:]
            assert time.time() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        time.sleep(random.uniform(0.0, 3.0))  # a checkpoint every step: the kill lands during a save or between
    finally:
        for p in procs:  # both ranks
            p.kill()
            p.wait()

    # last.ckpt names a complete distributed checkpoint: its metadata, both shards and Lightning's meta.pt.
    assert last.is_symlink() and last.is_dir()
    assert (last / ".metadata").is_file() and len([p for p in os.listdir(last) if p.endswith(".distcp")]) == 2
    step = torch.load(last / "meta.pt", weights_only=True)["global_step"]
    assert step >= 1

    resume = [*args, "--ckpt_path=last", f"--trainer.max_steps={step + 2}"]
    codes, output = run_ranks(resume, 2, tmp_path, tmp_path / "resumed", timeout=600)
    assert codes == [0, 0], output[-4000:]
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == step + 2
    # One checkpoint folder behind the link, no temporary folder of the killed writer left.
    left = sorted(os.listdir(ckpts))
    assert not [n for n in left if n.startswith(PARTIAL_PREFIX)], left
    assert [n for n in left if n.startswith(".last.ckpt.")] == [os.path.basename(os.path.realpath(last))], left
