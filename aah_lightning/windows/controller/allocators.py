"""Allocators: from a layer's hierarchy of head groups to one window per group, top-down.

An allocator is a callable ``(LayerInputs) -> list[list[int]]``: for every level, the candidate index chosen for
every group of that level. The policy maps level-0 groups to their heads and checks the parent constraint.
``registry.py`` holds ``ALLOCATORS``, the registry read by ``model.aah.controller.allocator``.

* ``reach`` (default): a group's window is the smallest candidate whose share of the group's full-causal attention
  mass reaches ``coverage_target``; with a compute ceiling (``target_acr`` / ``target_causal_coverage``) the windows
  start at the smallest candidate and the largest mass gain per unit of added compute is bought first, sibling
  against sibling, until the ceiling or the coverage target stops it. This replaces the reference's MLP scorer,
  which never received a gradient (its "learned" windows were a fixed random function of the statistics).
* ``paper`` (``paper_allocator.py``): the reference's decision procedure, for parity studies: enriched 29-number
  inputs, a 29->16->K scorer and a joint sibling scorer, argmax, top-down. Its networks are seeded random weights
  that are never trained, exactly as in the reference, where they never receive a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aah_lightning.windows import metrics
from aah_lightning.windows.controller.hierarchy import Hierarchy

# Float slack for comparing masses and costs that were computed in different orders.
_EPS = 1e-9


@dataclass
class LayerInputs:
    """Everything an allocator may use for one layer.

    profile: ``[H, K]`` float64, share of each head's attention mass within each candidate (EMA-smoothed).
    features: ``[H, F]`` float64, the full packed feature vector (``features.FeatureLayout``), EMA-smoothed.
    costs: ``[K]`` float64, compute of one head on each candidate, in the budget's measure (None without budget).
    budget: compute ceiling of the whole layer (sum over heads) in that measure, or None.
    layer: index of the layer (allocators with per-layer state, like ``paper``, read it).
    """

    hierarchy: Hierarchy
    profile: Tensor
    features: Tensor
    candidates: list[int]
    seq_len: int
    coverage_target: float
    parent_constraint: bool = True
    costs: Tensor | None = None
    budget: float | None = None
    layer: int = 0


def window_costs(candidates: list[int], seq_len: int, measure: str) -> Tensor:
    """Compute of one head per candidate window: its ACR (``acr``) or causal coverage (``causal_coverage``)."""
    w = torch.tensor(candidates, dtype=torch.float64)
    if measure == "acr":
        return torch.clamp(w, max=seq_len) / seq_len
    if measure == "causal_coverage":
        return metrics.causal_pairs(w, seq_len) / (seq_len * (seq_len + 1) / 2)
    raise ValueError(f"unknown budget measure {measure!r}")


def needed_index(profile: Tensor, target: float) -> int:
    """Smallest candidate index whose mass share reaches ``target`` (the largest candidate if none does)."""
    reached = (profile >= target - _EPS).nonzero()
    return int(reached[0]) if len(reached) else len(profile) - 1


def choose_siblings(
    profiles: list[Tensor], sizes: list[int], caps: list[int], target: float, costs: Tensor | None, budget: float | None
) -> list[int]:
    """Candidate indices for one set of sibling groups.

    Without a budget each group takes the smallest candidate reaching ``target`` (at most its cap). With one, every
    group starts at the smallest candidate and the upgrade (to any larger candidate up to that same limit) with the
    largest mass gain per unit of added compute is bought while it fits; gains are counted over heads, so a
    group of 3 weighs 3 times a single head. The spend never exceeds ``budget``.
    """
    limits = [min(needed_index(p, target), cap) for p, cap in zip(profiles, caps)]
    if budget is None:
        return limits
    chosen = [0] * len(profiles)
    spent = sum(s * float(costs[0]) for s in sizes)
    while True:
        best = None  # (ratio, group, index, added cost)
        for g, (p, s) in enumerate(zip(profiles, sizes)):
            for j in range(chosen[g] + 1, limits[g] + 1):
                gain = s * float(p[j] - p[chosen[g]])
                added = s * float(costs[j] - costs[chosen[g]])
                if gain <= _EPS or spent + added > budget + _EPS:
                    continue
                ratio = gain / added
                if best is None or ratio > best[0] + _EPS:
                    best = (ratio, g, j, added)
        if best is None:
            return chosen
        _, g, j, added = best
        chosen[g], spent = j, spent + added


def reach_allocator(inputs: LayerInputs) -> list[list[int]]:
    """Top-down: the top groups share the layer's budget; each parent's spend is shared by its children, which
    (with the parent constraint) may not go wider than the parent."""
    h = inputs.hierarchy
    K = len(inputs.candidates)

    def profile(group: list[int]) -> Tensor:  # size-weighted mean of children = mean over the heads below
        return inputs.profile[group].mean(0)

    top = len(h.levels) - 1
    groups = h.levels[top]
    chosen: list[list[int]] = [[] for _ in h.levels]
    chosen[top] = choose_siblings(
        [profile(g) for g in groups],
        [len(g) for g in groups],
        [K - 1] * len(groups),
        inputs.coverage_target,
        inputs.costs,
        inputs.budget,
    )
    for level in range(top - 1, -1, -1):
        groups = h.levels[level]
        chosen[level] = [0] * len(groups)
        parents = h.parents(level)
        for parent, parent_group in enumerate(h.levels[level + 1]):
            kids = [c for c, p in enumerate(parents) if p == parent]
            parent_idx = chosen[level + 1][parent]
            cap = parent_idx if inputs.parent_constraint else K - 1
            budget = None if inputs.budget is None else len(parent_group) * float(inputs.costs[parent_idx])
            picks = choose_siblings(
                [profile(groups[c]) for c in kids],
                [len(groups[c]) for c in kids],
                [cap] * len(kids),
                inputs.coverage_target,
                inputs.costs,
                budget,
            )
            for c, idx in zip(kids, picks):
                chosen[level][c] = idx
    return chosen
