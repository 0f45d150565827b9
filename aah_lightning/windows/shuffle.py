"""The ``shuffle`` policy (shuffle-post-select, a control of the paper's lab): the AAH controller's table with each
layer's windows permuted among that layer's heads.

The controller (an ``AdaptivePolicy`` with the same ``model.aah.controller`` settings) decides as usual; its table is
then permuted within every layer by a seeded random permutation. Each layer keeps the controller's window histogram
(and so its ACR and causal coverage) but a head's window no longer depends on what that head does. This tests
whether AAH's gain comes from *which* head gets which window or only from how many short windows a layer has.

When: a new permutation at every decision of the controller (even one that leaves its table unchanged), and, when
``model.aah.shuffle.redraw_interval`` is k > 0, also every k steps after the first decision. The authors' lab re-permuted at
every step (k = 1); the rows here re-permute at decisions only, so a head keeps its shuffled window for a control
interval (and the attention masks are rebuilt only then).

Seeded with ``model.aah.seed`` (offset 3; the controller uses the seed itself, + 1 and + 2); the wrapped controller's
state, the generator and the table in use are all in ``state_dict``, so a resumed run permutes identically.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aah_lightning.errors import require
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.controller.adaptive import AdaptivePolicy
from aah_lightning.windows.policy_base import PolicyReport, WindowPolicy, register

SEED_OFFSET = 3


@register("shuffle")
class ShufflePolicy(WindowPolicy):
    """The adaptive controller's choice, with windows permuted among the heads of each layer."""

    READS = frozenset({"candidates", "controller", "shuffle"})

    @classmethod
    def validate(cls, cfg: AAHConfig, seq_len: int, n_layer: int, n_head: int) -> None:
        AdaptivePolicy.validate(cfg, seq_len, n_layer, n_head)  # the wrapped controller's settings
        k = cfg.shuffle.redraw_interval
        require(isinstance(k, int) and k >= 0, "model.aah.shuffle.redraw_interval", k, "0 (at decisions only) or more")

    def __init__(self, cfg: AAHConfig, n_layer: int, n_head: int, seq_len: int):
        super().__init__(cfg, n_layer, n_head, seq_len)
        self.inner = AdaptivePolicy(cfg, n_layer, n_head, seq_len)
        self.generator = torch.Generator().manual_seed(cfg.seed + SEED_OFFSET)
        self.table: Tensor | None = None  # the permuted table in use (None before the first decision)
        self.shuffles = 0

    def permute(self, table: Tensor) -> Tensor:
        """``table`` with each layer's row permuted by a fresh permutation."""
        out = torch.empty_like(table)
        for layer in range(table.shape[0]):
            out[layer] = table[layer, torch.randperm(table.shape[1], generator=self.generator)]
        return out

    def on_train_step(self, step: int, model, batch) -> Tensor | None:
        self.inner.on_train_step(step, model, batch)
        if self.inner.table is None:  # warmup: full windows, nothing to permute
            return None
        k = self.cfg.shuffle.redraw_interval
        decided = self.inner.last_step == step
        if not decided and not (k > 0 and step % k == 0):
            return None
        previous = self.table
        self.table = self.permute(self.inner.table)
        self.shuffles += 1
        return None if previous is not None and torch.equal(previous, self.table) else self.table.clone()

    def report(self) -> PolicyReport:
        """The controller's groups and their chosen windows (the heads' windows then show the shuffle)."""
        return self.inner.report()

    def rewind_step(self) -> int | None:
        return self.inner.rewind_step()  # a calibrated table permuted, then the rewind: the chance control of a rewind

    def set_run_length(self, total_steps: int) -> None:
        self.inner.set_run_length(total_steps)  # the controller's budget over the run (permuting keeps its cost)

    @classmethod
    def report_from_state(cls, state: dict, candidates: list[int]) -> PolicyReport:
        return AdaptivePolicy.report_from_state(state.get("inner") or {}, candidates)

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "inner": self.inner.state_dict(),
            "generator": self.generator.get_state(),
            "table": None if self.table is None else self.table.clone(),
            "shuffles": self.shuffles,
        }

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.inner.load_state_dict(state["inner"])
        self.generator.set_state(state["generator"])
        self.table = None if state["table"] is None else state["table"].to(torch.int32).clone()
        self.shuffles = int(state["shuffles"])
