"""The LightningModule: the science (loss, optimiser, schedule, window policy). Observation lives in callbacks."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Optional

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torchmetrics import MeanMetric

from aah_lightning import retrofit
from aah_lightning.checkpoint import (
    GLOBAL_STEP_KEY,
    HPARAMS_FORMAT,
    HPARAMS_FORMAT_ENTRY,
    HYPER_PARAMETERS_KEY,
    POLICY_KEY,
    RNG_KEY,
    WINDOW_USAGE_KEY,
    check_matches,
    is_remote,
    read_checkpoint,
    upgrade_hyperparameters,
)
from aah_lightning.data.batch import split_batch
from aah_lightning.errors import ConfigError, require
from aah_lightning.lit import distributed
from aah_lightning.lit.checks import check_run
from aah_lightning.lit.evaluation import BitsPerByte, PositionLoss, RecallAccuracy, widen_full_windows
from aah_lightning.lit.lightning_private import attached_trainer
from aah_lightning.lit.rewind import Rewind
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.generate import GenerationConfig, generate
from aah_lightning.model.gpt import GPT
from aah_lightning.model.window_math import causal_pairs
from aah_lightning.model_source import ModelSource
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.metrics import usage_head_acr
from aah_lightning.windows.policy_base import make_policy
from aah_lightning.windows.span import spans_of


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay to ``lr * min_lr_ratio`` at the last step.

    Attributes:
        lr: peak learning rate.
        weight_decay: AdamW weight decay of the linear layers' matrices (not norms, biases or embeddings).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warmup from lr / (warmup_steps + 1) to lr over this many steps.
        min_lr_ratio: the cosine decay ends at lr * min_lr_ratio at the last step.
    """

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


class WindowUsage:
    """What the run's windows cost and whether heads differed, over all its optimizer steps (in checkpoints).

    ``window_sum[l, h]``: the sum over steps of ``min(W, T)`` (divided by steps and T: each head's ACR averaged over
    the run); ``sink_sum[l, h]``: with an attention sink, the sum over steps of the pairs it adds
    (``window_math.sink_pairs``; divided by steps and T^2, the sink's share of that ACR); ``steps``;
    ``nonuniform_steps``: steps at which some layer's heads held different windows. One small device add per step and
    a host check only when the table changes, so training never waits for it.
    """

    def __init__(self, n_layer: int, n_head: int, seq_len: int, sink: int = 0):
        self.seq_len, self.sink = seq_len, sink
        self.window_sum: torch.Tensor | None = None  # int64 [L, H], on the model's device once training starts
        self.sink_sum: torch.Tensor | None = None  # int64 [L, H], with a sink
        self.steps = 0
        self.nonuniform_steps = 0
        self._nonuniform: bool | None = None  # of the table in force (None: not looked at yet)
        self._shape = (n_layer, n_head)

    def step(self, windows: torch.Tensor, changed: bool) -> None:
        if self.window_sum is None:
            self.window_sum = torch.zeros(self._shape, dtype=torch.int64, device=windows.device)
        elif self.window_sum.device != windows.device:  # restored from a checkpoint on the CPU
            self.window_sum = self.window_sum.to(windows.device)
        self.window_sum.add_(windows.clamp(max=self.seq_len))
        if self.sink:
            if self.sink_sum is None or self.sink_sum.device != windows.device:
                self.sink_sum = torch.zeros(self._shape, dtype=torch.int64, device=windows.device).add_(
                    0 if self.sink_sum is None else self.sink_sum.to(windows.device)
                )
            added = causal_pairs(windows, self.seq_len, self.sink) - causal_pairs(windows, self.seq_len)
            self.sink_sum.add_(added.round().to(torch.int64))  # integers, exact in float64
        if changed or self._nonuniform is None:
            rows = windows.detach().clamp(max=self.seq_len).cpu()
            self._nonuniform = bool((rows != rows[:, :1]).any())
        self.steps += 1
        self.nonuniform_steps += int(self._nonuniform)

    def head_acr(self) -> torch.Tensor:
        """``[L, H]`` float64: each head's ACR averaged over the run's steps."""
        if self.window_sum is None or not self.steps:
            return torch.full(self._shape, float("nan"), dtype=torch.float64)
        return usage_head_acr(self.state_dict(), self.seq_len)

    def state_dict(self) -> dict:
        total = self.window_sum.cpu() if self.window_sum is not None else torch.zeros(self._shape, dtype=torch.int64)
        state = {"window_sum": total, "steps": self.steps, "nonuniform_steps": self.nonuniform_steps}
        if self.sink_sum is not None:
            state["sink_sum"] = self.sink_sum.cpu()
        return state

    def load_state_dict(self, state: dict | None) -> None:
        if not state or tuple(state["window_sum"].shape) != self._shape:
            return
        self.window_sum = state["window_sum"].to(torch.int64).clone()
        self.sink_sum = state["sink_sum"].to(torch.int64).clone() if "sink_sum" in state else None
        self.steps, self.nonuniform_steps = int(state["steps"]), int(state["nonuniform_steps"])
        self._nonuniform = None


