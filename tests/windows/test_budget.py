"""Budgets per layer and for the whole model against brute force; per-head allocation; budgets over the run."""

import itertools
import math

import pytest
import torch

from aah_lightning.errors import ConfigError
from aah_lightning.windows import metrics
from aah_lightning.windows.controller import budget
from aah_lightning.windows.controller.allocators import LayerInputs, needed_index
from aah_lightning.windows.groups import Hierarchy
from aah_lightning.windows.metrics import window_costs
from helpers.controller_inputs import adaptive, controller_settings, random_profiles, synthetic_features


def random_hierarchy(n_head: int, g: torch.Generator) -> Hierarchy:
    """Random level-0 groups, then up to two coarser levels that merge random neighbours."""
    perm = torch.randperm(n_head, generator=g).tolist()
    cuts = sorted(set(torch.randint(1, n_head, (2,), generator=g).tolist()))
    level0 = [sorted(perm[a:b]) for a, b in zip([0, *cuts], [*cuts, n_head])]
    levels = [level0]
    while len(levels[-1]) > 1 and torch.rand(1, generator=g).item() < 0.7:
        prev = levels[-1]
        k = int(torch.randint(1, len(prev), (1,), generator=g))
        levels.append([sorted(prev[0] + prev[k])] + [grp for i, grp in enumerate(prev) if i not in (0, k)])
    return Hierarchy(levels)


def brute_force(layers: list[LayerInputs], per_head: list[float], budget: float, scope: str):
    """The best size-weighted mass over every assignment of a window to every level-0 group (each at most the
    smallest candidate reaching the coverage target of its own profile), the heads' total cost within the budget:
    per layer (``scope="layer"``, the mass summed over layers) or over all layers. Enumerated per layer, then
    combined."""
    options = []
    for inp in layers:
        h = inp.hierarchy
        limits = [needed_index(inp.profile[grp].mean(0), inp.coverage_target) for grp in h.levels[0]]
        best: dict[float, float] = {}
        for pick in itertools.product(*[range(lim + 1) for lim in limits]):
            cost = round(sum(len(grp) * per_head[j] for grp, j in zip(h.levels[0], pick)), 9)
            mass = sum(len(grp) * float(inp.profile[grp].mean(0)[j]) for grp, j in zip(h.levels[0], pick))
            best[cost] = max(best.get(cost, -1.0), mass)
        options.append(sorted(best.items()))
    if scope == "layer":
        return sum(
            max(m for c, m in opts if c <= budget * inp.profile.shape[0] + 1e-9) for opts, inp in zip(options, layers)
        )
    total = budget * sum(inp.profile.shape[0] for inp in layers)
    top = -1.0
    for combo in itertools.product(*options):
        if sum(c for c, _ in combo) <= total + 1e-9:
            top = max(top, sum(m for _, m in combo))
    return top


def objective(layers, chosen, per_head):
    mass = cost = 0.0
    for inp, ch in zip(layers, chosen):
        for grp, j in zip(inp.hierarchy.levels[0], ch[0]):
            mass += len(grp) * float(inp.profile[grp].mean(0)[j])
            cost += len(grp) * per_head[j]
    return mass, cost


@pytest.mark.parametrize("scope", ["layer", "model"])
@pytest.mark.parametrize("measure", ["acr", "causal_coverage"])
def test_budget_matches_brute_force_and_never_exceeds(measure, scope):
    g = torch.Generator().manual_seed(7)
    for trial in range(25):
        n_layer, n_head = int(torch.randint(2, 4, (1,), generator=g)), int(torch.randint(2, 5, (1,), generator=g))
        T = 32
        cands = [4, 8, 16, 32] if trial % 2 else [2, 6, 16, 40]  # 40 > T: clipped, the whole context
        profiles = random_profiles(n_layer, n_head, len(cands), g)
        target = float(torch.empty(1).uniform_(0.2, 0.9, generator=g))
        cover = 1.0 if trial % 3 else 0.8
        sink = 3 if trial % 3 == 1 else 0  # an attention sink: every candidate costs its pairs more
        layers = [
            LayerInputs(
                hierarchy=random_hierarchy(n_head, g),
                profile=profiles[layer],
                features=profiles[layer],
                candidates=cands,
                seq_len=T,
                coverage_target=cover,
                parent_constraint=bool(trial % 4),
                sink=sink,
            )
            for layer in range(n_layer)
        ]
        per_head = window_costs(cands, T, measure, sink).tolist()
        if target < per_head[0]:
            continue
        chosen = budget.allocate_within_budget(layers, measure, target, scope)
        mass, cost = objective(layers, chosen, per_head)
        assert cost <= target * n_layer * n_head + 1e-9, trial
        if scope == "layer":
            for inp, ch in zip(layers, chosen):
                assert objective([inp], [ch], per_head)[1] <= target * n_head + 1e-9, trial
        best = brute_force(layers, per_head, target, scope)
        assert mass >= 0.99 * best - 1e-9, (trial, mass, best)
        assert mass <= best + 1e-9, (trial, mass, best)  # the brute force is the optimum: the allocator cannot beat it
        for inp, ch in zip(layers, chosen):  # the parent constraint holds at every level
            h = inp.hierarchy
            for lvl in range(len(h.levels) - 1):
                assert all(ch[lvl][c] <= ch[lvl + 1][p] for c, p in enumerate(h.parents(lvl)))


