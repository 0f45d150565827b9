"""The AAH controller: the ``adaptive`` window policy and its parts.

features.py          per-head features from a probe (paper statistics, attention-mass profile), standardisation
grouping.py          average-linkage clustering of one layer's heads, hysteresis, random / no grouping
hierarchy.py         coarser levels of head groups from the same dendrogram
allocators.py        windows per group, top-down (``reach``)
paper_allocator.py   the authors' untrained scorer networks (``paper``), for parity studies
registry.py          ``ALLOCATORS``: the allocators by name
adaptive.py          ``AdaptivePolicy``: schedule, probe, EMA, rank-averaged features, state, diagnostics
"""
