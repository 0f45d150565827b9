"""The simple window policies: full, fixed, static and random (the contract: ``policy_base.py``).

They depend only on their settings, the step and their own seeded generator, whose state is checkpointed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aah_lightning.aah.config import AAHConfig
from aah_lightning.aah.policy_base import WindowPolicy, register
from aah_lightning.errors import ConfigError, require


@register("full")
class FullPolicy(WindowPolicy):
    """Every head sees the whole causal context (the baseline)."""


@register("fixed")
class FixedPolicy(WindowPolicy):
    """Every head of every layer uses ``window``."""

    @classmethod
    def validate(cls, cfg: AAHConfig, seq_len: int, n_layer: int, n_head: int) -> None:
        require(
            isinstance(cfg.window, int) and 0 < cfg.window <= seq_len,
            "model.aah.window",
            cfg.window,
            f"an integer in [1, seq_len={seq_len}] (the fixed policy's window)",
        )

    def initial_table(self) -> Tensor:
        return torch.full((self.n_layer, self.n_head), self.cfg.window, dtype=torch.int32)


@register("static")
class StaticPolicy(WindowPolicy):
    """An explicit table from the config."""

    @classmethod
    def validate(cls, cfg: AAHConfig, seq_len: int, n_layer: int, n_head: int) -> None:
        table = cfg.table
        shape_ok = (
            isinstance(table, list)
            and len(table) == n_layer
            and all(isinstance(row, list) and len(row) == n_head for row in table)
        )
        if not shape_ok:
            got = None if table is None else [len(r) if isinstance(r, list) else r for r in table]
            raise ConfigError(
                f"model.aah.table has row lengths {got}: the static policy needs n_layer={n_layer} rows of "
                f"n_head={n_head} windows each"
            )
        for row in table:
            for w in row:
                require(
                    isinstance(w, int) and 0 < w <= seq_len,
                    "model.aah.table",
                    w,
                    f"every window an integer in [1, seq_len={seq_len}]",
                )

    def initial_table(self) -> Tensor:
        return torch.tensor(self.cfg.table, dtype=torch.int32)


@register("random")
class RandomPolicy(WindowPolicy):
    """Each head draws uniformly from the candidates with a seeded generator, once or every ``redraw_interval``."""

    def __init__(self, cfg, n_layer, n_head, seq_len):
        super().__init__(cfg, n_layer, n_head, seq_len)
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def _draw(self) -> Tensor:
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