def test_coarse_grid_rounds_costs_up_and_stays_within_budget(monkeypatch):
    # Large budgets in integer units are solved on a coarser grid: never over the budget, and close to the optimum.
    monkeypatch.setattr(budget, "MAX_UNITS", 7)
    g = torch.Generator().manual_seed(3)
    cands, T = [4, 8, 16, 32], 32
    per_head = window_costs(cands, T, "acr").tolist()
    for _ in range(10):
        profiles = random_profiles(2, 3, 4, g)
        layers = [
            LayerInputs(
                hierarchy=Hierarchy([[[h] for h in range(3)]]),
                profile=profiles[i],
                features=profiles[i],
                candidates=cands,
                seq_len=T,
                coverage_target=1.0,
            )
            for i in range(2)
        ]
        chosen = budget.allocate_within_budget(layers, "acr", 0.45)
        _, cost = objective(layers, chosen, per_head)
        assert cost <= 0.45 * 6 + 1e-9


def test_knapsack_exact_on_a_hand_case():
    # Two groups; capacity 5: (a=1 for cost 1, or 4 for cost 4) and (b=2 for cost 1, or 3 for cost 2): best 4 + 2.
    picks = budget.multiple_choice_knapsack(
        [torch.tensor([1.0, 4.0], dtype=torch.float64), torch.tensor([2.0, 3.0], dtype=torch.float64)],
        [[1, 4], [1, 2]],
        5,
    )
    assert picks == [1, 0]
    # equal value: the cheaper item
    assert budget.multiple_choice_knapsack([torch.tensor([1.0, 1.0], dtype=torch.float64)], [[1, 3]], 5) == [0]


def test_a_sink_is_paid_for_out_of_the_budget():
    """With model.aah.sink the controller's costs include the sink's pairs: the table it chooses meets the target as
    the run measures it (ACR with the sink), so the sink leaves less for the windows than without one."""
    cands, T, target = [4, 8, 16, 32], 32, 0.375
    prof = torch.tensor([[[0.1, 0.2, 0.4, 1.0]] * 4, [[0.5, 0.7, 0.9, 1.0]] * 4], dtype=torch.float64)
    tables = {}
    for sink in (0, 4):
        policy = adaptive(
            2, 4, T, cands, sink=sink, grouping="none", depth=1, coverage_target=1.0, target_acr=target,
            budget_scope="model",
        )  # fmt: skip
        assert policy.budget.costs.tolist() == metrics.window_costs(cands, T, "acr", sink).tolist()
        tables[sink] = policy.decide(synthetic_features(policy, prof), step=0)
        assert float(metrics.acr(tables[sink], T, sink)) <= target + 1e-12
        assert policy.budget.table_cost(tables[sink]) == float(metrics.acr(tables[sink], T, sink))
    assert float(metrics.acr(tables[0], T, 4)) > target  # the table chosen without the sink would overspend with it
    assert tables[4].sum() < tables[0].sum()


def test_policy_with_model_budget_spends_across_layers():
    # Layer 0's heads need long windows, layer 1's need none: a per-layer ceiling gives each layer the same spend,
    # the whole-model budget moves layer 1's share to layer 0 and keeps more mass at the same model-wide ACR.
    cands, T = [4, 8, 16, 32], 32
    prof = torch.tensor([[[0.1, 0.2, 0.4, 1.0]] * 4, [[0.97, 0.98, 0.99, 1.0]] * 4], dtype=torch.float64)
    tables = {}
    for scope in ("layer", "model"):
        policy = adaptive(
            2, 4, T, cands, grouping="none", depth=1, coverage_target=1.0, target_acr=0.375, budget_scope=scope
        )
        tables[scope] = policy.decide(synthetic_features(policy, prof), step=0)
        assert float(metrics.acr(tables[scope], T)) <= 0.375 + 1e-12
    assert tables["model"][1].tolist() == [4, 4, 4, 4]
    kept = {
        s: float(prof.gather(-1, torch.searchsorted(torch.tensor(cands), t).long().unsqueeze(-1)).sum())
        for s, t in tables.items()
    }
    assert kept["model"] > kept["layer"]


