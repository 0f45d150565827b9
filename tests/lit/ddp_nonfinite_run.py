"""Two-process DDP run (gloo, CPU) where only rank 1's loss becomes non-finite; each rank writes how it stopped.

Run by tests/lit/test_nonfinite_guard.py as ``python tests/lit/ddp_nonfinite_run.py OUT_DIR``; Lightning's ddp launcher starts
rank 1 by running this same command again.
"""

import json
import sys

import lightning as L
import torch

from aah_lightning.errors import TrainingDiverged
from aah_lightning.lit.atomic_files import AtomicCheckpointIO
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.distributed import shutdown_process_group
from aah_lightning.lit.guards import NonFiniteGuard
from aah_lightning.lit.last_checkpoint import LastCheckpoint
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig


class PoisonRank1(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 3:
            with torch.no_grad():
                pl_module.model.wte.weight[batch["tokens"][0, 0]] = float("inf")


def main(out_dir: str) -> None:
    L.seed_everything(0)
    data = TextDataModule(source="synthetic", seq_len=32, batch_size=4, synthetic={"documents": 100})
    model = AAHModule(gpt=GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32, vocab_size=data.vocab_size))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=12,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,
        default_root_dir=out_dir,
        plugins=[AtomicCheckpointIO()],
        callbacks=[PoisonRank1(), NonFiniteGuard(check_every_n_steps=2), LastCheckpoint(f"{out_dir}/ckpts", 1)],
    )
    try:
        trainer.fit(model, data)
        outcome = {"stopped": None}
    except TrainingDiverged as e:
        outcome = {"stopped": str(e), "global_step": trainer.global_step}
    with open(f"{out_dir}/rank{trainer.global_rank}.json", "w") as f:
        json.dump(outcome, f)
    shutdown_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