def _masked_mean(losses: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean loss over the targets that count: all, or those of ``loss_mask`` (the recall task's predictable
    targets; data/recall.py)."""
    if mask is None:
        return losses.mean()
    mask = mask.to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1)


# The GPT settings' defaults (frozen, so one instance serves every module).
DEFAULT_GPT = GPTConfig()


class AAHModule(L.LightningModule):
    def __init__(
        self,
        gpt: GPTConfig = DEFAULT_GPT,
        aah: Optional[AAHConfig] = None,
        optim: Optional[OptimConfig] = None,
        init_from: Optional[str] = None,
    ):
        """
        Args:
            gpt: the GPT's shape and how it runs (seq_len and vocab_size follow data.seq_len and the tokenizer).
            aah: the window policy and its settings.
            optim: optimiser and schedule.
            init_from: start from a trained model's weights, a fine-tune (not a resume: no optimizer, step or data
                position is taken): an aah checkpoint (a file, or an FSDP2 run's folder of shards) or a Hugging Face
                model folder (config.json and safetensors). model.gpt must hold the source's settings (python -m aah_lightning.retrofit SOURCE
                prints them); the window table comes from model.aah's policy. docs/retrofit.md.
        """
        super().__init__()
        # Plain dicts too: what a checkpoint's hyperparameters hold (AAHModule(**checkpoint.hyperparameters(ckpt))).
        gpt = GPTConfig(**gpt) if isinstance(gpt, Mapping) else gpt or DEFAULT_GPT
        aah = AAHConfig(**aah) if isinstance(aah, Mapping) else aah or AAHConfig()
        optim = OptimConfig(**optim) if isinstance(optim, Mapping) else optim or OptimConfig()
        # The source is opened once: its settings, vocabulary and (in configure_model) its weights.
        self._source = ModelSource.open(init_from) if init_from is not None else None
        if self._source is not None:  # a source with a padded vocabulary keeps its embedding rows
            gpt = self._source.padded(gpt)
        # The settings dataclasses as plain dicts (checkpoints load with torch.load(weights_only=True)), with the
        # version of this layout (checkpoint.HPARAMS_FORMAT_ENTRY).
        self.save_hyperparameters(
            {"gpt": asdict(gpt), "aah": aah.settings(), "optim": asdict(optim), HPARAMS_FORMAT_ENTRY: HPARAMS_FORMAT}
        )
        optim.validate()
        self.gpt_config, self.aah_config, self.optim_config = gpt, aah, optim
        # Not a hyperparameter: a checkpoint of this run holds the weights, its model never needs the source again.
        self.init_from = init_from
        if self._source is not None:
            retrofit.check_source(gpt, self._source)  # one line naming what differs, before anything is built
            longer = retrofit.longer_context(gpt.seq_len, self._source)
            if longer is not None:
                rank_zero_warn(longer)
        n_layer, n_head, seq_len = gpt.n_layer, gpt.n_head, gpt.seq_len
        groups = aah.controller.groups
        if aah.policy == "adaptive" and groups.method == "kv_heads":  # groups of the model's own key/value heads
            n_kv = gpt.n_kv_head or n_head
            require(
                groups.kv_heads == n_kv,
                "model.aah.controller.groups.kv_heads",
                groups.kv_heads,
                f"the model's n_kv_head, {n_kv} (model.gpt.n_kv_head)",
            )
        self.policy = make_policy(aah, n_layer, n_head, seq_len)
        self.model = GPT(self.gpt_config, sink=aah.sink)  # validated by make_policy
        self.model.set_windows(self.policy.initial_table())
        self.rewind = Rewind(self.policy.rewind_step())  # calibrate-and-rewind, when the policy asks for it
        self.spans = spans_of(self.policy)  # a policy's learned parameters (learned_span), optimised with the model
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.val_position_loss, self.test_position_loss = PositionLoss(), PositionLoss()
        self.val_bpb, self.test_bpb = BitsPerByte(), BitsPerByte()  # for batches that know their text ("bytes")
        self.val_recall, self.test_recall = RecallAccuracy(seq_len), RecallAccuracy(seq_len)  # recall task batches
        self.table_sync = distributed.WindowTableSync()
        self.window_usage = WindowUsage(n_layer, n_head, seq_len, aah.sink)
        self._prepared = False
        self._rng_to_restore = None
        self.checked_checkpoint: str | None = None  # the file the CLI's preflight already checked against this model
        self._step_losses: tuple[int, list[torch.Tensor]] = (-1, [])  # (global step, its micro-batch losses)
        self.generation = GenerationConfig()  # aah predict's settings: lit/generation.GenerationWriter sets them

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs):
        """Lightning's ``load_from_checkpoint``, for a checkpoint of any hyperparameter layout. A local file is first
        read as every checkpoint is (``checkpoint.read_checkpoint``: verified, tensors memory-mapped); one of an
        earlier layout reaches Lightning converted (``checkpoint.upgrade_hyperparameters``), from memory."""
        if isinstance(checkpoint_path, (str, os.PathLike)) and not is_remote(checkpoint_path):
            checkpoint = read_checkpoint(
                checkpoint_path, weights_only=kwargs.get("weights_only") is not False, mmap=True
            )
            saved = checkpoint.get(HYPER_PARAMETERS_KEY)
            if saved is not None and saved.get(HPARAMS_FORMAT_ENTRY) != HPARAMS_FORMAT:
                checkpoint[HYPER_PARAMETERS_KEY] = upgrade_hyperparameters(saved)
                checkpoint_path = io.BytesIO()
                torch.save(checkpoint, checkpoint_path)
                checkpoint_path.seek(0)
        return super().load_from_checkpoint(checkpoint_path, map_location, hparams_file, strict, **kwargs)

    def configure_model(self) -> None:
        # Lightning calls this for every fit/validate/test in a process; the model must be prepared only once.
        if self._prepared:
            return
        cfg = self.gpt_config
        if self.init_from is not None:
            # Into the whole model, before FSDP2 shards it. A resume (--ckpt_path) restores its checkpoint after this
            # hook under every strategy, so the restored weights replace these.
            retrofit.load_weights(self.model, self._source or self.init_from)
            self._source = None  # the weights are in the model: the source's files are not held any longer
        distributed.prepare_model(self, cfg.compile_blocks, cfg.activation_checkpointing)
        self._prepared = True

    # -- forward / loss ----------------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(tokens, doc_ids)

    def _token_losses(self, batch, recall: RecallAccuracy | None = None) -> torch.Tensor:
        """``[B, T]``: the cross-entropy of each next-token prediction (``recall``: also scores the recall answers)."""
        inputs, targets, docs = split_batch(batch)
        logits = self.model(inputs, docs)
        # Classes last and rows contiguous, as in the usual flattened form (the fast kernel path on every device).
        losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        if recall is not None and "recall_distance" in batch:
            recall.update(logits.detach(), targets, batch["recall_distance"])
        return losses.view_as(targets)

    def _loss(self, batch) -> torch.Tensor:
        return _masked_mean(self._token_losses(batch), batch.get("loss_mask"))

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        # Policies decide once per optimizer step (the first micro-batch of it), identically on every rank.
        if batch_idx % self.trainer.accumulate_grad_batches == 0:
            version = self.model.windows._version  # a policy may also write the buffer itself
            table = self.policy.on_train_step(self.global_step, self.model, batch)
            if table is not None:
                self.model.set_windows(table)
            if self.rewind.due(self.global_step):  # the calibration's table is set: back to step 0's weights
                schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
                self.rewind.apply(self.model, self.trainer.optimizers, schedulers)
            changed = self.model.windows._version != version
            self.table_sync.update(self.model.windows, self.global_step, changed)
            self.window_usage.step(self.model.windows, changed)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        if self.spans is not None:  # frozen spans stay in the graph at zero weight (DDP wants every gradient)
            loss = self.policy.tie_to_loss(loss)
        self.log("train/loss", self._step_loss(loss.detach()), prog_bar=True)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])  # a Python float: no sync
        return loss

    def _step_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean loss of this optimizer step's micro-batches so far (the logger keeps the value of the step's last
        one: the step's mean). At logging steps it is also averaged over ranks; other steps do not sync."""
        if self._step_losses[0] != self.global_step:
            self._step_losses = (self.global_step, [])
        self._step_losses[1].append(loss)
        mean = torch.stack(self._step_losses[1]).mean()
        every = self.trainer.log_every_n_steps
        if self.trainer.world_size > 1 and every and (self.global_step + 1) % every == 0:  # the steps Lightning logs
            mean = self.trainer.strategy.reduce(mean, reduce_op="mean")
        return mean

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, self.val_position_loss, self.val_bpb, self.val_recall)

    def _evaluate(self, batch, mean: MeanMetric, positions: PositionLoss, bpb: BitsPerByte, recall) -> None:
        losses = self._token_losses(batch, recall)
        mask = batch.get("loss_mask")
        loss = _masked_mean(losses, mask)
        mean.update(loss, weight=batch["tokens"].shape[0] if mask is None else mask.sum())
        positions.update(losses, mask)
        if "bytes" in batch:
            bpb.update(loss, losses.numel(), batch["bytes"])

    def _log_recall(self, prefix: str, recall: RecallAccuracy) -> None:
        if recall.count.sum() > 0:
            scores = recall.compute()
            self.log(f"{prefix}/recall_acc", scores.pop("all"))
            self.log_dict({f"{prefix}/recall_acc_by_distance/{k}": v for k, v in scores.items()})
        recall.reset()

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss))
        self.val_loss.reset()
        self.log_dict({f"val/loss_by_position/{k}": v for k, v in self.val_position_loss.compute().items()})
        self.val_position_loss.reset()
        if self.val_bpb.update_count:
            self.log("val/bpb", self.val_bpb.compute().float())
            self.val_bpb.reset()
        self._log_recall("val", self.val_recall)

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, self.test_position_loss, self.test_bpb, self.test_recall)

    def on_test_epoch_end(self) -> None:
        loss = self.test_loss.compute()
        self.log("test/loss", loss)
        self.log("test/ppl", torch.exp(loss))
        self.test_loss.reset()
        self.log_dict({f"test/loss_by_position/{k}": v for k, v in self.test_position_loss.compute().items()})
        self.test_position_loss.reset()
        if self.test_bpb.update_count:
            self.log("test/bpb", self.test_bpb.compute().float())
            self.test_bpb.reset()
        self._log_recall("test", self.test_recall)

    def predict_step(self, batch: dict, batch_idx: int) -> list:
        """Continue every prompt of the batch (data/prompts.py) with the per-head window KV cache."""
        return generate(self.model, batch["tokens"], self.generation, batch["eod_id"], batch["index"])

    # -- optimisation ------------------------------------------------------------------------------------------------
    def parameter_groups(self) -> list[dict]:
        """Weight decay on matrices of linear layers only: not on norms, biases or (tied) embeddings."""
        decay, no_decay = {}, {}
        for module in self.model.modules():
            for name, p in module.named_parameters(recurse=False):
                target = (
                    decay
                    if isinstance(module, nn.Linear) and name == "weight" and p is not self.model.wte.weight
                    else no_decay
                )
                target[id(p)] = p
        for key in decay.keys() & no_decay.keys():
            decay.pop(key)
        groups = [
            {"params": list(decay.values()), "weight_decay": self.optim_config.weight_decay},
            {"params": list(no_decay.values()), "weight_decay": 0.0},
        ]
        if self.spans is not None:  # learned spans: their own learning rate, no decay pulling them to zero
            groups.append({"params": list(self.spans.parameters()), "weight_decay": 0.0, "lr": self.policy.lr})
        return groups

    def configure_optimizers(self):
        cfg = self.optim_config
        opt = torch.optim.AdamW(self.parameter_groups(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
        total = 1
        if self.trainer is not None:
            # The data module's count, when it knows one: Lightning's estimate builds the train loader of an
            # epoch-based run now, before a resumed run's loop state (the data position) is restored.
            planned = getattr(self.trainer.datamodule, "planned_steps", lambda: None)()
            total = int(planned if planned is not None else self.trainer.estimated_stepping_batches)

        def factor(step: int) -> float:  # after a rewind the schedule starts again from the rewind's step
            origin = self.rewind.lr_origin(step)
            return lr_factor(step - origin, cfg.warmup_steps, total - origin, cfg.min_lr_ratio)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- checkpoint extras -------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        # The CLI checks this before the Trainer starts; repeated here for code that drives a Trainer directly.
        check_run(self, self.trainer.datamodule, self.trainer.strategy.root_device, stage)
        if stage == "fit":
            self.rewind.check(self.trainer.strategy)
            if self.spans is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
                raise ConfigError(
                    "model.aah.policy=learned_span is not supported under FSDP2 (ModelParallelStrategy): its spans "
                    "are a parameter beside the sharded model; use DDP or one device"
                )

    def on_fit_start(self) -> None:
        ddp = self.trainer.strategy.model  # the DistributedDataParallel wrapper under DDP
        if isinstance(ddp, DistributedDataParallel) and ddp.broadcast_buffers and self.trainer.world_size > 1:
            rank_zero_warn(
                "DDP broadcasts buffers before every forward, which rewrites the window table each step and makes the "
                "attention planner read it back to the host every step. Use DDPStrategy(broadcast_buffers=False) "
                "(configs/cluster/ddp.yaml); aah checks that the tables agree across ranks."
            )

    def on_train_start(self) -> None:
        if hasattr(self.policy, "set_run_length"):  # a budget that is a mean over the run needs the run's length
            self.policy.set_run_length(int(self.trainer.estimated_stepping_batches))
        self.rewind.start(self.model, self.global_step)
        # Restored here, after Lightning has built the train loader (which draws from the global RNG), so the
        # generators continue from exactly where the interrupted run saved them.
        if self._rng_to_restore is not None:
            distributed.set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[POLICY_KEY] = self.policy.state_dict()
        if attached_trainer(self) is not None and self.trainer.state.fn == "fit":
            self.table_sync.verify(self.model.windows, self.global_step)  # never save a table only one rank has
        checkpoint[RNG_KEY] = distributed.gather(distributed.rng_state())  # every rank's, in rank order
        checkpoint[WINDOW_USAGE_KEY] = self.window_usage.state_dict()
        self.rewind.save(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # A checkpoint of another shape: one line naming the setting, before load_state_dict's wall of text.
        trainer = attached_trainer(self)
        path = str(getattr(trainer, "ckpt_path", None) or "checkpoint")
        if self.checked_checkpoint is None or self.checked_checkpoint != os.path.realpath(path):
            check_matches(checkpoint, self, path)  # not checked before (code driving a Trainer directly)
        if self.gpt_config.full_heads_beyond_trained == "whole_context":
            widen_full_windows(checkpoint, self.gpt_config.seq_len)  # evaluated at a longer T: full heads stay full
        self.policy.load_state_dict(checkpoint.get(POLICY_KEY, {}))
        self.window_usage.load_state_dict(checkpoint.get(WINDOW_USAGE_KEY))
        self.rewind.load(checkpoint)
        states = checkpoint.get(RNG_KEY)
        if states is not None:
            # Rank r continues saved rank r's generators; a rank the saved run did not have (a resume on more
            # processes) starts from a state derived from the seed, its rank and the step. Saved states of ranks
            # this run does not have are dropped.
            rank = self.trainer.global_rank if attached_trainer(self) is not None else 0
            step = int(checkpoint.get(GLOBAL_STEP_KEY, 0))
            self._rng_to_restore = states[rank] if rank < len(states) else distributed.derived_rng_state(rank, step)
