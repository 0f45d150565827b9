"""Compute budgets of the controller: windows chosen per finest group under a ceiling, and budgets over the run.

With a budget (``target_acr`` / ``target_causal_coverage``), ``allocate_within_budget`` chooses one candidate index
``j_g`` for every level-0 group g (``s_g`` heads, mass profile ``p_g`` = the mean of its heads' profiles). The choice
maximises the kept attention mass counted over heads, ``sum_g s_g * p_g[j_g]``, subject to
``sum_g s_g * cost[j_g] <= ceiling``, where the ceiling is ``budget * n_head`` for each layer on its own
(``budget_scope: layer``) or ``budget * n_layer * n_head`` for all layers together (``budget_scope: model``). This
is a multiple-choice knapsack, solved exactly by dynamic programming over the integer total cost: a head's ACR cost is
``min(W, T) / T`` and its causal-coverage cost ``pairs(W, T) / (T (T + 1) / 2)`` with an integer numerator (with an
attention sink, ``(min(W, T) T + sink_pairs) / T^2`` and ``(pairs + sink_pairs) / (T (T + 1) / 2)``), so costs
are integers in units of their greatest common divisor (at T = 4096 with candidates T/8..T, a 16 x 12 model's budget
is at most 1,536 units). Budgets above ``MAX_UNITS`` units (causal coverage of large models) are solved on a coarser
grid with every cost rounded *up*, so the choice still never exceeds the budget and loses at most one grid unit per
group.

The finest groups are the units of choice, so heads under one parent may take different windows. The hierarchy
constrains bottom-up: a parent's window is the widest of its children's, so no child is wider than its parent. A
group never goes wider than the smallest candidate holding ``coverage_target`` of its own mass (``coverage_target:
1.0`` spends the budget wherever mass is still gained). A parent's share of the spend never limits a child: sharing
a parent's spend top-down gives every head of a layer the parent's window whenever one head needs a wide one.

The ceiling itself (the target, or with ``budget_over_run`` what the rest of the run may still spend) comes from
``ceiling.py``.

Deterministic CPU code (float64, exact ties to the cheaper candidate): every rank computes the same windows from the
same rank-averaged profiles.
"""

from __future__ import annotations

import math
from functools import reduce

import numpy as np
from torch import Tensor

from aah_lightning.model.window_math import sink_pairs, window_pairs
from aah_lightning.windows.controller.allocators import LayerInputs, needed_index

# Above this many budget units the knapsack runs on a coarser grid (memory: one byte per unit and group).
MAX_UNITS = 1 << 16


def integer_costs(candidates: list[int], seq_len: int, measure: str, sink: int = 0) -> tuple[list[int], int]:
    """Per-head cost of each candidate as an integer numerator, and the denominator of the normalised measure (the
    attention sink's pairs included: ``metrics.window_costs`` exactly)."""
    clipped = [min(c, seq_len) for c in candidates]
    if measure == "acr":
        if not sink:
            return clipped, seq_len
        return [w * seq_len + sink_pairs(w, sink, seq_len) for w in clipped], seq_len * seq_len
    if measure == "causal_coverage":
        return [window_pairs(w, seq_len, sink) for w in clipped], seq_len * (seq_len + 1) // 2
    raise ValueError(f"unknown budget measure {measure!r}")


def group_caps(inputs: LayerInputs) -> list[int]:
    """Widest candidate index each level-0 group may take: the smallest holding ``coverage_target`` of its mass (the
    widest candidate when the profile is not a mass share, ``capped=False``), and never below the group's floor."""
    floors = group_floors(inputs)
    if not inputs.capped:
        return [len(inputs.candidates) - 1] * len(floors)
    caps = [needed_index(inputs.profile[g].mean(0), inputs.coverage_target) for g in inputs.hierarchy.levels[0]]
    return [max(c, f) for c, f in zip(caps, floors)]


def group_floors(inputs: LayerInputs) -> list[int]:
    """Narrowest candidate index each level-0 group may take: the highest floor of its heads (0 without floors)."""
    if inputs.floors is None:
        return [0] * len(inputs.hierarchy.levels[0])
    return [max(inputs.floors[h] for h in g) for g in inputs.hierarchy.levels[0]]


