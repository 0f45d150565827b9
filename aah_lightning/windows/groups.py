"""Head groups of one layer as a hierarchy: the shape every policy that groups heads reports (``PolicyReport``).

``levels[0]`` is the finest partition of the layer's heads into groups; every further level is strictly coarser
(each of its groups a union of groups of the level below). A ``GroupTree`` adds the window chosen for each group.
How a policy builds its hierarchy is its own business (the adaptive controller's clustering:
``windows/controller/hierarchy.py``); the diagnostics and ``tools/inspect_windows.py`` only read this shape.
"""

from __future__ import annotations

from dataclasses import dataclass

Partition = list[list[int]]  # groups of head indices


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
