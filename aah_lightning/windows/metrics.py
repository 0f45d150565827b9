"""Every number about a window table (definitions: docs/method.md).

Model-wide values are pure tensor math with no host syncs:

* ACR (the paper's definition, kept exactly without a sink): mean over (layer, head) of ``min(W, T) / T``. An
  attention sink of S positions adds its pairs, ``sink_pairs(W, S, T) / T^2`` per head (``window_math.sink_pairs``):
  ``min(W, T) / T`` is a head's ``min(W, T) * T`` key slots over the ``T^2`` of the score matrix, and the sink adds
  as many slots as it adds pairs.
* causal coverage: allowed causal pairs / all causal pairs, ``pairs(W, T) = W(W+1)/2 + (T-W)W`` for ``W <= T``
  (plus the sink's pairs) over ``T(T+1)/2`` - the work a perfect kernel does.
* block density: non-empty tiles of the BlockMask / causal tiles - the work FlexAttention does.
* window fractions: share of heads on each candidate window.

Per-layer values, the tile density of the attention plans actually used, window changes and the policy's hierarchy
of head groups work on CPU copies (the planner's host mirror of the table, a checkpoint's state) and are called at
log steps or by the inspect tool, never on the training hot path. The hierarchy comes from the policy's
``PolicyReport`` (``policy.report()``, or ``report_from_state`` of a checkpoint): per layer a ``GroupTree`` whose
``levels[level][group]`` are head indices (level 0 the finest) and ``windows[level][group]`` the chosen windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

# Pairs, coverage and tiles are counted in one place (model/window_math.py); the run's metrics re-export them.
from aah_lightning.model import window_math
from aah_lightning.model.window_math import block_density, causal_coverage, causal_pairs

if TYPE_CHECKING:  # type hints only: the controller imports this module
    from aah_lightning.windows.groups import GroupTree

__all__ = ["acr", "block_density", "causal_coverage", "causal_pairs"]


def head_acr(windows: Tensor, seq_len: int, sink: int = 0) -> Tensor:
    """Each head's ACR (float64, the table's shape): ``min(W, T) / T``, plus ``sink_pairs(W, S, T) / T^2``."""
    w = torch.clamp(windows.to(torch.float64), max=seq_len)
    if not sink:
        return w / seq_len
    return w / seq_len + (causal_pairs(windows, seq_len, sink) - causal_pairs(windows, seq_len)) / seq_len**2


def acr(windows: Tensor, seq_len: int, sink: int = 0) -> Tensor:
    """Attention coverage ratio of a window table ``[..., H]`` at sequence length ``seq_len`` (with the model's
    attention sink: its pairs counted)."""
    return head_acr(windows, seq_len, sink).mean()


def usage_head_acr(usage, seq_len: int) -> Tensor:
    """Each head's ACR averaged over a run (``[L, H]`` float64) from its window usage (``WindowUsage.state_dict()``,
    in checkpoints): ``window_sum / (steps T)``, plus ``sink_sum / (steps T^2)`` when the run had an attention sink."""
    steps = int(usage["steps"])
    head = usage["window_sum"].to(torch.float64) / (steps * seq_len)
    if usage.get("sink_sum") is not None:
        head = head + usage["sink_sum"].to(torch.float64) / (steps * seq_len**2)
    return head


# -- per-layer values of a table ----------------------------------------------------------------------------------
def layer_acr(table: Tensor, seq_len: int, sink: int = 0) -> list[float]:
    return [float(acr(row, seq_len, sink)) for row in table]


def layer_causal_coverage(table: Tensor, seq_len: int, sink: int = 0) -> list[float]:
    return [float(causal_coverage(row, seq_len, sink)) for row in table]


def layer_distinct_windows(table: Tensor, seq_len: int) -> list[int]:
    """How many different windows each layer's heads run with (windows >= T count as T): 1 = one window for all."""
    return [len(set(torch.clamp(row, max=seq_len).tolist())) for row in table]


def layer_window_spread(table: Tensor, seq_len: int) -> list[float]:
    """Octaves between each layer's widest and narrowest window, ``log2(max / min)`` of ``min(W, T)``: 0 = uniform."""
    clipped = torch.clamp(table.to(torch.float64), min=1, max=seq_len)
    return [float(torch.log2(row.max() / row.min())) for row in clipped]


def layer_block_density(table: Tensor, seq_len: int, block_size: int, sink: int = 0) -> list[float]:
    """Analytic non-empty tiles / causal tiles per layer: what a BlockMask of the table visits."""
    return [float(block_density(row.view(1, -1), seq_len, block_size, sink)) for row in table]


