"""The ``learned_span`` window policy: one learned soft span per head, under a budget, then hard windows.

Contract (``model.aah.span``):

* **What learns.** One span per head, ``z = T s`` with ``s`` in ``[0, 1 - R/T]`` a parameter of the run (``Spans``,
  registered by the LightningModule beside the model, optimised with it in a group of its own: ``span.lr``, no
  weight decay). Until
  ``span.freeze_at`` every forward runs each head's ramped attention (``model/attention/soft_span.py``): full
  weight up to ``z``, falling linearly to 0 over the next ``R = span.width`` tokens.
* **The budget.** Before every step the spans are projected onto the budget: if the heads' mean
  ``min(T, z + R) / T`` exceeds ``span.target_acr``, every span is lowered by the one amount that brings it back
  (clamped at 0), so a span grows only as others give up theirs. The table in force is the hard windows
  ``min(T, ceil(z + R))``, the keys a block-sparse kernel has to visit, and what the run's ACR ledger counts
  (rounding up adds at most one key per head while the spans learn: the ramp's last key carries its pull to grow).
  The frozen table gives back what rounding adds past the budget in keys: the heads whose last key the ramp weighs
  least lose it (``hard_windows``), so from ``freeze_at`` on the table never costs more than ``span.target_acr``.
* **Hard windows.** At ``freeze_at`` the spans stop learning and the last hard windows hold, without the ramp, for
  the rest of the run: the spans become an ordinary window table, exported and served like any other.
* **Full heads.** With ``span.full_heads = k`` the freeze first gives the ``k`` widest spans (ties: the first in
  layer-major order) the whole context, then lowers every other span by one common amount until the budget holds
  again. The ramp tells which head wins the distance; it does not by itself carry that head to the whole context,
  since the budget holds it back once any other head has span to give up.
* **How a span gets gradient before a circuit exists.** Only through its ramp: the loss changes with ``z`` where the
  head puts weight on keys between ``z`` and ``z + R``. A head that gains from the furthest keys it can see (on the
  recall task: short recalls, answered within its span, whose circuit then reaches for the next distances) pushes
  its span out; a head that does not loses span to the budget's projection. Nothing pulls a span out to distances
  no head attends to yet, which is why the spans start even (``target_acr T - R`` each: every head the same reach).

All spans' gradients are averaged over ranks with the model's (DDP), and the projection is deterministic, so every
rank holds the same spans and table. The spans and their optimizer state travel in checkpoints with the model's.
"""

from __future__ import annotations

from fractions import Fraction

import torch
from torch import Tensor, nn

from aah_lightning.errors import require
from aah_lightning.model.attention.soft_span import SoftSpanPlan, span_ramp
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.policy_base import PolicyReport, WindowPolicy, register


class Spans(nn.Module):
    """The learned spans: ``fraction`` ``[L, H]``, each head's span as a fraction of the sequence length."""

    def __init__(self, n_layer: int, n_head: int, initial: float):
        super().__init__()
        self.fraction = nn.Parameter(torch.full((n_layer, n_head), float(initial)))


def project_to_budget(z: Tensor, width: int, seq_len: int, target_acr: float, held: Tensor | None = None) -> Tensor:
    """Spans ``z`` (tokens) lowered by one common amount ``c >= 0`` (each clamped to ``[0, T - R]``) so that the mean
    of ``min(T, z + R) / T`` is at most ``target_acr``: ``z`` itself when it already is. Spans where the boolean
    mask ``held`` is set are not lowered (they still count in the mean)."""
    top = float(seq_len - width)
    z = z.clamp(0.0, top)
    movable = torch.ones_like(z) if held is None else (~held).to(z.dtype)

    def lowered(shift: float) -> Tensor:
        return (z - shift * movable).clamp(0.0, top)

    def cost(shift: float) -> float:
        return float((lowered(shift) + width).clamp(max=seq_len).mean()) / seq_len

    if cost(0.0) <= target_acr:
        return z
    lo, hi = 0.0, top  # cost(top) <= target: every movable head at its ramp alone (checked in validate)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if cost(mid) <= target_acr else (mid, hi)
    return lowered(hi)


