"""The LightningModule: the science (loss, optimiser, schedule, window policy). Observation lives in callbacks."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric, Metric

from aah_lightning import validation
from aah_lightning.aah.config import AAHConfig
from aah_lightning.aah.policies import make_policy
from aah_lightning.errors import require
from aah_lightning.lit import distributed
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay to ``lr * min_lr_ratio`` at the last step."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1

    def validate(self) -> None:
        require(self.lr > 0, "model.optim.lr", self.lr, "a positive learning rate")
        require(self.weight_decay >= 0, "model.optim.weight_decay", self.weight_decay, ">= 0")
        require(self.warmup_steps >= 0, "model.optim.warmup_steps", self.warmup_steps, ">= 0")
        require(0 <= self.min_lr_ratio <= 1, "model.optim.min_lr_ratio", self.min_lr_ratio, "in [0, 1]")


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at ``step``: linear warmup, then cosine to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class BitsPerByte(Metric):
    """Cross-entropy in bits per byte of text: summed nats / (ln 2 x summed UTF-8 bytes the predicted tokens encode).

    Comparable across tokenizers. End-of-document tokens are predicted (their loss counts) but encode no text.
    """

    def __init__(self):
        super().__init__()
        self.add_state("nats", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("bytes", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, mean_loss: torch.Tensor, n_tokens: int, n_bytes: torch.Tensor) -> None:
        self.nats += mean_loss.detach().double() * n_tokens
        self.bytes += n_bytes.sum()

    def compute(self) -> torch.Tensor:
        return self.nats / (math.log(2) * self.bytes)


class AAHModule(L.LightningModule):
    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        seq_len: int = 256,
        vocab_size: int = 257,
        mlp_ratio: float = 4.0,
        bias: bool = False,
        rope_base: float = 10000.0,
        backend: str = "auto",
        block_size: int = 128,
        document_mask: bool = False,
        compile_blocks: bool = False,
        activation_checkpointing: bool = False,
        aah: Optional[AAHConfig] = None,
        optim: Optional[OptimConfig] = None,
    ):
        """
        Args:
            n_layer: transformer blocks.
            n_head: attention heads per block (each has its own window).
            n_embd: model width (n_embd / n_head must be even for RoPE).
            seq_len: training sequence length T (linked from data.seq_len).
            vocab_size: vocabulary size (linked from the data module's tokenizer).
            mlp_ratio: MLP hidden width / n_embd.
            bias: biases in linear layers and norms.
            rope_base: RoPE frequency base.
            backend: attention backend: auto, flex, banded, sdpa.
            block_size: FlexAttention BlockMask tile size.
            document_mask: queries attend only within their own document.
            compile_blocks: torch.compile each transformer block (flex attention is always compiled). For GPUs.
            activation_checkpointing: recompute each block's activations in the backward pass (less memory).
            aah: the window policy and its settings.
            optim: optimiser and schedule.
        """
        super().__init__()
        aah = aah or AAHConfig()
        optim = optim or OptimConfig()
        if isinstance(aah, dict):
            aah = AAHConfig(**aah)
        if isinstance(optim, dict):
            optim = OptimConfig(**optim)
        # Plain values only, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters(
            dict(
                n_layer=n_layer, n_head=n_head, n_embd=n_embd, seq_len=seq_len, vocab_size=vocab_size,
                mlp_ratio=mlp_ratio, bias=bias, rope_base=rope_base, backend=backend, block_size=block_size,
                document_mask=document_mask, compile_blocks=compile_blocks,
                activation_checkpointing=activation_checkpointing, aah=asdict(aah), optim=asdict(optim),
            )
        )
        self.gpt_config = GPTConfig(
            vocab_size=vocab_size,
            seq_len=seq_len,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            mlp_ratio=mlp_ratio,
            bias=bias,
            rope_base=rope_base,
            backend=backend,
            block_size=block_size,
            document_mask=document_mask,
        )
        optim.validate()
        self.aah_config, self.optim_config = aah, optim
        self.policy = make_policy(aah, n_layer, n_head, seq_len)
        self.model = GPT(self.gpt_config)
        self.model.set_windows(self.policy.initial_table())
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.val_bpb, self.test_bpb = BitsPerByte(), BitsPerByte()  # for batches that know their text ("bytes")
        self.table_sync = distributed.WindowTableSync()
        self._prepared = False
        self._rng_to_restore = None

    def configure_model(self) -> None:
        # Lightning calls this for every fit/validate/test in a process; the model must be prepared only once.
        if self._prepared:
            return
        hp = self.hparams
        distributed.prepare_model(self, hp.compile_blocks, hp.activation_checkpointing)
        self._prepared = True

    # -- forward / loss ----------------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(tokens, doc_ids)

    def _loss(self, batch) -> torch.Tensor:
        tokens, docs = batch["tokens"], batch["doc_ids"]
        logits = self.model(tokens[:, :-1], docs[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        # Policies decide once per optimizer step (the first micro-batch of it), identically on every rank.
        if batch_idx % self.trainer.accumulate_grad_batches == 0:
            version = self.model.windows._version  # a policy may also write the buffer itself
            table = self.policy.on_train_step(self.global_step, self.model, batch)
            if table is not None:
                self.model.set_windows(table)
            self.table_sync.update(self.model.windows, self.global_step, self.model.windows._version != version)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])  # a Python float: no sync
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.val_loss.update(loss, weight=batch["tokens"].shape[0])
        if "bytes" in batch:
            self.val_bpb.update(loss, batch["tokens"][:, 1:].numel(), batch["bytes"])

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss))
        self.val_loss.reset()
        if self.val_bpb.update_count:
            self.log("val/bpb", self.val_bpb.compute().float())
            self.val_bpb.reset()

    def test_step(self, batch, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.test_loss.update(loss, weight=batch["tokens"].shape[0])
        if "bytes" in batch:
            self.test_bpb.update(loss, batch["tokens"][:, 1:].numel(), batch["bytes"])

    def on_test_epoch_end(self) -> None:
        loss = self.test_loss.compute()
        self.log("test/loss", loss)
        self.log("test/ppl", torch.exp(loss))
        self.test_loss.reset()
        if self.test_bpb.update_count:
            self.log("test/bpb", self.test_bpb.compute().float())
            self.test_bpb.reset()

    # -- optimisation ------------------------------------------------------------------------------------------------
    def parameter_groups(self) -> list[dict]:
        """Weight decay on matrices of linear layers only: not on norms, biases or (tied) embeddings."""
        decay, no_decay = {}, {}
        for module in self.model.modules():
            for name, p in module.named_parameters(recurse=False):
                target = decay if isinstance(module, nn.Linear) and name == "weight" and p is not self.model.wte.weight else no_decay
                target[id(p)] = p
        for key in decay.keys() & no_decay.keys():
            decay.pop(key)
        return [
            {"params": list(decay.values()), "weight_decay": self.optim_config.weight_decay},
            {"params": list(no_decay.values()), "weight_decay": 0.0},
        ]

    def configure_optimizers(self):
        cfg = self.optim_config
        opt = torch.optim.AdamW(self.parameter_groups(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
        total = int(self.trainer.estimated_stepping_batches) if self.trainer is not None else 1
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_factor(step, cfg.warmup_steps, total, cfg.min_lr_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- checkpoint extras -------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        # The CLI checks this before the Trainer starts; repeated here for code that drives a Trainer directly.
        validation.check_run(self, self.trainer.datamodule, self.trainer.strategy.root_device, stage)

    def on_fit_start(self) -> None:
        ddp_kwargs = getattr(self.trainer.strategy, "_ddp_kwargs", None)
        if ddp_kwargs is not None and ddp_kwargs.get("broadcast_buffers", True) and self.trainer.world_size > 1:
            rank_zero_warn(
                "DDP broadcasts buffers before every forward, which rewrites the window table each step and makes the "
                "attention planner read it back to the host every step. Use DDPStrategy(broadcast_buffers=False) "
                "(configs/cluster/ddp.yaml); aah checks that the tables agree across ranks."
            )

    def on_train_start(self) -> None:
        # Restored here, after Lightning has built the train loader (which draws from the global RNG), so the
        # generators continue from exactly where the interrupted run saved them.
        if self._rng_to_restore is not None:
            distributed.set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["aah_policy"] = self.policy.state_dict()
        if self._trainer is not None and self.trainer.state.fn == "fit":
            self.table_sync.verify(self.model.windows, self.global_step)  # never save a table only one rank has
        checkpoint["aah_rng"] = distributed.gather(distributed.rng_state())  # every rank's, in rank order

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # A checkpoint of another shape: one line naming the setting, before load_state_dict's wall of text.
        trainer = self._trainer
        validation.check_matches(checkpoint, self, str(getattr(trainer, "ckpt_path", None) or "checkpoint"))
        self.policy.load_state_dict(checkpoint.get("aah_policy", {}))
        states = checkpoint.get("aah_rng")
        world = self.trainer.world_size if self._trainer is not None else 1
        if states is not None and len(states) == world:
            self._rng_to_restore = states[self.trainer.global_rank if self._trainer is not None else 0]
        elif states is not None:
            rank_zero_warn(
                f"the checkpoint holds RNG states of {len(states)} ranks, this run has {world}: RNG states not restored"
            )
