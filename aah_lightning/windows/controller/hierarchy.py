"""The adaptive controller's hierarchy of head groups: level 0 (the grouping) and coarser parents from the same
dendrogram (the shape itself, ``Hierarchy``, is the policy contract's: ``windows/groups.py``).

Level l+1 continues the average-linkage agglomeration of level l's groups at the coarser threshold
``threshold * growth**(l+1)``. A level is kept only if it really merges something: the reference stacked identical
pass-through copies ("[2, 2, 2, 2]") and counted them as depth. A parent's features are the size-weighted mean of
its children's, i.e. the mean over all heads below it.
"""

from __future__ import annotations

from torch import Tensor

from aah_lightning.windows.controller.grouping import Partition, agglomerate
from aah_lightning.windows.groups import Hierarchy


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