def hard_windows(z: Tensor, width: int, seq_len: int, budget_keys: int | None = None) -> Tensor:
    """The hard windows of spans ``z`` (tokens, float): ``min(T, ceil(z + R))`` per head, the keys the ramp reaches,
    with the keys that rounding up adds past ``budget_keys`` taken back (None: none). The spans keep
    ``sum(z + R) <= budget`` (the projection), but each ``ceil`` may add up to one key; while the windows hold more
    than ``budget_keys`` keys, the
    head whose last key the ramp weighs least (the largest ``ceil(z + R) - (z + R)``; ties: the first in layer-major
    order) loses that key. A head loses at most one key and never goes below ``floor(z + R)``, so the table costs at
    most the budget whenever the spans do."""
    reach = z + width
    windows = reach.ceil().clamp(1, seq_len)
    excess = 0 if budget_keys is None else int(windows.sum().item()) - budget_keys
    if excess > 0:
        over = (windows - reach).flatten()
        order = torch.argsort(over, descending=True, stable=True)
        drop = order[: min(excess, int((over > 0).sum()))]
        flat = windows.flatten().clone()
        flat[drop] -= 1
        windows = flat.view_as(windows)
    return windows.to(torch.int32)


@register("learned_span")
class LearnedSpanPolicy(WindowPolicy):
    """One learned soft span per head under ``span.target_acr``, hard windows from ``span.freeze_at`` (above)."""

    READS = frozenset({"span"})

    @classmethod
    def validate(cls, cfg: AAHConfig, seq_len: int, n_layer: int, n_head: int) -> None:
        s = cfg.span
        require(
            isinstance(s.width, int) and 1 <= s.width < seq_len,
            "model.aah.span.width",
            s.width,
            f"an integer in [1, seq_len={seq_len})",
        )
        require(
            isinstance(s.target_acr, (int, float)) and s.width / seq_len <= s.target_acr <= 1,
            "model.aah.span.target_acr",
            s.target_acr,
            f"a fraction in [width / seq_len = {s.width / seq_len:.4f}, 1] (every head holds at least its ramp)",
        )
        require(
            isinstance(s.freeze_at, int) and s.freeze_at >= 1,
            "model.aah.span.freeze_at",
            s.freeze_at,
            "an integer >= 1 (the step at which the spans become hard windows)",
        )
        require(isinstance(s.lr, (int, float)) and s.lr > 0, "model.aah.span.lr", s.lr, "a positive learning rate")
        require(cfg.sink == 0, "model.aah.sink", cfg.sink, "0 with policy learned_span (its ramp has no sink)")
        heads = n_layer * n_head
        # Exact arithmetic on the float's own value: at a budget that pays for exactly k whole heads, rounding
        # must neither refuse k nor admit k + 1.
        most = max(0, int((Fraction(s.target_acr) * heads * seq_len - heads * s.width) // (seq_len - s.width)))
        require(
            isinstance(s.full_heads, int) and 0 <= s.full_heads <= min(most, heads - 1),
            "model.aah.span.full_heads",
            s.full_heads,
            f"an integer in [0, {min(most, heads - 1)}] (the whole-context heads that target_acr pays for, every "
            "other head at its ramp alone)",
        )

    def __init__(self, cfg: AAHConfig, n_layer: int, n_head: int, seq_len: int):
        super().__init__(cfg, n_layer, n_head, seq_len)
        s = cfg.span
        self.width, self.target, self.freeze_at, self.lr = s.width, float(s.target_acr), s.freeze_at, float(s.lr)
        self.full_heads = s.full_heads
        # the budget in keys over every head, from the float's own value (as validate counts it)
        self.budget_keys = int(Fraction(s.target_acr) * n_layer * n_head * seq_len)
        even = max(0.0, self.target * seq_len - self.width)  # every head the same reach at the start
        self.spans = Spans(n_layer, n_head, even / seq_len)
        self.last_step: int | None = None
        self.frozen: Tensor | None = None  # the spans in tokens when they stopped learning ([L, H] float32)
        self.table: Tensor | None = None  # the last table this policy returned (CPU; None after a resume)

    # -- the spans ---------------------------------------------------------------------------------------------------
    def tokens(self) -> Tensor:
        """The spans in tokens, ``[L, H]`` (a differentiable view of the parameter)."""
        return self.spans.fraction * self.seq_len

    def held(self) -> Tensor:
        """The spans that set the table: the frozen ones once they stopped learning (the optimizer's momentum may
        still move the parameter), else the parameter's (CPU, float32, no gradient)."""
        return (self.frozen if self.frozen is not None else self.tokens().detach()).float().cpu()

    def hard_table(self) -> Tensor:
        """The hard windows of the spans in force (``hard_windows``), what the run pays: while the spans learn, the
        ramp's whole reach (its last key, however lightly weighed, carries as much of the span's gradient as any
        other: the pull to grow); once frozen, within the budget in keys."""
        budget = None if self.frozen is None else self.budget_keys
        return hard_windows(self.held(), self.width, self.seq_len, budget)

    @torch.no_grad()
    def project(self) -> None:
        """Project the spans onto the budget, on a host copy: the bisection's many small reductions are not device
        syncs."""
        z = project_to_budget(self.tokens().detach().float().cpu(), self.width, self.seq_len, self.target)
        self.spans.fraction.copy_((z / self.seq_len).to(self.spans.fraction))

    def widen(self, z: Tensor) -> Tensor:
        """The frozen spans ``z`` with the ``full_heads`` widest at the whole context and the rest lowered to pay for
        them (``z`` itself when ``full_heads`` is 0)."""
        if not self.full_heads:
            return z
        flat = z.flatten().clone()
        widest = torch.argsort(flat, descending=True, stable=True)[: self.full_heads]
        flat[widest] = float(self.seq_len - self.width)
        held = torch.zeros_like(flat, dtype=torch.bool)
        held[widest] = True
        return project_to_budget(flat, self.width, self.seq_len, self.target, held).view_as(z)

    def soft_plans(self, plans: list, docs: Tensor | None) -> list:
        """Each layer's hard plan wrapped in its ramped attention (``GPT.soft_plans``)."""
        z = self.tokens()
        return [SoftSpanPlan(z[layer], self.width, docs, plan) for layer, plan in enumerate(plans)]

    # -- the contract --------------------------------------------------------------------------------------------------
    def initial_table(self) -> Tensor:
        return self.hard_table()

    def learning(self, step: int) -> bool:
        return step < self.freeze_at

    def on_train_step(self, step: int, model, batch) -> Tensor | None:
        if self.learning(step):
            self.project()
            model.soft_plans = self.soft_plans
        else:
            model.soft_plans = None  # hard windows from here on: the spans of the last learning step
            if self.frozen is not None:
                return None
            self.frozen = self.widen(self.tokens().detach().float().cpu())
        self.last_step = step
        table = self.hard_table()
        if self.table is not None and torch.equal(table, self.table):  # compared on the host: no device read
            return None
        self.table = table
        return table.clone()

    def tie_to_loss(self, loss: Tensor) -> Tensor:
        """``loss`` with the spans in its graph at zero weight once they are frozen: DDP expects a gradient for every
        parameter it registered, and a frozen span is in no forward."""
        return loss + 0.0 * self.spans.fraction.sum()

    def report(self) -> PolicyReport:
        out = PolicyReport(candidates=list(self.candidates), last_step=self.last_step)
        z = self.held().double()
        distances = torch.tensor(self.candidates, dtype=torch.float64)
        # need: the weight each head's ramp gives a key at each candidate's distance (1 inside the span, 0 past it)
        out.need = span_ramp(distances.view(1, 1, -1), z.unsqueeze(-1), self.width)
        out.need_signal = "span"
        return out

    def state_dict(self) -> dict:
        return {
            "last_step": -1 if self.last_step is None else self.last_step,
            "frozen": None if self.frozen is None else self.frozen.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state:
            step = int(state["last_step"])
            self.last_step = None if step < 0 else step
            self.frozen = None if state.get("frozen") is None else state["frozen"].float().clone()


def spans_of(policy) -> nn.Module | None:
    """The policy's learned parameters, for the LightningModule to register and optimise (None for most)."""
    spans = getattr(policy, "spans", None)
    return spans if isinstance(spans, nn.Module) else None
