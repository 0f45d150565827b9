"""Allocators: from a layer's hierarchy of head groups to one window per group, top-down.

An allocator is a callable ``(LayerInputs) -> list[list[int]]``: for every level, the candidate index chosen for
every group of that level. The policy maps level-0 groups to their heads and checks the parent constraint.
``registry.py`` holds ``ALLOCATORS``, the registry read by ``model.aah.controller.allocation.allocator``.

* ``reach`` (default): a group's window is the smallest candidate whose share of the group's full-causal attention
  mass reaches ``coverage_target``, and a child is never wider than its parent. Under a compute ceiling
  (``target_acr`` / ``target_causal_coverage``) the policy calls ``budget.allocate_within_budget`` instead, which
  chooses the finest groups' windows exactly. This replaces the reference's MLP scorer, which never received a
  gradient (its "learned" windows were a fixed random function of the statistics).
* ``paper`` (``paper_allocator.py``): the reference's decision procedure, for parity studies: enriched 29-number
  inputs, a 29->16->K scorer and a joint sibling scorer, argmax, top-down. Its networks are seeded random weights
  that are never trained, exactly as in the reference, where they never receive a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aah_lightning.windows.groups import Hierarchy

# Float slack for comparing masses and costs that were computed in different orders.
_EPS = 1e-9


@dataclass
class LayerInputs:
    """Everything an allocator may use for one layer.

    profile: ``[H, K]`` float64, share of each head's attention mass within each candidate (EMA-smoothed).
    features: ``[H, F]`` float64, the full packed feature vector (``features.FeatureLayout``), EMA-smoothed.
    layer: index of the layer (allocators with per-layer state, like ``paper``, read it).
    current: candidate index of each head's window in the table in force (None before the first decision).
    settle_margin: dead band around ``coverage_target`` for ``reach`` (``settled_need``), one number or one per head
        and candidate (``[H, K]``); 0 = none.
    floors: per head, the narrowest candidate index the head may take (reach first: an explorer holds its reach
        during formation); None = no floor. Under a budget only.
    capped: ``profile`` is a mass share, so a group never goes wider than the window holding ``coverage_target`` of
        it. False when ``profile`` holds another need signal (the ``gain`` signal's loss decrease): every candidate is
        open and the budget alone decides.
    sink: the model's attention sink (``model.aah.sink``): a budget pays for its pairs too.
    """

    hierarchy: Hierarchy
    profile: Tensor
    features: Tensor
    candidates: list[int]
    seq_len: int
    coverage_target: float
    parent_constraint: bool = True
    layer: int = 0
    current: list[int] | None = None
    settle_margin: float | Tensor = 0.0
    floors: list[int] | None = None
    capped: bool = True
    sink: int = 0


def needed_index(profile: Tensor, target: float) -> int:
    """Smallest candidate index whose mass share reaches ``target`` (the largest candidate if none does)."""
    reached = (profile >= target - _EPS).nonzero()
    return int(reached[0]) if len(reached) else len(profile) - 1


def settled_need(profile: Tensor, target: float, margin: float | Tensor, current: int | None) -> int:
    """``needed_index`` with a dead band around ``target`` for a group that holds candidate ``current``: it grows only
    when its window holds less than ``target - margin`` of its mass, and shrinks only to a window that holds at least
    ``target + margin``. ``margin`` is one number or one per candidate (``[K]``). Probe noise around the target then
    no longer moves windows back and forth."""
    band = torch.as_tensor(margin, dtype=torch.float64).expand(len(profile))
    need = needed_index(profile, target)
    if current is None or not bool((band > 0).any()) or need == current:
        return need
    if need > current:
        return need if float(profile[current]) < target - float(band[current]) - _EPS else current
    clear = (profile >= target + band - _EPS).nonzero()
    return min(int(clear[0]), current) if len(clear) else current


def reach_allocator(inputs: LayerInputs) -> list[list[int]]:
    """Top-down: every group takes the smallest candidate reaching ``coverage_target`` of its mass (with the
    ``settle_margin`` dead band around the window its heads hold), a child at most its parent's (parent
    constraint)."""
    h = inputs.hierarchy
    K = len(inputs.candidates)

    def need(group: list[int], level: int) -> int:  # a group's profile: the mean over the heads below it
        # The window a group holds: at level 0 the one window all its heads hold (heads that held different windows
        # form a new group, a new decision); above, the widest window below it, which is what a parent allows.
        held = None if inputs.current is None else {inputs.current[i] for i in group}
        if held is not None:
            held = max(held) if level > 0 else (held.pop() if len(held) == 1 else None)
        band = inputs.settle_margin
        if isinstance(band, Tensor) and band.dim() == 2:  # per head: a group's band is the mean of its heads'
            band = band[group].mean(0)
        return settled_need(inputs.profile[group].mean(0), inputs.coverage_target, band, held)

    top = len(h.levels) - 1
    chosen: list[list[int]] = [[] for _ in h.levels]
    chosen[top] = [need(g, top) for g in h.levels[top]]
    for level in range(top - 1, -1, -1):
        parents = h.parents(level)
        chosen[level] = [
            min(need(group, level), chosen[level + 1][p] if inputs.parent_constraint else K - 1)
            for group, p in zip(h.levels[level], parents)
        ]
    return chosen
