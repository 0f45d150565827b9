"""Grouping one layer's heads: average-linkage agglomerative clustering, cut at a distance threshold.

A partition is a list of groups, each a sorted list of head indices, groups ordered by their first head (the
canonical form: equal partitions compare equal). Everything runs on CPU in float64; a layer has at most a few dozen
heads, so the plain O(n^3) agglomeration costs microseconds. Ties break towards the lowest indices, so every rank
and every resumed run gets the same answer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aah_lightning.windows.groups import Partition


def pairwise_distances(z: Tensor, metric: str) -> Tensor:
    """``[H, H]`` distances between rows of ``z``: ``euclidean`` or ``cosine`` (1 - cos, in [0, 2])."""
    if metric == "euclidean":
        d = (z.unsqueeze(1) - z.unsqueeze(0)).norm(dim=-1)
    elif metric == "cosine":
        u = z / z.norm(dim=1, keepdim=True).clamp_min(1e-12)
        d = (1.0 - u @ u.T).clamp(min=0.0)
    else:
        raise ValueError(f"unknown metric {metric!r}")
    d = (d + d.T) / 2
    d.fill_diagonal_(0.0)
    return d


def canonical(groups) -> Partition:
    return sorted((sorted(int(h) for h in g) for g in groups if len(g)), key=lambda g: g[0])


def agglomerate(
    dist: Tensor, start: Partition, threshold: float, min_size: int = 1, max_groups: int | None = None
) -> Partition:
    """Merge the groups of ``start`` bottom-up (average linkage over the head distances ``dist``).

    Merges the closest pair while its linkage is at most ``threshold``; then, while a group is smaller than
    ``min_size``, merges the smallest one into its nearest group; then, while there are more than ``max_groups``
    groups, merges the closest pair. Starting from singletons this is the threshold cut of the dendrogram;
    starting from level-l groups it continues the same dendrogram to level l+1.
    """
    groups = canonical(start)
    member = torch.zeros(len(groups), dist.shape[0], dtype=torch.float64)
    for i, g in enumerate(groups):
        member[i, g] = 1.0 / len(g)
    # Mean distance between the members of two groups; a few dozen items, so plain floats from here on.
    link = (member @ dist.to(torch.float64) @ member.T).tolist()
    sizes = [len(g) for g in groups]

    def nearest(a: int) -> int:
        return min((link[a][b], b) for b in range(len(groups)) if b != a)[1]

    while len(groups) > 1:
        # closest pair; ties go to the lowest (a, b)
        d, a, b = min((link[a][b], a, b) for a in range(len(groups)) for b in range(a + 1, len(groups)))
        if d > threshold:
            small = [i for i, s in enumerate(sizes) if s < min_size]
            if small:
                a = min(small, key=lambda i: (sizes[i], i))
                a, b = sorted((a, nearest(a)))
            elif max_groups is None or len(groups) <= max_groups:
                break
        # Lance-Williams update for average linkage; the merged group keeps slot a (its first head is smaller).
        merged = [(sizes[a] * x + sizes[b] * y) / (sizes[a] + sizes[b]) for x, y in zip(link[a], link[b])]
        link[a] = merged
        for i, row in enumerate(link):
            row[a] = merged[i]
        del link[b]
        for row in link:
            del row[b]
        groups[a] = sorted(groups[a] + groups[b])
        sizes[a] += sizes[b]
        del groups[b], sizes[b]
    return groups


def partition_score(dist: Tensor, partition: Partition, threshold: float) -> float:
    """How well a partition fits the distances at ``threshold``, in distance units (higher is better).

    Mean over head pairs of ``threshold - d`` for pairs in the same group and ``d - threshold`` for pairs apart.
    Average-linkage merging below the threshold is exactly the greedy ascent of this score, so it is the natural
    yardstick for the hysteresis test (keep the previous partition unless the new one beats it by a margin).
    """
    n = dist.shape[0]
    if n < 2:
        return 0.0
    label = torch.empty(n, dtype=torch.long)
    for i, g in enumerate(partition):
        label[g] = i
    same = label.view(-1, 1) == label.view(1, -1)
    signed = torch.where(same, threshold - dist, dist - threshold)
    iu = torch.triu_indices(n, n, offset=1)
    return float(signed[iu[0], iu[1]].mean())


def cluster_heads(
    dist: Tensor,
    threshold: float,
    min_size: int = 1,
    max_groups: int | None = None,
    previous: Partition | None = None,
    hysteresis: float = 0.0,
) -> Partition:
    """Level-0 groups of one layer: the threshold cut, unless ``previous`` is within ``hysteresis`` of it."""
    n = dist.shape[0]
    new = agglomerate(dist, [[h] for h in range(n)], threshold, min_size, max_groups)
    if previous is None or canonical(previous) == new:
        return new
    if partition_score(dist, new, threshold) < partition_score(dist, previous, threshold) + hysteresis:
        return canonical(previous)
    return new


def random_partition(n_heads: int, n_groups: int, generator: torch.Generator) -> Partition:
    """A seeded random partition of the heads into ``n_groups`` groups of near-equal size."""
    perm = torch.randperm(n_heads, generator=generator).tolist()
    k = min(n_groups, n_heads)
    return canonical(perm[i::k] for i in range(k))


def singletons(n_heads: int) -> Partition:
    return [[h] for h in range(n_heads)]


def kv_head_groups(n_heads: int, n_kv_heads: int) -> Partition:
    """The query heads of each key/value head: ``n_kv_heads`` groups of consecutive heads (grouped-query attention's
    order, query head ``h`` reading key/value head ``h // (n_heads / n_kv_heads)``)."""
    size = n_heads // n_kv_heads
    return [list(range(g * size, (g + 1) * size)) for g in range(n_kv_heads)]


def apart(partition: Partition, heads: list[int]) -> Partition:
    """``partition`` with each of ``heads`` in a group of its own (groups in order of first head)."""
    out = [[h] for h in heads]
    out += [rest for rest in ([h for h in g if h not in heads] for g in partition) if rest]
    return canonical(out)


class Grouper:
    """Level 0 of every layer's hierarchy, decision after decision (``settings``: ``GroupsConfig``): it remembers each
    layer's last partition (for hysteresis and ``reuse_groups``) and the random partitions of ``fixed_random``, drawn
    once per layer."""

    def __init__(self, settings, n_layer: int, n_head: int, seed: int):
        self.settings, self.n_head = settings, n_head
        self.generator = torch.Generator().manual_seed(seed)
        self.partitions: list[Partition | None] = [None] * n_layer  # level 0 of the last decision
        self.random_partitions: list[Partition | None] = [None] * n_layer

    def level0(self, layer: int, dist: Tensor, alone: list[int]) -> Partition:
        """Layer ``layer``'s level-0 partition from the head distances ``dist``, with the heads of ``alone`` each in
        a group of its own; remembered as the layer's partition."""
        c = self.settings
        if c.method == "none":
            partition = singletons(self.n_head)
        elif c.method == "kv_heads":
            partition = kv_head_groups(self.n_head, c.kv_heads)
        elif c.method == "fixed_random":
            if self.random_partitions[layer] is None:
                self.random_partitions[layer] = random_partition(self.n_head, c.random_groups, self.generator)
            partition = self.random_partitions[layer]
        elif c.reuse_groups and self.partitions[layer] is not None:
            partition = self.partitions[layer]
        else:
            partition = cluster_heads(
                dist, c.threshold, c.min_group_size, c.max_groups, self.partitions[layer], c.hysteresis
            )
        if alone:
            partition = apart(partition, alone)
        self.partitions[layer] = partition
        return partition

    def state_dict(self) -> dict:
        return {
            "partitions": [None if p is None else [list(g) for g in p] for p in self.partitions],
            "random_partitions": [None if p is None else [list(g) for g in p] for p in self.random_partitions],
            "partition_generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.partitions = [None if p is None else [list(map(int, g)) for g in p] for p in state["partitions"]]
        self.random_partitions = [
            None if p is None else [list(map(int, g)) for g in p] for p in state["random_partitions"]
        ]
        self.generator.set_state(state["partition_generator"])
