"""kill -9 a training run at a random moment: every checkpoint left behind is complete, and ``--ckpt_path last``
resumes from the newest one with exactly the data an uninterrupted run would have seen next."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import lightning as L
import pytest
import torch

from _cli_helpers import PYTHON, subprocess_env, tiny_config
from aah_lightning.cli import main
from aah_lightning.data.packing import EndlessSampler
from aah_lightning.lit.checkpointing import PARTIAL_PREFIX, load_checkpoint_file
from aah_lightning.lit.datamodule import TextDataModule


class Recorder(L.Callback):
    """Records (global step, batch indices) of every training batch of the resumed run."""

    seen: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        Recorder.seen.append((trainer.global_step, batch["index"].tolist()))


@pytest.mark.heavy
def test_sigkill_then_resume_from_last(tmp_path):
    config = tiny_config(tmp_path, trainer={"max_steps": 100000})
    ckpts = tmp_path / "ckpts"
    proc = subprocess.Popen(
        [PYTHON, "-m", "aah_lightning", "fit", "--config", config],
        env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 300
        while not (ckpts / "last.ckpt").exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        time.sleep(random.uniform(0.0, 2.0))  # checkpoints are written every step: any moment will do
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    # Nothing truncated is left where a checkpoint should be (checksums verified, weights-only unpickling).
    names = os.listdir(ckpts)
    for name in names:
        if name.endswith(".ckpt"):
            load_checkpoint_file(ckpts / name)
    step = load_checkpoint_file(ckpts / "last.ckpt")["global_step"]
    assert step >= 1

    Recorder.seen = []
    main(["fit", "--config", config, "--ckpt_path", "last", "--trainer.max_steps", str(step + 3),
          "--trainer.callbacks+=test_crash_resume.Recorder"])
    resumed = load_checkpoint_file(ckpts / "last.ckpt")
    assert resumed["global_step"] == step + 3
    assert all(torch.isfinite(t).all() for t in resumed["state_dict"].values() if t.is_floating_point())
    assert not [n for n in os.listdir(ckpts) if n.startswith(PARTIAL_PREFIX)]  # a killed writer's leftover is gone

    # The resumed run continues the seeded data order where the killed one stopped.
    data = TextDataModule(source="synthetic", seq_len=32, batch_size=4, synthetic_documents=100)
    data.setup("fit")
    order = list(EndlessSampler(len(data.train_set), seed=1234, length=(step + 3) * 4))
    assert [s for s, _ in Recorder.seen] == [step, step + 1, step + 2]
    assert [i for _, i in Recorder.seen] == [order[s * 4 : (s + 1) * 4] for s in (step, step + 1, step + 2)]
