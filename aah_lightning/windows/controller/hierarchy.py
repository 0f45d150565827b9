"""The hierarchy of head groups of one layer: level 0 (the grouping) and coarser parents from the same dendrogram.

Level l+1 continues the average-linkage agglomeration of level l's groups at the coarser threshold
``threshold * growth**(l+1)``. A level is kept only if it really merges something: the reference stacked identical
pass-through copies ("[2, 2, 2, 2]") and counted them as depth. A parent's features are the size-weighted mean of
its children's, i.e. the mean over all heads below it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from aah_lightning.windows.controller.grouping import Partition, agglomerate


@dataclass
class Hierarchy:
    """``levels[l]`` is the partition at level l (groups of head indices); every level is strictly coarser."""

    levels: list[Partition]

    @property
    def levels_used(self) -> int:
        return len(self.levels)

    @property
    def group_counts(self) -> list[int]:
        return [len(level) for level in self.levels]

    def parents(self, level: int) -> list[int]:
        """For each group of ``level``, the index of the group of ``level + 1`` that contains it."""
        owner = {h: p for p, group in enumerate(self.levels[level + 1]) for h in group}
        return [owner[group[0]] for group in self.levels[level]]

    def to_state(self) -> list:
        return [[list(g) for g in level] for level in self.levels]

    @classmethod
    def from_state(cls, state: list) -> Hierarchy:
        return cls([[list(map(int, g)) for g in level] for level in state])


@dataclass
class GroupTree(Hierarchy):
    """A layer's hierarchy with the window chosen for each group: ``windows[level][group]`` (or None)."""

    windows: list[list[int]] | None = None

    def group_of(self, head: int, level: int = 0) -> int | None:
        for g, heads in enumerate(self.levels[level]):
            if head in heads:
                return g
        return None


def build_hierarchy(dist: Tensor, level0: Partition, thresholds: list[float]) -> Hierarchy:
    """Stack coarser levels on ``level0`` by cutting the dendrogram at each of ``thresholds`` (ascending)."""
    levels = [level0]
    for threshold in thresholds:
        if len(levels[-1]) == 1:
            break
        coarser = agglomerate(dist, levels[-1], threshold)
        if len(coarser) < len(levels[-1]):
            levels.append(coarser)
    return Hierarchy(levels)
