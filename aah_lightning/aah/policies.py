"""Window policies: who writes the window table, and when.

A policy is one class registered in ``POLICIES``. The LightningModule asks it for the initial table and, before
every training step, whether the table changes (``on_train_step`` returns a new ``[n_layer, n_head]`` table or None).
Decisions must be identical on every rank: the policies here depend only on their settings, the step and their own
seeded generator, whose state is checkpointed through ``state_dict``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aah_lightning.aah.config import AAHConfig


class WindowPolicy:
    name = "base"

    def __init__(self, cfg: AAHConfig, n_layer: int, n_head: int, seq_len: int):
        self.cfg = cfg
        self.n_layer, self.n_head, self.seq_len = n_layer, n_head, seq_len
        self.candidates = cfg.resolved_candidates(seq_len)

    def initial_table(self) -> Tensor:
        return torch.full((self.n_layer, self.n_head), self.seq_len, dtype=torch.int32)

    def on_train_step(self, step: int, model, batch) -> Tensor | None:
        """Called before training step ``step`` (0-based optimizer steps). Return a new table to apply, or None."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class FullPolicy(WindowPolicy):
    """Every head sees the whole causal context (the baseline)."""

    name = "full"


class FixedPolicy(WindowPolicy):
    """Every head of every layer uses ``window``."""

    name = "fixed"

    def initial_table(self) -> Tensor:
        return torch.full((self.n_layer, self.n_head), self.cfg.window, dtype=torch.int32)


class StaticPolicy(WindowPolicy):
    """An explicit table from the config."""

    name = "static"

    def initial_table(self) -> Tensor:
        return torch.tensor(self.cfg.table, dtype=torch.int32)


class RandomPolicy(WindowPolicy):
    """Each head draws uniformly from the candidates with a seeded generator, once or every ``redraw_interval``.
    With a ``table``, every draw places exactly the table's windows at random over all heads instead (a fixed window
    histogram, so every draw costs the same compute)."""

    name = "random"

    def __init__(self, cfg, n_layer, n_head, seq_len):
        super().__init__(cfg, n_layer, n_head, seq_len)
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def _draw(self) -> Tensor:
        if self.cfg.table is not None:
            windows = torch.tensor(self.cfg.table, dtype=torch.int32).flatten()
            order = torch.randperm(windows.numel(), generator=self.generator)
            return windows[order].view(self.n_layer, self.n_head)
        choice = torch.randint(len(self.candidates), (self.n_layer, self.n_head), generator=self.generator)
        return torch.tensor(self.candidates, dtype=torch.int32)[choice]

    def initial_table(self) -> Tensor:
        return self._draw()

    def on_train_step(self, step, model, batch):
        k = self.cfg.redraw_interval
        if k > 0 and step > 0 and step % k == 0:
            return self._draw()
        return None

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])


POLICIES: dict[str, type[WindowPolicy]] = {p.name: p for p in (FullPolicy, FixedPolicy, StaticPolicy, RandomPolicy)}


def make_policy(cfg: AAHConfig, n_layer: int, n_head: int, seq_len: int) -> WindowPolicy:
    cfg.validate(seq_len, n_layer, n_head)
    return POLICIES[cfg.policy](cfg, n_layer, n_head, seq_len)

# The AAH controller lives in its own package (aah/controller/); it subclasses WindowPolicy, so it registers last.
from aah_lightning.aah.controller.adaptive import AdaptivePolicy  # noqa: E402

POLICIES[AdaptivePolicy.name] = AdaptivePolicy

# Shuffle-post-select wraps the controller, so it comes after it; the module registers itself in POLICIES (a plain
# import, so that importing aah.shuffle first works too).
import aah_lightning.aah.shuffle  # noqa: E402,F401
