"""The budget of each decision (``model.aah.controller.budget``): its measure, the cost of a table, the units that
share it, and the ceiling.

``target_acr`` / ``target_causal_coverage`` set a per-head target; ``scope`` says whether each layer or the whole
model shares it (the units of ``units``). The ceiling of a decision is the target itself or, with ``over_run: true``
(``RunSpend``), what the remaining steps may still spend on average so that the run's mean,
the full-context warmup included, lands on the target. ``budget.py`` then chooses the windows within the ceiling.
"""

from __future__ import annotations

from torch import Tensor

from aah_lightning.errors import ConfigError
from aah_lightning.windows import metrics
from aah_lightning.windows.config import BudgetConfig


class RunSpend:
    """Compute a run has paid so far (per-head mean cost times steps), for budgets that are a mean over the run.

    ``held`` is the cost of the table in force since step ``until``; the policy records every decision."""

    def __init__(self, initial_cost: float):
        self.paid, self.until, self.held = 0.0, 0, float(initial_cost)

    def paid_before(self, step: int) -> float:
        return self.paid + self.held * (step - self.until)

    def ceiling(self, target: float, step: int, total_steps: int | None, floor: float) -> float:
        """The mean cost the steps from ``step`` to ``total_steps`` may spend so that the run's mean is ``target``
        (between ``floor``, the cheapest table, and 1). Without a known run length: ``target`` itself."""
        if total_steps is None or total_steps <= step:
            return target
        left = (target * total_steps - self.paid_before(step)) / (total_steps - step)
        return min(1.0, max(floor, left))

    def record(self, step: int, cost: float) -> None:
        """From ``step`` on, the table in force costs ``cost``."""
        self.paid, self.until, self.held = self.paid_before(step), step, float(cost)

    def state_dict(self) -> dict:
        return {"paid": self.paid, "until": self.until, "held": self.held}

    def load_state_dict(self, state: dict) -> None:
        self.paid, self.until, self.held = float(state["paid"]), int(state["until"]), float(state["held"])


class Budget:
    """The controller's compute budget (``settings``: ``BudgetConfig``, a measure and a per-head target; None: no
    budget, and tables are costed by ACR). ``spend`` counts what the run paid, from the cost of the first table.
    ``sink``: the model's attention sink, whose pairs every cost includes (the budget pays for them)."""

    def __init__(self, settings: BudgetConfig, candidates: list[int], seq_len: int, n_layer: int, sink: int = 0):
        self.settings, self.seq_len, self.n_layer, self.sink = settings, seq_len, n_layer, sink
        self.target = settings.target()  # (measure, per-head target) or None
        self.costs: Tensor | None = (
            None if self.target is None else metrics.window_costs(candidates, seq_len, self.target[0], sink)
        )
        self.candidates = candidates
        self.run_steps: int | None = None  # the run's length in optimizer steps, once training starts
        self.spend = RunSpend(0.0)

    def start(self, initial_table: Tensor) -> None:
        """The run starts with ``initial_table`` in force."""
        self.spend = RunSpend(self.table_cost(initial_table))

    @property
    def measure(self) -> str | None:
        return None if self.target is None else self.target[0]

    def table_cost(self, table: Tensor) -> float:
        """Mean per-head cost of ``table`` in the budget's measure (ACR without a budget)."""
        if self.measure == "causal_coverage":
            return float(metrics.causal_coverage(table, self.seq_len, self.sink))
        return float(metrics.acr(table, self.seq_len, self.sink))

    def units(self) -> list[list[int]]:
        """The layers that share one budget: all of them with ``scope: model``, else each layer alone."""
        if self.settings.scope == "model":
            return [list(range(self.n_layer))]
        return [[layer] for layer in range(self.n_layer)]

    def ceiling(self, step: int) -> float | None:
        """The per-head budget of the decision at ``step``: the target, or with ``over_run`` what the rest of
        the run may spend on average so that the run's mean meets the target. None without a budget."""
        if self.target is None:
            return None
        if not self.settings.over_run:
            return self.target[1]
        return self.spend.ceiling(self.target[1], step, self.run_steps, float(self.costs[0]))

    def check_run(self, warmup_steps: int, explorers: tuple[int, float] | None) -> None:
        """With ``over_run``, a target this run of ``run_steps`` cannot meet is one error line, before any step.
        ``explorers``: reach first's ``(formation_steps, cost of the explorers' table)``, else None."""
        if self.target is None or not self.settings.over_run or self.run_steps is None:
            return
        measure, target = self.target
        w = min(warmup_steps, self.run_steps)
        paid = self.spend.paid_before(w)
        if explorers is not None:  # the explorers hold their reach until formation ends, whatever the budget
            formation_steps, explorer_cost = explorers
            w = min(max(w, formation_steps), self.run_steps)
            paid = w * explorer_cost
        least = (paid + (self.run_steps - w) * float(self.costs[0])) / self.run_steps
        if least > target + 1e-9:
            name = "target_acr" if measure == "acr" else "target_causal_coverage"
            start = (
                f"{w} steps of explorers (formation_steps) beside the smallest candidate"
                if explorers is not None
                else f"{w} warmup steps at full context"
            )
            raise ConfigError(
                f"model.aah.controller.budget.{name}={target!r} cannot be the mean over this run: {start} and the smallest "
                f"candidate ({self.candidates[0]}) afterwards already average {least:.4f} over {self.run_steps} steps; "
                f"lower schedule.warmup_steps or reach.formation_steps, add a smaller candidate or raise the target"
            )
