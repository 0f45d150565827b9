"""Two-process DDP run (gloo, CPU) of the adaptive policy; each rank saves what it decided.

Run by tests/distributed/test_controller_ddp.py as ``python tests/distributed/ddp_controller_run.py OUT_DIR
[MECHANISM]`` (``mass``, the default, ``reach_gain``: explorers and the gain signal, ``reach_gain_kept``: that
with kept reach, or ``rewind_gain_kept``: kept reach and calibrate-and-rewind); Lightning's ddp launcher starts rank 1 by running this same command again.
"""

import sys

import lightning as L
import torch

from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.distributed import shutdown_process_group
from aah_lightning.lit.module import AAHModule, OptimConfig
from aah_lightning.model.config import GPTConfig
from aah_lightning.windows.config import AAHConfig, ControllerConfig


class Record(L.Callback):
    """The window table every step, and a fingerprint of the batch this rank trained on."""

    def __init__(self):
        self.tables, self.batches = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.tables.append(pl_module.model.windows.clone())
        self.batches.append(int(batch["tokens"].sum()))


REACH_GAIN = {"need": {"signal": "gain"}, "reach": {"explorers": 1, "formation_steps": 6}}
MECHANISMS = {
    "mass": {},
    "reach_gain": REACH_GAIN,
    "reach_gain_kept": {**REACH_GAIN, "reach": {**REACH_GAIN["reach"], "heads": 1}},
    # calibrate-and-rewind: the decision at step 2 with kept reach, then every rank back to step 0's weights
    "rewind_gain_kept": {"need": {"signal": "gain"}, "reach": {"heads": 1}, "schedule": {"rewind": True}},
}


def main(out_dir: str, mechanism: str = "mass") -> None:
    L.seed_everything(0)
    T = 64
    dm = TextDataModule(source="synthetic", seq_len=T, batch_size=4, synthetic={"documents": 200}, seed=0)
    blocks = MECHANISMS[mechanism]
    controller = ControllerConfig(
        schedule={"warmup_steps": 2, "control_interval": 3, **blocks.get("schedule", {})},
        need={"probe_queries": 16, **blocks.get("need", {})},
        budget={"target_acr": 0.4},
        groups={"depth": 2},
        reach=blocks.get("reach", {}),
    )
    model = AAHModule(
        gpt=GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=T, vocab_size=dm.vocab_size),
        aah=AAHConfig(policy="adaptive", candidates=[4, 8, 16, 32, 64], controller=controller),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
    )
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[record],
    )
    trainer.fit(model, dm)
    torch.save(
        {
            "tables": record.tables,
            "batches": record.batches,
            "policy": model.policy.state_dict(),
            "params": {k: v.detach().clone() for k, v in model.model.named_parameters()},
        },
        f"{out_dir}/rank{trainer.global_rank}.pt",
    )
    shutdown_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
