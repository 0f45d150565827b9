"""The simple window policies: full, fixed, static and random (the contract: ``policy_base.py``).

They depend only on their settings, the step and their own seeded generator, whose state is checkpointed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aah_lightning.errors import ConfigError, require
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.policy_base import WindowPolicy, register


def check_table(table, policy: str, seq_len: int, n_layer: int, n_head: int) -> None:
    """``model.aah.<policy>.table``: n_layer rows of n_head windows, each in [1, T]."""
    shape_ok = (
        isinstance(table, list)
        and len(table) == n_layer
        and all(isinstance(row, list) and len(row) == n_head for row in table)
    )
    if not shape_ok:
        got = None if table is None else [len(r) if isinstance(r, list) else r for r in table]
        raise ConfigError(
            f"model.aah.{policy}.table has row lengths {got}: the {policy} policy needs n_layer={n_layer} rows of "
            f"n_head={n_head} windows each"
        )
    for row in table:
        for w in row:
            require(
                isinstance(w, int) and 0 < w <= seq_len,
                f"model.aah.{policy}.table",
                w,
                f"every window an integer in [1, seq_len={seq_len}]",
            )


@register("full")
class FullPolicy(WindowPolicy):
    """Every head sees the whole causal context (the baseline)."""

    READS = frozenset()


@register("fixed")
class FixedPolicy(WindowPolicy):
    """Every head of every layer uses ``fixed.window`` (after ``fixed.warmup_steps`` at full context)."""

    READS = frozenset({"fixed"})

    @classmethod
    def validate(cls, cfg: AAHConfig, seq_len: int, n_layer: int, n_head: int) -> None:
        require(
            isinstance(cfg.fixed.window, int) and 0 < cfg.fixed.window <= seq_len,
            "model.aah.fixed.window",
            cfg.fixed.window,
            f"an integer in [1, seq_len={seq_len}] (the fixed policy's window)",
        )
        require(
            isinstance(cfg.fixed.warmup_steps, int) and cfg.fixed.warmup_steps >= 0,
            "model.aah.fixed.warmup_steps",
            cfg.fixed.warmup_steps,
            "an integer >= 0 (steps at full context before the fixed window)",
        )

    def initial_table(self) -> Tensor:
        if self.cfg.fixed.warmup_steps > 0:
            return super().initial_table()
        return torch.full((self.n_layer, self.n_head), self.cfg.fixed.window, dtype=torch.int32)

    def on_train_step(self, step, model, batch):
        # Once, when the warmup ends (a run resumed later has the fixed table in its checkpoint's window buffer).
        if self.cfg.fixed.warmup_steps > 0 and step == self.cfg.fixed.warmup_steps:
            return torch.full((self.n_layer, self.n_head), self.cfg.fixed.window, dtype=torch.int32)
        return None


@register("static")
class StaticPolicy(WindowPolicy):
    """An explicit table from the config."""

    READS = frozenset({"static"})

    @classmethod
    def validate(cls, cfg: AAHConfig, seq_len: int, n_layer: int, n_head: int) -> None:
        check_table(cfg.static.table, "static", seq_len, n_layer, n_head)

    def initial_table(self) -> Tensor:
        return torch.tensor(self.cfg.static.table, dtype=torch.int32)


@register("random")
class RandomPolicy(WindowPolicy):
    """Each head draws uniformly from the candidates with a seeded generator, once or every
    ``random.redraw_interval``. With a ``random.table``, every draw places exactly the table's windows at random over all heads instead (a fixed window
    histogram, so every draw costs the same compute)."""

    READS = frozenset({"candidates", "random"})

    @classmethod
    def reads(cls, cfg: AAHConfig) -> frozenset[str]:
        return frozenset({"random"}) if cfg.random.table is not None else cls.READS  # a table's windows, not candidates

    @classmethod
    def validate(cls, cfg: AAHConfig, seq_len: int, n_layer: int, n_head: int) -> None:
        r = cfg.random
        require(
            isinstance(r.redraw_interval, int) and r.redraw_interval >= 0,
            "model.aah.random.redraw_interval",
            r.redraw_interval,
            "0 (draw once) or more",
        )
        if r.table is not None:
            check_table(r.table, "random", seq_len, n_layer, n_head)
        if r.long_layer is not None:
            require(
                r.table is not None and isinstance(r.long_layer, int) and 0 <= r.long_layer < n_layer,
                "model.aah.random.long_layer",
                r.long_layer,
                f"None or a layer index in [0, n_layer={n_layer}) with a table (whose widest window it places)",
            )

    def __init__(self, cfg, n_layer, n_head, seq_len):
        super().__init__(cfg, n_layer, n_head, seq_len)
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def _draw(self) -> Tensor:
        r = self.cfg.random
        if r.table is not None:
            windows = torch.tensor(r.table, dtype=torch.int32).flatten()
            order = torch.randperm(windows.numel(), generator=self.generator)
            table = windows[order].view(self.n_layer, self.n_head)
            if r.long_layer is not None:  # the widest window to a random head of long_layer, by a swap
                head = int(torch.randint(self.n_head, (1,), generator=self.generator))
                at = int(torch.argmax(table.flatten()))
                flat = table.flatten()
                flat[at], flat[r.long_layer * self.n_head + head] = (
                    flat[r.long_layer * self.n_head + head].clone(),
                    flat[at].clone(),
                )
                table = flat.view(self.n_layer, self.n_head)
            return table
        choice = torch.randint(len(self.candidates), (self.n_layer, self.n_head), generator=self.generator)
        return torch.tensor(self.candidates, dtype=torch.int32)[choice]

    def initial_table(self) -> Tensor:
        return self._draw()

    def on_train_step(self, step, model, batch):
        k = self.cfg.random.redraw_interval
        if k > 0 and step > 0 and step % k == 0:
            return self._draw()
        return None

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])
