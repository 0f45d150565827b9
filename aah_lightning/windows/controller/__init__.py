"""The AAH controller: the ``adaptive`` window policy and its parts, one concern a module.

signals.py           the need signals by name (``mass``, ``gain``, ``retrieval``) and their contract
gain.py              the gain signal's measurement: one no-grad forward per head and candidate
retrieval.py         the retrieval signal's measurement: copy probes, copy-paste hits, one forward
features.py          per-head features from a probe (paper statistics, attention-mass profile), standardisation
grouping.py          average-linkage clustering of one layer's heads, hysteresis, random / no grouping (``Grouper``)
hierarchy.py         coarser levels of head groups from the same dendrogram
reach.py             reach first (explorers while the model forms) and kept reach
ceiling.py           the budget: a table's cost, the units sharing it, each decision's ceiling, budgets over the run
budget.py            windows within the ceiling: the exact multiple-choice knapsack
allocators.py        windows per group without a budget, top-down (``reach``)
paper_allocator.py   the authors' untrained scorer networks (``paper``), for parity studies
registry.py          ``ALLOCATORS``: the allocators by name
settling.py          when the table in force stays: moves that gain no more than noise are not made
adaptive.py          ``AdaptivePolicy``: wires the parts; schedule, probe, EMA, the decision's pipeline, state
"""
