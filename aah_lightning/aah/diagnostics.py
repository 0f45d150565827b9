"""Diagnostics of a window table beyond the model-wide numbers of ``metrics``: per-layer values, the tile density of
the attention plans actually used, window changes, and the policy's hierarchy of head groups.

Everything here works on CPU copies (the planner's host mirror of the table, a checkpoint's state) and is called at
log steps or by the inspect tool, never on the training hot path.

The hierarchy is read from the policy (or its checkpointed ``state_dict``) with these names, all optional:

* ``hierarchies[l]``: per layer, None or the levels of layer l's hierarchy, either an object with ``.levels`` or the
  plain list; ``levels[level][group]`` is a list of head indices; level 0 is the finest, every level a partition of
  the heads.
* ``group_windows[l]``: per layer, None or ``[level][group]`` window chosen for each group.
* ``partitions[l]``: level-0 groups only, used when ``hierarchies`` is absent.
* ``last_step``: step of the last decision (None or -1 before the first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from aah_lightning.aah import metrics
from aah_lightning.aah.controller.hierarchy import Hierarchy
from aah_lightning.model import window_math


# -- per-layer values of a table ----------------------------------------------------------------------------------
def layer_acr(table: Tensor, seq_len: int) -> list[float]:
    return [float(metrics.acr(row, seq_len)) for row in table]


def layer_causal_coverage(table: Tensor, seq_len: int) -> list[float]:
    return [float(metrics.causal_coverage(row, seq_len)) for row in table]


def layer_block_density(table: Tensor, seq_len: int, block_size: int) -> list[float]:
    """Analytic non-empty tiles / causal tiles per layer: what a BlockMask of the table visits."""
    return [float(metrics.block_density(row.view(1, -1), seq_len, block_size)) for row in table]


def plan_block_density(plans: Sequence, table: Tensor, seq_len: int, block_size: int) -> tuple[list[float], list[str]]:
    """Block density per layer from the plans a forward used, and where each value came from.

    Each plan reports its own tiles (``Plan.tile_counts``): counted on the BlockMask its kernel ran with
    (``"blockmask"``), or the analytic count of its row at the model's tile size (``"analytic"``) - the work a
    block-sparse kernel would do with that table. A missing plan (None: plans that depend on each batch) gets the
    analytic count of the table's row.
    """
    counts = [
        window_math.tile_counts(table[layer], seq_len, block_size) if plan is None else plan.tile_counts(block_size)
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
@dataclass
class GroupTree(Hierarchy):
    """One layer's hierarchy as diagnostics read it (from a live policy or a checkpoint's state):
    ``levels[level][group]`` head indices, plus ``windows[level][group]`` (or None)."""

    windows: list[list[int]] | None = None

    def group_of(self, head: int, level: int = 0) -> int | None:
        for g, heads in enumerate(self.levels[level]):
            if head in heads:
                return g
        return None


def _get(source, name: str):
    if isinstance(source, Mapping):
        return source.get(name)
    return getattr(source, name, None)


def _levels(entry) -> list[list[list[int]]] | None:
    levels = getattr(entry, "levels", entry)
    if not isinstance(levels, (list, tuple)) or not levels:
        return None
    try:
        return [[[int(h) for h in group] for group in level] for level in levels]
    except TypeError:
        return None


def group_trees(source, n_layer: int) -> list[GroupTree | None] | None:
    """Per layer, the policy's hierarchy (or None for a layer without one); None if the policy has no groups at all.

    ``source`` is a policy object or its ``state_dict`` (for example a checkpoint's ``aah_policy``).
    """
    if source is None:
        return None
    hierarchies = _get(source, "hierarchies")
    if hierarchies is None:
        partitions = _get(source, "partitions")
        hierarchies = None if partitions is None else [None if p is None else [p] for p in partitions]
    if not isinstance(hierarchies, (list, tuple)) or len(hierarchies) != n_layer:
        return None
    windows = _get(source, "group_windows")
    if not isinstance(windows, (list, tuple)) or len(windows) != n_layer:
        windows = [None] * n_layer
    trees = []
    for entry, wins in zip(hierarchies, windows):
        levels = None if entry is None else _levels(entry)
        if levels is None:
            trees.append(None)
            continue
        ok = isinstance(wins, (list, tuple)) and [len(w) for w in wins] == [len(lv) for lv in levels]
        trees.append(GroupTree(levels, [[int(w) for w in lv] for lv in wins] if ok else None))
    return trees if any(t is not None for t in trees) else None


def decision_step(source) -> int | None:
    """The policy's ``last_step`` (None before the first decision or when it has none)."""
    step = _get(source, "last_step") if source is not None else None
    return None if step is None or int(step) < 0 else int(step)


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
