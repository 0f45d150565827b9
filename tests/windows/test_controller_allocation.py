"""The reach allocator on inputs whose reach is known; budgets; the parent constraint."""

import pytest
import torch

from aah_lightning.windows import metrics
from aah_lightning.windows.controller.allocators import LayerInputs, reach_allocator, settled_need
from aah_lightning.windows.controller.budget import allocate_within_budget
from aah_lightning.windows.controller.features import FeatureLayout, probe_features
from aah_lightning.windows.groups import Hierarchy
from aah_lightning.windows.metrics import window_costs
from aah_lightning.windows.probe import mass_within
from helpers.controller_inputs import (
    adaptive,
    constructed_probe,
    distant_head,
    local_head,
    random_profiles,
    synthetic_features,
)

T = 64
CANDS = [4, 8, 16, 32, 64]


def designed_layers():
    # layer 0: three heads on the previous 2 tokens, two on the token 10 back, one on the token 40 back
    layer0 = [local_head(T, 2)] * 3 + [distant_head(T, 10)] * 2 + [distant_head(T, 40)]
    # layer 1: two heads on the 6 closest tokens, the rest on the previous 3 (all local)
    layer1 = [local_head(T, 6)] * 2 + [local_head(T, 3)] * 4
    return [layer0, layer1]


@pytest.mark.parametrize("feature_set", ["all", "reach"])
def test_known_reach_gives_exact_windows_and_groups(feature_set):
    probe = constructed_probe(designed_layers())
    policy = adaptive(2, 6, T, CANDS, feature_set=feature_set, depth=1)
    table = policy.decide(probe_features(probe, CANDS), step=0)
    assert table.tolist() == [[4, 4, 4, 16, 16, 64], [8, 8, 4, 4, 4, 4]]
    assert policy.hierarchies[0].levels == [[[0, 1, 2], [3, 4], [5]]]
    assert policy.hierarchies[1].levels == [[[0, 1], [2, 3, 4, 5]]]
    # The exposed attention-mass coverage is the probe's own measurement of the new table.
    assert torch.allclose(policy.last_coverage, mass_within(probe, table).double(), atol=1e-6)
    assert (policy.last_coverage >= 0.9 - 1e-6).all()


def test_paper_statistics_cannot_tell_distances_apart():
    # Heads that put all their mass on one key 10 or 40 back have the same entropy (0), rho and output norm:
    # grouped by the nine paper statistics alone they share a group, and the group needs the whole context.
    probe = constructed_probe(designed_layers())
    policy = adaptive(2, 6, T, CANDS, feature_set="paper", depth=1)
    table = policy.decide(probe_features(probe, CANDS), step=0)
    assert policy.hierarchies[0].levels == [[[0, 1, 2], [3, 4, 5]]]
    assert table[0].tolist() == [4, 4, 4, 64, 64, 64]


def test_profile_features_measure_mass_within_each_candidate():
    probe = constructed_probe([[local_head(T, 2), distant_head(T, 10)]])
    x = probe_features(probe, CANDS)[0]
    prof = x[:, FeatureLayout(len(CANDS)).profile]
    # local-2: every query's mass lies within distance < 2 -> 1.0 from window 4 on
    assert torch.allclose(prof[0], torch.ones(5))
    # distant-10: only the 8 (resp. 10) first queries, which fall back to key 0, are inside windows 8 (resp. 16)
    assert torch.allclose(prof[1], torch.tensor([4 / 64, 8 / 64, 1.0, 1.0, 1.0]))
    rho = x[:, 8]  # mass at distance 0: local-2 keeps half of it (all at query 0); distant-10 only at query 0
    assert torch.allclose(rho, torch.tensor([(1 + 63 * 0.5) / 64, 1 / 64]))
    entropy = x[:, 6]  # normalised by ln(visible keys), over the queries that have a choice
    expected = torch.log(torch.tensor(2.0)) / torch.log(torch.arange(2, 65, dtype=torch.float32))
    assert torch.allclose(entropy, torch.stack([expected.mean(), torch.tensor(0.0)]), atol=1e-6)