FAR = [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]  # a head that needs the whole context (T = 1024)
NEAR = [1.0] * 6  # a head whose mass lies within 32 tokens
HIERARCHIES = {
    "flat": Hierarchy([[[0], [1], [2], [3]]]),
    "one root": Hierarchy([[[0], [1], [2], [3]], [[0, 1, 2, 3]]]),
    "three levels": Hierarchy([[[0], [1], [2], [3]], [[0, 1], [2, 3]], [[0, 1, 2, 3]]]),
}


@pytest.mark.parametrize("scope", ["layer", "model"])
@pytest.mark.parametrize("shape", list(HIERARCHIES))
@pytest.mark.parametrize("cover", [1.0, 0.9])
def test_one_far_head_and_three_near_heads_get_exactly_their_windows(scope, shape, cover):
    # ACR 0.3 affords one head at T and three at 32 (0.273) but not a second wide head: the allocation is exactly
    # that, whatever the hierarchy above the heads (sharing a root's spend would give every head one window).
    cands, T = [32, 64, 128, 256, 512, 1024], 1024
    profile = torch.tensor([FAR, NEAR, NEAR, NEAR], dtype=torch.float64)
    layers = [LayerInputs(HIERARCHIES[shape], profile, profile, cands, T, cover) for _ in range(2)]
    for chosen in budget.allocate_within_budget(layers, "acr", 0.3, scope):
        assert [cands[j] for j in chosen[0]] == [1024, 32, 32, 32]
        if len(chosen) > 1:  # the root takes its widest child
            assert chosen[-1] == [5]


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_the_policy_gives_one_far_head_the_whole_context_at_both_scopes(scope):
    # Through the adaptive policy: its grouping and a two-level hierarchy, one decision.
    cands, T = [32, 64, 128, 256, 512, 1024], 1024
    prof = torch.tensor([[FAR, NEAR, NEAR, NEAR]] * 2, dtype=torch.float64)
    policy = adaptive(2, 4, T, cands, depth=2, threshold=0.5, coverage_target=1.0, target_acr=0.3, budget_scope=scope)
    table = policy.decide(synthetic_features(policy, prof), step=0)
    assert table.tolist() == [[1024, 32, 32, 32]] * 2


@pytest.mark.parametrize("scope", ["layer", "model"])
@pytest.mark.parametrize("measure", ["acr", "causal_coverage"])
def test_never_below_the_best_single_window_for_all_heads(measure, scope):
    # One window for all heads is always a feasible choice, so at any budget the exact allocation keeps at least the
    # mass of the best uniform window that costs no more.
    g = torch.Generator().manual_seed(11)
    cands, T = [8, 16, 32, 64, 128], 128
    per_head = window_costs(cands, T, measure).tolist()
    for trial in range(40):
        n_layer, n_head = 3, int(torch.randint(2, 9, (1,), generator=g))
        profiles = random_profiles(n_layer, n_head, len(cands), g)
        layers = [
            LayerInputs(random_hierarchy(n_head, g), profiles[i], profiles[i], cands, T, 1.0) for i in range(n_layer)
        ]
        target = float(torch.empty(1).uniform_(per_head[0], 1.0, generator=g))
        chosen = budget.allocate_within_budget(layers, measure, target, scope)
        mass, _ = objective(layers, chosen, per_head)
        uniform = max(float(profiles[..., j].sum()) for j, c in enumerate(per_head) if c <= target + 1e-12)
        assert mass >= uniform - 1e-9, (trial, mass, uniform)


def test_budget_over_run_pays_for_warmup_and_meets_the_mean():
    # warmup 10 of 100 steps at full context, then a decision every 10 steps: the run's mean ACR is the target.
    cands, T, N = [4, 8, 16, 32], 32, 100
    g = torch.Generator().manual_seed(0)
    policy = adaptive(
        2,
        4,
        T,
        cands,
        grouping="none",
        depth=1,
        coverage_target=1.0,
        target_acr=0.3,
        budget_scope="model",
        budget_over_run=True,
        warmup_steps=10,
        control_interval=10,
    )
    policy.set_run_length(N)
    paid, table, last = 0.0, policy.initial_table(), 0
    for step in range(10, N, 10):
        paid += float(metrics.acr(table, T)) * (step - last)
        table = policy.decide(synthetic_features(policy, random_profiles(2, 4, 4, g)), step)
        last = step
    paid += float(metrics.acr(table, T)) * (N - last)
    assert abs(paid / N - 0.3) <= 0.01
    assert float(metrics.acr(table, T)) < 0.3  # after warmup it must spend less than the target