def multiple_choice_knapsack(values: list[Tensor], weights: list[list[int]], capacity: int) -> list[int]:
    """Exact: one item per group (``values[g][j]``, integer ``weights[g][j]``), total weight <= ``capacity``, the
    largest total value; exact ties go to the first (cheaper) item. None of them fits: ``[0] * groups`` (the caller's
    fallback). numpy, not torch: hundreds of small array operations, where torch's per-call overhead dominates."""
    if sum(w[0] for w in weights) > capacity:
        return [0] * len(values)
    best = np.zeros(capacity + 1)  # best value with total weight <= b
    columns = np.arange(capacity + 1)
    choices = []
    for v, w in zip(values, weights):
        cand = np.full((len(w), capacity + 1), -np.inf)
        for j, (vj, wj) in enumerate(zip(v.tolist(), w)):
            if wj <= capacity:
                cand[j, wj:] = best[: capacity + 1 - wj] + vj
        pick = cand.argmax(0)  # the first maximum: the cheapest of equally good items
        best = cand[pick, columns]
        choices.append(pick.astype(np.int8))  # at most 127 candidates
    out, b = [0] * len(values), capacity
    for g in range(len(values) - 1, -1, -1):
        out[g] = int(choices[g][b])
        b -= weights[g][out[g]]
    return out


def allocate_within_budget(
    layers: list[LayerInputs], measure: str, budget: float, scope: str = "model"
) -> list[list[list[int]]]:
    """Candidate indices ``[layer][level][group]`` for every layer, the mean per-head cost in ``measure`` (e.g. a
    target ACR) at most ``budget`` in each layer (``scope="layer"``) or over the whole model (``scope="model"``)."""
    if scope == "layer":
        return [_knapsack_over([inp], measure, budget)[0] for inp in layers]
    if scope == "model":
        return _knapsack_over(layers, measure, budget)
    raise ValueError(f"unknown budget scope {scope!r}")


def _knapsack_over(layers: list[LayerInputs], measure: str, budget: float) -> list[list[list[int]]]:
    """One knapsack over the level-0 groups of ``layers`` with the ceiling ``budget`` per head on average."""
    first = layers[0]
    per_head, denominator = integer_costs(first.candidates, first.seq_len, measure, first.sink)
    n_heads = sum(inp.profile.shape[0] for inp in layers)
    capacity = math.floor(budget * n_heads * denominator * (1 + 1e-12))  # the ceiling as an integer numerator
    unit = reduce(math.gcd, per_head)
    if capacity // unit > MAX_UNITS:
        unit = -(-capacity // MAX_UNITS)
    values, weights, owners, floors = [], [], [], []
    for layer, inp in enumerate(layers):
        for g, (group, cap, floor) in enumerate(zip(inp.hierarchy.levels[0], group_caps(inp), group_floors(inp))):
            s = len(group)
            v = s * inp.profile[group].mean(0)[: cap + 1].clone()
            v[:floor] = -math.inf  # below its floor a group has no choice
            values.append(v)
            weights.append([-(-s * c // unit) for c in per_head[: cap + 1]])  # rounded up: never over the budget
            owners.append((layer, g))
            floors.append(floor)
    if sum(w[f] for w, f in zip(weights, floors)) > capacity // unit:
        picks = floors  # the floors alone exceed the ceiling: they hold, everything else takes its narrowest window
    else:
        picks = multiple_choice_knapsack(values, weights, capacity // unit)
    chosen: list[list[list[int]]] = [[[0] * len(level) for level in inp.hierarchy.levels] for inp in layers]
    for (layer, g), j in zip(owners, picks):
        chosen[layer][0][g] = j
    for layer, inp in enumerate(layers):  # upper levels: the widest child
        h = inp.hierarchy
        for level in range(1, len(h.levels)):
            for child, parent in enumerate(h.parents(level - 1)):
                chosen[layer][level][parent] = max(chosen[layer][level][parent], chosen[layer][level - 1][child])
    return chosen
