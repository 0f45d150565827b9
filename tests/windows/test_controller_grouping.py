"""Average-linkage grouping, its constraints, hysteresis and the hierarchy built from it."""

import itertools

import torch

from aah_lightning.windows.controller.grouping import (
    agglomerate,
    canonical,
    cluster_heads,
    pairwise_distances,
    partition_score,
    random_partition,
)
from aah_lightning.windows.controller.hierarchy import build_hierarchy


def line(*xs) -> torch.Tensor:
    x = torch.tensor(xs, dtype=torch.float64).view(-1, 1)
    return pairwise_distances(x, "euclidean")


def naive_average_linkage(dist, threshold):
    """Recompute every linkage from scratch at each merge (the definition)."""
    groups = [[i] for i in range(dist.shape[0])]
    while len(groups) > 1:
        pairs = [(float(dist[a][:, b].mean()), i, j) for (i, a), (j, b) in itertools.combinations(enumerate(groups), 2)]
        best = min(pairs)
        if best[0] > threshold:
            break
        _, i, j = best
        groups[i] = groups[i] + groups[j]
        del groups[j]
    return canonical(groups)


def test_threshold_cut_of_points_on_a_line():
    d = line(0.0, 0.1, 0.2, 5.0, 5.1, 10.0)
    assert agglomerate(d, [[i] for i in range(6)], 1.0) == [[0, 1, 2], [3, 4], [5]]
    assert agglomerate(d, [[i] for i in range(6)], 6.0) == [[0, 1, 2, 3, 4], [5]]
    assert agglomerate(d, [[i] for i in range(6)], 0.01) == [[i] for i in range(6)]


def test_average_linkage_does_not_chain():
    # Evenly spaced points: single linkage at 1.2 would chain all five into one group.
    d = line(0, 1, 2, 3, 4)
    assert agglomerate(d, [[i] for i in range(5)], 1.2) == [[0, 1], [2, 3], [4]]


def test_incremental_linkage_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = 3 + trial % 10
        z = torch.randn(n, 4, generator=g, dtype=torch.float64)
        d = pairwise_distances(z, "euclidean" if trial % 2 else "cosine")
        threshold = float(d[d > 0].median())
        assert agglomerate(d, [[i] for i in range(n)], threshold) == naive_average_linkage(d, threshold)


def test_min_group_size_and_max_groups_are_hard_limits():
    d = line(0.0, 0.1, 0.2, 5.0, 5.1, 9.0)
    singles = [[i] for i in range(6)]
    # The lone head at 9 joins its nearest group (3, 4); no group ends smaller than 2.
    assert agglomerate(d, singles, 1.0, min_size=2) == [[0, 1, 2], [3, 4, 5]]
    assert agglomerate(d, singles, 1.0, min_size=4) == [[0, 1, 2, 3, 4, 5]]
    assert agglomerate(d, singles, 1.0, max_groups=2) == [[0, 1, 2], [3, 4, 5]]
    assert agglomerate(d, singles, 0.01, max_groups=3) == [[0, 1, 2], [3, 4], [5]]


def test_grouping_follows_the_heads_under_permutation():
    g = torch.Generator().manual_seed(3)
    centres = torch.tensor([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
    z = torch.cat([c + 0.2 * torch.randn(3, 2, generator=g, dtype=torch.float64) for c in centres])
    perm = torch.randperm(9, generator=g)
    base = cluster_heads(pairwise_distances(z, "euclidean"), 1.5)
    permuted = cluster_heads(pairwise_distances(z[perm], "euclidean"), 1.5)
    assert base == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert canonical([[int(perm[i]) for i in grp] for grp in permuted]) == base


def test_hysteresis_keeps_the_previous_partition_unless_clearly_better():
    d = line(0.0, 0.1, 0.2, 5.0, 5.1, 10.0)
    previous = [[0, 1, 2, 3, 4], [5]]
    new = cluster_heads(d, 1.0)
    gap = partition_score(d, new, 1.0) - partition_score(d, previous, 1.0)
    assert gap > 0
    assert cluster_heads(d, 1.0, previous=previous, hysteresis=gap + 1e-6) == previous
    assert cluster_heads(d, 1.0, previous=previous, hysteresis=gap - 1e-6) == new
    assert cluster_heads(d, 1.0, previous=previous, hysteresis=0.0) == new


def test_score_prefers_the_threshold_cut():
    d = line(0.0, 0.1, 0.2, 5.0, 5.1, 10.0)
    cut = cluster_heads(d, 1.0)
    for other in ([[0, 1, 2, 3, 4, 5]], [[i] for i in range(6)], [[0, 3], [1, 4], [2, 5]]):
        assert partition_score(d, cut, 1.0) > partition_score(d, other, 1.0)


def test_random_partition_is_seeded_and_balanced():
    a = random_partition(12, 3, torch.Generator().manual_seed(5))
    b = random_partition(12, 3, torch.Generator().manual_seed(5))
    c = random_partition(12, 3, torch.Generator().manual_seed(6))
    assert a == b and a != c
    assert sorted(h for grp in a for h in grp) == list(range(12))
    assert [len(grp) for grp in a] == [4, 4, 4]


def test_hierarchy_levels_are_nested_strictly_coarser_and_never_copies():
    d = line(0.0, 0.1, 1.0, 1.1, 5.0, 5.2, 20.0)
    level0 = cluster_heads(d, 0.5)
    h = build_hierarchy(d, level0, [1.5, 3.0, 7.0, 50.0])
    assert h.levels == [
        [[0, 1], [2, 3], [4, 5], [6]],
        [[0, 1, 2, 3], [4, 5], [6]],
        [[0, 1, 2, 3, 4, 5], [6]],
        [[0, 1, 2, 3, 4, 5, 6]],
    ]
    assert h.levels_used == 4 and h.group_counts == [4, 3, 2, 1]
    assert h.parents(0) == [0, 0, 1, 2]
    # Thresholds that merge nothing add no level: no pass-through copies.
    flat = build_hierarchy(d, level0, [0.6, 0.7])
    assert flat.levels == [level0]
    skip = build_hierarchy(d, level0, [0.6, 1.5])
    assert skip.group_counts == [4, 3]
