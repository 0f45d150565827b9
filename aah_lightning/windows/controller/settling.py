"""Settling (``model.aah.controller.settle``): a table stops changing when nothing changes but probe noise.

Without a budget the ``reach`` allocator keeps a dead band around ``coverage_target`` (``allocators.settled_need``,
fed the bands below). Under a budget the table in force stays, per budget unit, while it fits the ceiling and the
new choice gains no more need than the moved heads' margins (``kept_units``). docs/controller.md, "Settling".
"""

from __future__ import annotations

import torch
from torch import Tensor

# A move must gain more than this many standard errors of the probe's estimate of the need.
SETTLE_SIGMAS = 2.0


def settle_bands(noise: Tensor, margin: float) -> Tensor:
    """How much need a move must gain, per head and candidate (``noise``'s shape): ``margin``, or ``SETTLE_SIGMAS``
    standard errors of the probe's estimate where that is more; 0 when settling is off (``margin`` 0)."""
    if margin <= 0:
        return torch.zeros_like(noise)
    return torch.clamp(SETTLE_SIGMAS * noise, min=margin)


def kept_units(
    in_force: Tensor,
    proposal: Tensor,
    need: Tensor,
    noise: Tensor,
    ceiling: float,
    units: list[list[int]],
    candidates: list[int],
    table_cost,
    margin: float,
    reach: dict | None = None,
) -> list[list[int]]:
    """The budget units (lists of layers) whose table ``in_force`` stays instead of ``proposal``: it still fits the
    ``ceiling`` (``table_cost``: the mean per-head cost of a table), and the proposal gains no more ``need``
    ``[L, H, K]`` than the moved heads must, each ``margin`` or ``SETTLE_SIGMAS`` standard errors (``noise``) of its
    gain's estimate where that is more. The proposal is the exact optimum, so it never keeps less need than the table
    in force. With kept reach (``reach``: the heads that must hold it and its candidate index), a table in force
    stays only if as many of the unit's heads hold that window or wider: settling never undoes the kept reach."""
    if margin <= 0:
        return []
    cand = torch.tensor(candidates, dtype=torch.int32)
    kept = []
    for layers in units:
        old, new = in_force[layers], proposal[layers]
        moved = old != new
        if not moved.any() or table_cost(old) > ceiling + 1e-9:
            continue
        held = [j for (lyr, _h), j in (reach or {}).items() if lyr in layers]
        if held and int((old >= candidates[held[0]]).sum()) < len(held):
            continue  # the table in force lacks the reach this decision keeps
        idx = [torch.searchsorted(cand, t).long().unsqueeze(-1) for t in (old, new)]
        gain = float(need[layers].gather(-1, idx[1]).sum() - need[layers].gather(-1, idx[0]).sum())
        se = sum(noise[layers].gather(-1, i).squeeze(-1) for i in idx)  # bounds the SE of each head's gain
        if gain <= float(torch.clamp(SETTLE_SIGMAS * se, min=margin)[moved].sum()):
            kept.append(layers)
    return kept