def plan_block_density(
    plans: Sequence, table: Tensor, seq_len: int, block_size: int, sink: int = 0
) -> tuple[list[float], list[str]]:
    """Block density per layer from the plans a forward used, and where each value came from.

    Each plan reports its own tiles (``Plan.tile_counts``): counted on the BlockMask its kernel ran with
    (``"blockmask"``), or the analytic count of its row at the model's tile size (``"analytic"``) - the work a
    block-sparse kernel would do with that table. A missing plan (None: plans that depend on each batch) gets the
    analytic count of the table's row.
    """
    counts = [
        window_math.tile_counts(table[layer], seq_len, block_size, sink)
        if plan is None
        else plan.tile_counts(block_size)
        for layer, plan in enumerate(plans)
    ]
    return [c.density for c in counts], [c.source for c in counts]


def fraction_windows(table: Tensor, candidates: Sequence[int]) -> list[int]:
    """The windows to report fractions for: every candidate, plus any other value in the table (so they sum to 1)."""
    return sorted(set(int(c) for c in candidates) | set(int(w) for w in table.flatten().tolist()))


def change_rate(previous: Tensor | None, table: Tensor) -> float | None:
    """Share of heads whose window differs from ``previous`` (None when there is nothing to compare with)."""
    if previous is None or previous.shape != table.shape:
        return None
    return float((previous != table).to(torch.float64).mean())


# -- the hierarchy of head groups ---------------------------------------------------------------------------------
def group_stats(trees: Sequence[GroupTree | None]) -> tuple[list[int], list[list[int]]]:
    """Levels used per layer, and groups per level per layer (layers without a hierarchy: 0 levels, no counts)."""
    levels = [0 if t is None else t.levels_used for t in trees]
    counts = [[] if t is None else t.group_counts for t in trees]
    return levels, counts


def mean_group_counts(counts: Sequence[Sequence[int]]) -> list[float]:
    """Mean groups per layer at each level. A layer whose hierarchy stops below a level counts its top level there:
    a level is only built when it merges something, so a missing level means nothing merged further."""
    counts = [c for c in counts if c]
    if not counts:
        return []
    depth = max(len(c) for c in counts)
    return [sum(c[min(k, len(c) - 1)] for c in counts) / len(counts) for k in range(depth)]


def hierarchy_text(table: Tensor, trees: Sequence[GroupTree | None] | None, step: int | None = None) -> str:
    """Per layer, the tree of groups, coarsest level first: each group's level, index and chosen window, and at
    level 0 its heads with the windows they run with; without a hierarchy, the heads and their windows."""
    lines = [] if step is None else [f"decision at step {step}"]
    for layer, row in enumerate(table.tolist()):
        tree = None if trees is None else trees[layer]
        heads = "  ".join(f"h{h}={w}" for h, w in enumerate(row))
        if tree is None:
            lines.append(f"layer {layer}: {heads}")
            continue
        lines.append(f"layer {layer}: {tree.levels_used} level(s), groups per level {tree.group_counts}")
        top = tree.levels_used - 1
        for g in range(len(tree.levels[top])):
            _tree_lines(tree, row, top, g, 1, lines)
    return "\n".join(lines)


def _tree_lines(tree: GroupTree, row: list[int], level: int, group: int, depth: int, lines: list[str]) -> None:
    heads = tree.levels[level][group]
    chosen = "" if tree.windows is None else f" W={tree.windows[level][group]}"
    if level == 0:  # leaves list their heads with the windows they run with
        lines.append(f"{'  ' * depth}L0.g{group}{chosen}: " + " ".join(f"h{h}={row[h]}" for h in heads))
        return
    lines.append(f"{'  ' * depth}L{level}.g{group}{chosen} ({len(heads)} heads)")
    for child, child_heads in enumerate(tree.levels[level - 1]):
        if child_heads and child_heads[0] in heads:
            _tree_lines(tree, row, level - 1, child, depth + 1, lines)


def window_costs(candidates: list[int], seq_len: int, measure: str, sink: int = 0) -> Tensor:
    """Compute of one head per candidate window: its ACR (``acr``) or causal coverage (``causal_coverage``), the
    attention sink's pairs included."""
    w = torch.tensor(candidates, dtype=torch.float64)
    if measure == "acr":
        return head_acr(w, seq_len, sink)
    if measure == "causal_coverage":
        return causal_pairs(w, seq_len, sink) / (seq_len * (seq_len + 1) / 2)
    raise ValueError(f"unknown budget measure {measure!r}")