def test_near_parallel_positive_statistics_that_differ_in_reach_are_separated():
    torch.manual_seed(0)
    policy = adaptive(1, 6, T, CANDS, depth=1)
    local = torch.tensor([0.95, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    far = torch.tensor([0.05, 0.1, 0.2, 0.5, 1.0], dtype=torch.float64)
    profiles = torch.stack([local, local, local, far, far, far]).unsqueeze(0)
    # Large positive q/k/v statistics, nearly equal across heads: they dominate every raw feature vector.
    paper = 40.0 + 0.01 * torch.rand(1, 6, 9, dtype=torch.float64)
    x = synthetic_features(policy, profiles, paper)
    raw = torch.nn.functional.normalize(x[0], dim=1)
    assert (raw @ raw.T).min() > 0.995  # what the reference clustered on: every head looks alike
    table = policy.decide(x, step=0)
    assert policy.hierarchies[0].levels[0] == [[0, 1, 2], [3, 4, 5]]
    assert table.tolist() == [[4, 4, 4, 64, 64, 64]]


def test_parent_constraint_holds_on_every_hierarchy():
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        depth = 1 + trial % 4
        budget = {} if trial % 3 else {"target_acr": 0.3 + 0.02 * (trial % 10)}
        threshold = 0.3 + 0.05 * (trial % 7)
        policy = adaptive(3, 8, T, CANDS, depth=depth, threshold=threshold, threshold_growth=1.6, **budget)
        profiles = random_profiles(3, 8, len(CANDS), g)
        policy.decide(synthetic_features(policy, profiles, 1 + torch.rand(3, 8, 9, generator=g)), step=0)
        for layer in range(3):
            h, wins = policy.hierarchies[layer], policy.group_windows[layer]
            for level in range(h.levels_used - 1):
                parents = h.parents(level)
                # every group lies inside its parent, and its window is no wider
                for group, p in zip(h.levels[level], parents):
                    assert set(group) <= set(h.levels[level + 1][p])
                assert all(wins[level][c] <= wins[level + 1][p] for c, p in enumerate(parents))
            assert [len(lv) for lv in h.levels] == sorted({len(lv) for lv in h.levels}, reverse=True)


def _mixed_parent_inputs(parent_constraint: bool) -> LayerInputs:
    # Five local heads and one far head under a single parent: the parent's mean profile reaches 0.9 at window 32
    # ((5 * 1.0 + 0.5) / 6), the far head alone only at 64.
    local = torch.tensor([0.7, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    far = torch.tensor([0.05, 0.1, 0.2, 0.5, 1.0], dtype=torch.float64)
    profile = torch.stack([local] * 5 + [far])
    h = Hierarchy([[[0, 1, 2, 3, 4], [5]], [[0, 1, 2, 3, 4, 5]]])
    return LayerInputs(h, profile, profile, CANDS, T, 0.9, parent_constraint=parent_constraint)


def test_parent_constraint_is_switchable():
    assert reach_allocator(_mixed_parent_inputs(True)) == [[1, 3], [3]]  # the far head is capped at the parent's 32
    assert reach_allocator(_mixed_parent_inputs(False)) == [[1, 4], [3]]  # free: it takes the full 64


@pytest.mark.parametrize("measure", ["target_acr", "target_causal_coverage"])
def test_budget_is_never_exceeded(measure):
    g = torch.Generator().manual_seed(2)
    for trial in range(30):
        target = 0.13 + 0.028 * trial
        depth = 1 + trial % 3
        policy = adaptive(
            2, 8, T, CANDS, depth=depth, threshold=0.4, parent_constraint=trial % 2 == 0, **{measure: target}
        )
        profiles = random_profiles(2, 8, len(CANDS), g)
        table = policy.decide(synthetic_features(policy, profiles, 1 + torch.rand(2, 8, 9, generator=g)), step=0)
        spend = metrics.acr if measure == "target_acr" else metrics.causal_coverage
        for layer in range(2):
            assert float(spend(table[layer], T)) <= target + 1e-9
        unlimited = adaptive(2, 8, T, CANDS, depth=depth, threshold=0.4).decide(
            synthetic_features(policy, profiles, 1 + torch.rand(2, 8, 9, generator=g)), step=0
        )
        costs = window_costs(CANDS, T, "acr" if measure == "target_acr" else "causal_coverage")
        for layer in range(2):
            biggest_top = max(len(g) for g in policy.hierarchies[layer].levels[-1])
            affordable = (target - float(costs[0])) * 8 >= biggest_top * float(costs[1] - costs[0])
            if affordable and float(spend(unlimited[layer], T)) > target + 1e-9:  # the ceiling is spent, not ignored
                assert float(spend(table[layer], T)) > float(costs[0])


def test_budget_buys_the_most_mass_it_can_afford():
    local = torch.tensor([0.9, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    mid = torch.tensor([0.2, 0.3, 0.95, 1.0, 1.0], dtype=torch.float64)
    far = torch.tensor([0.1, 0.1, 0.1, 0.2, 1.0], dtype=torch.float64)
    flat = Hierarchy([[[0], [1], [2]]])

    def windows(profiles, cover, acr):
        inp = LayerInputs(flat, torch.stack(profiles), torch.stack(profiles), CANDS, T, cover)
        return [CANDS[j] for j in allocate_within_budget([inp], "acr", acr, "layer")[0][0]]

    # Costs 1/16, 1/8, 1/4, 1/2, 1 per head. Room for one upgrade to 16 only: the mid head gains 0.75 there, the
    # far head nothing.
    assert windows([local, mid, far], 1.0, (3 / 16 + 0.1875) / 3) == [4, 16, 4]
    # Enough for everything the coverage target asks: the far head gets the whole context too.
    assert windows([local, mid, far], 0.9, 1.0) == [4, 16, 64]
    # A far head with nothing short of the whole context: room for that window alone, it beats every mix of the
    # cheaper upgrades (mass 2.1 against at most 2.05).
    far_only = torch.tensor([0.05, 0.05, 0.05, 0.05, 1.0], dtype=torch.float64)
    assert windows([local, mid, far_only], 1.0, (1 / 16 + 1 / 16 + 1) / 3) == [4, 4, 64]


def test_settled_need_is_a_dead_band_around_the_target():
    p = torch.tensor([0.5, 0.88, 0.905, 0.95, 1.0], dtype=torch.float64)
    assert settled_need(p, 0.9, 0.0, 3) == 2  # no margin: the smallest window reaching the target
    assert settled_need(p, 0.9, 0.02, 3) == 3  # 0.905 is not clearly above the target: stay at index 3
    assert settled_need(p, 0.9, 0.02, 1) == 1  # 0.88 is within the band below the target: stay at index 1
    assert settled_need(p, 0.9, 0.01, 1) == 2  # 0.88 is clearly below: grow to the need
    assert settled_need(p, 0.9, 0.02, 4) == 3  # shrink, but only to a window holding 0.92
    assert settled_need(p, 0.9, 0.02, None) == 2  # nothing held: the plain need
