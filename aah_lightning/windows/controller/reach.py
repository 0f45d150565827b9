"""Reach for the heads that may need context (``model.aah.controller.reach``): explorers while the model forms
(reach first), and heads that keep reach after it (kept reach). docs/controller.md, "Finding the heads that need
context from step 0".

* ``ReachFirst`` (``explorers``, ``explore_window``, ``formation_steps``, ``formation_fill``): heads
  ``0 .. explorers - 1`` of every layer hold the explorers' window from step 0 until ``formation_steps``, whatever the
  signal says, so that a head that needs context can learn to use it before need is measured.
* ``kept_reach`` (``heads``, ``window``): at every decision after formation, the heads of each budget
  unit with the largest smoothed need at the reach window hold it; the knapsack places the rest of the budget
  around them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aah_lightning.errors import ConfigError
from aah_lightning.windows.config import ReachConfig


class ReachFirst:
    """The explorers' tables (``settings``: ``ReachConfig``). ``table_cost`` is the budget's mean per-head cost of a
    table."""

    def __init__(self, settings, candidates: list[int], n_layer: int, n_head: int, table_cost):
        self.settings, self.candidates = settings, candidates
        self.n_layer, self.n_head, self.table_cost = n_layer, n_head, table_cost
        self.explore_index = candidates.index(settings.explore_window or candidates[-1])

    @property
    def on(self) -> bool:
        return self.settings.explorers > 0

    def forming(self, step: int) -> bool:
        """Whether the explorers still hold their reach at ``step``."""
        return self.on and step < self.settings.formation_steps

    def table(self, fill: int | None = None) -> Tensor:
        """Heads ``0 .. explorers - 1`` of every layer at the explorers' window, every other head at ``fill``
        (default the narrowest candidate)."""
        table = torch.full((self.n_layer, self.n_head), fill or self.candidates[0], dtype=torch.int32)
        table[:, : self.settings.explorers] = self.candidates[self.explore_index]
        return table

    def even_fill(self, ceiling: float) -> int:
        """The widest candidate every non-explorer can hold beside the explorers within ``ceiling`` (the narrowest
        when none fits): ``formation_fill: even``, one window for all the other heads while the explorers form."""
        fits = [c for c in self.candidates if self.table_cost(self.table(c)) <= ceiling + 1e-9]
        return fits[-1] if fits else self.candidates[0]

    def floors(self, forming: bool, layer: int, kept: dict[tuple[int, int], int]) -> list[int]:
        """Per head of ``layer``, the narrowest candidate index it may take: the explorers' window while forming,
        a kept head's reach window after, else 0."""
        if forming:
            return [self.explore_index if h < self.settings.explorers else 0 for h in range(self.n_head)]
        return [kept.get((layer, h), 0) for h in range(self.n_head)]

    def apart(self, forming: bool, layer: int, kept: dict[tuple[int, int], int]) -> list[int]:
        """The heads of ``layer`` that get groups of their own, so that their floors drag no other head."""
        if forming:
            return list(range(self.settings.explorers))
        return sorted(h for (lyr, h) in kept if lyr == layer)


def reach_index(costs: Tensor, ceiling: float, n: int, r: int) -> int:
    """The widest candidate index that ``r`` of ``n`` heads can hold beside ``n - r`` heads at the narrowest, with a
    mean per-head cost within ``ceiling`` (0 when none is wider than the narrowest)."""
    fits = [j for j in range(len(costs)) if r * float(costs[j]) + (n - r) * float(costs[0]) <= ceiling * n + 1e-9]
    return fits[-1] if fits else 0


def kept_reach(
    need: Tensor, ceiling: float, units: list[list[int]], costs: Tensor, candidates: list[int], settings
) -> dict[tuple[int, int], int]:
    """``{(layer, head): candidate index}`` of the heads that hold the reach window at this decision. In each budget
    unit (``units``: lists of layers), the ``settings.heads`` heads with the largest smoothed ``need`` ``[L, H, K]`` at
    the window (exact ties to the earlier layer and head); the window is ``settings.window`` or the widest they can hold
    beside every other head of the unit at the narrowest candidate, never wider than that."""
    n_head = need.shape[1]
    out = {}
    for layers in units:
        j = reach_index(costs, ceiling, len(layers) * n_head, settings.heads)
        if settings.window is not None:
            j = min(j, candidates.index(settings.window))
        if j == 0:
            continue  # this ceiling affords no reach (budget_over_run late in a run): nothing is held
        heads = sorted((-float(need[lyr, h, j]), lyr, h) for lyr in layers for h in range(n_head))
        out.update({(lyr, h): j for _, lyr, h in heads[: settings.heads]})
    return out


def check_kept_reach_fits(settings: ReachConfig, target: float, candidates: list[int], costs: Tensor, n: int) -> None:
    """Kept reach must fit the budget's ``target`` beside ``n - heads`` heads at the narrowest (``n``: the heads of
    one budget unit); one error line otherwise."""
    key = "model.aah.controller.reach."
    fits = reach_index(costs, target, n, settings.heads)
    if settings.window is not None and candidates.index(settings.window) > fits:
        raise ConfigError(
            f"{key}window={settings.window!r} does not fit the budget: {settings.heads} head(s) at it beside "
            f"{n - settings.heads} at {candidates[0]} cost more than {target!r}; the widest that fits is "
            f"{candidates[fits]}"
        )
    if fits == 0:
        raise ConfigError(
            f"{key}heads={settings.heads!r}: the budget {target!r} leaves them no window wider than the narrowest "
            f"candidate ({candidates[0]}); lower reach.heads or raise the budget"
        )