def test_budget_over_run_state_resumes_identically():
    cands, T = [4, 8, 16, 32], 32
    g = torch.Generator().manual_seed(1)
    feats_seq = [random_profiles(2, 4, 4, g) for _ in range(4)]
    kwargs = {
        "grouping": "none",
        "depth": 1,
        "coverage_target": 1.0,
        "target_acr": 0.4,
        "budget_scope": "model",
        "budget_over_run": True,
        "warmup_steps": 5,
        "control_interval": 5,
    }
    a = adaptive(2, 4, T, cands, **kwargs)
    a.set_run_length(40)
    for i, p in enumerate(feats_seq[:2]):
        a.decide(synthetic_features(a, p), 5 + 5 * i)
    b = adaptive(2, 4, T, cands, **kwargs)
    b.load_state_dict(a.state_dict())
    b.set_run_length(40)
    for i, p in enumerate(feats_seq[2:]):
        step = 15 + 5 * i
        assert torch.equal(a.decide(synthetic_features(a, p), step), b.decide(synthetic_features(b, p), step))


def test_unreachable_run_mean_is_one_clear_error():
    policy = adaptive(1, 4, 32, [4, 8, 16, 32], target_acr=0.15, budget_over_run=True, warmup_steps=10)
    with pytest.raises(ConfigError, match=r"target_acr=0\.15 cannot be the mean over this run"):
        policy.set_run_length(20)  # 10 steps at 1.0 and 10 at 0.125 average 0.5625


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"budget_scope": "global"}, r"budget\.scope='global' is not allowed: layer or model"),
        ({"budget_scope": "model"}, r"budget\.scope='model' is not allowed: only with a budget"),
        ({"budget_over_run": True}, r"budget\.over_run=True is not allowed: only with a budget"),
        ({"budget_scope": "model", "target_acr": 0.5, "allocator": "paper"}, "does not take a compute budget"),
        ({"target_acr": 0.5, "allocator": "paper"}, r"allocation\.allocator='paper' does not take a compute budget"),
    ],
)
def test_budget_settings_are_checked(settings, match):
    with pytest.raises(ConfigError, match=match):
        controller_settings(**settings).validate([4, 8, 16, 32], 32, 4)


def test_integer_costs_are_the_measures_numerators():
    for measure, sink in itertools.product(("acr", "causal_coverage"), (0, 3)):
        nums, den = budget.integer_costs([4, 8, 16, 40], 32, measure, sink)
        want = window_costs([4, 8, 16, 40], 32, measure, sink)
        assert torch.allclose(torch.tensor(nums, dtype=torch.float64) / den, want, rtol=1e-15, atol=0)
        assert all(isinstance(n, int) for n in nums) and math.gcd(*nums) >= 1


def test_random_windows_with_a_table_draw_its_exact_histogram():
    from aah_lightning.windows.config import AAHConfig
    from aah_lightning.windows.policy_base import make_policy

    table = [[8, 8, 16, 32], [4, 4, 8, 16]]
    policy = make_policy(AAHConfig(policy="random", random={"table": table, "redraw_interval": 1}, seed=3), 2, 4, 32)
    draws = [policy.initial_table()] + [policy.on_train_step(s, None, None) for s in range(1, 6)]
    for draw in draws:
        assert sorted(draw.flatten().tolist()) == sorted(w for row in table for w in row)  # the same ACR
    assert len({tuple(d.flatten().tolist()) for d in draws}) > 1  # placed differently
    with pytest.raises(ConfigError, match="the random policy needs n_layer=2 rows"):
        make_policy(AAHConfig(policy="random", random={"table": [[8, 8]]}), 2, 4, 32)


def test_a_real_run_pays_its_target_on_average(tmp_path, tiny_args):
    # aah fit with the whole-model budget over the run: the LightningModule tells the policy the run's length, and
    # the ACR of every step (logged at every change of the table) averages to the target.
    from aah_lightning.cli import main
    from helpers.tb import read_events

    main(
        tiny_args(
            "--model.aah.policy=adaptive",
            "--model.aah.candidates=[4,8,16,32]",
            "--model.aah.controller.schedule.warmup_steps=2",
            "--model.aah.controller.schedule.control_interval=2",
            "--model.aah.controller.allocation.coverage_target=1.0",
            "--model.aah.controller.budget.target_acr=0.4",
            "--model.aah.controller.budget.scope=model",
            "--model.aah.controller.budget.over_run=true",
            "--model.aah.controller.settle.margin=0",  # every decision spends its ceiling (settling may spend less)
            "--diagnostics.every_n_steps=1",
            steps=12,
        )
    )
    acr = sorted(read_events(tmp_path / "runs")["scalars"]["aah/acr"])
    assert [s for s, _ in acr] == list(range(1, 13))  # the table of every step: logged after steps 1..12
    assert abs(sum(v for _, v in acr) / 12 - 0.4) <= 0.01
    assert acr[0][1] == 1.0 and acr[-1][1] < 0.4  # warmup at full context, paid for afterwards
