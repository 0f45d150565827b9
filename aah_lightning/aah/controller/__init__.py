"""The AAH controller: the ``adaptive`` window policy and its parts.

features.py    per-head features from a probe (paper statistics, attention-mass profile), standardisation
grouping.py    average-linkage clustering of one layer's heads, hysteresis, random / no grouping
hierarchy.py   coarser levels of head groups from the same dendrogram
allocators.py  windows per group, top-down (``reach``; registry ``ALLOCATORS``)
adaptive.py    ``AdaptivePolicy``: schedule, probe, EMA, rank-averaged features, state, diagnostics
"""

# policies.py registers AdaptivePolicy (a WindowPolicy subclass); importing it first makes any import order work.
from aah_lightning.aah import policies as _policies  # noqa: F401
from aah_lightning.aah.controller.adaptive import AdaptivePolicy  # noqa: E402

__all__ = ["AdaptivePolicy"]
