"""The ``paper`` allocator: the authors' decision procedure with untrained, seeded networks.

Checked against a literal transcription of the authors' procedure (inputs, networks, top-down argmax; docs/method.md)
written here with ``nn.Linear`` modules; deterministic for a seed; the parent constraint; no gradient path
(and weights bit-identical after training); state round-trips through ``torch.load(weights_only=True)``.
"""

import io

import pytest
import torch
import torch.nn as nn

from aah_lightning.cli import main
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.controller.allocators import LayerInputs
from aah_lightning.windows.controller.paper_allocator import PaperAllocator
from aah_lightning.windows.controller.registry import ALLOCATORS, make_allocator
from aah_lightning.windows.groups import Hierarchy
from aah_lightning.windows.policy_base import make_policy
from helpers.controller_inputs import controller_settings, random_profiles, synthetic_features

CANDS = [8, 16, 32, 64]
T = 64
# 8 heads: 4 level-0 groups, 2 parents, 1 root; a parent with 3 children leaves one child without a sibling pair.
HIERARCHY = Hierarchy([[[0, 1], [2], [3, 4], [5, 6, 7]], [[0, 1, 2, 3, 4], [5, 6, 7]], [[0, 1, 2, 3, 4, 5, 6, 7]]])
HIERARCHY_ODD = Hierarchy([[[0], [1, 2], [3], [4, 5], [6, 7]], [[0, 1, 2, 3, 4, 5], [6, 7]]])


def layer_inputs(hierarchy, seed=0, parent_constraint=True, layer=0, n_head=8):
    g = torch.Generator().manual_seed(seed)
    features = torch.zeros(n_head, 10 + len(CANDS), dtype=torch.float64)
    features[:, :9] = torch.rand(n_head, 9, generator=g, dtype=torch.float64) * 2  # positive, like the statistics
    return LayerInputs(
        hierarchy=hierarchy,
        profile=torch.ones(n_head, len(CANDS), dtype=torch.float64),
        features=features,
        candidates=CANDS,
        seq_len=T,
        coverage_target=0.9,
        parent_constraint=parent_constraint,
        layer=layer,
    )


def reference_decision(alloc: PaperAllocator, inputs: LayerInputs, joint: bool) -> list[list[int]]:
    """The reference's _select_windows, transcribed: nn.Linear networks holding the allocator's weights."""
    w = alloc.layers[inputs.layer]
    K = len(CANDS)
    controller = nn.Sequential(nn.Linear(29, 16), nn.GELU(), nn.Linear(16, K)).double()
    scorer = nn.Sequential(nn.Linear(116, 64), nn.GELU(), nn.Linear(64, 2 * K)).double()
    with torch.no_grad():
        for module, (wk, bk) in zip(
            (controller[0], controller[2], scorer[0], scorer[2]),
            (("w1", "b1"), ("w2", "b2"), ("j1", "jb1"), ("j2", "jb2")),
        ):
            module.weight.copy_(w[wk])
            module.bias.copy_(w[bk])
    levels = inputs.hierarchy.levels
    L = len(levels)
    x = inputs.features[:, :9]
    feats = [[x[g].mean(0) for g in level] for level in levels]

    def parent_of(level, group):
        head = levels[level][group][0]
        return next(p for p, pg in enumerate(levels[level + 1]) if head in pg)

    def enriched(level):
        rows = []
        for gi, f in enumerate(feats[level]):
            pdiff = f - feats[level + 1][parent_of(level, gi)] if level < L - 1 else torch.zeros(9, dtype=x.dtype)
            mean = torch.stack(feats[level]).mean(0)
            if level == 0:
                size = len(levels[0][gi]) / x.shape[0]
            else:
                kids = [c for c in range(len(levels[level - 1])) if parent_of(level - 1, c) == gi]
                size = len(kids) / len(levels[level - 1])
            rows.append(
                torch.cat(
                    [
                        f,
                        torch.tensor([level / max(1, L - 1)], dtype=x.dtype),
                        pdiff,
                        f - mean,
                        torch.tensor([size], dtype=x.dtype),
                    ]
                )
            )
        return torch.stack(rows)

    def scores(level, pairs):
        u = enriched(level)
        z = controller(u)
        if joint:
            for a, b in pairs:
                z[[a, b]] = scorer(torch.cat([u[a], u[b], u[a] - u[b], u[b] - u[a]])).view(2, K)
        return z

    with torch.no_grad():
        chosen = [None] * L
        n = len(levels[L - 1])
        chosen[L - 1] = scores(L - 1, [(i, i + 1) for i in range(0, n - 1, 2)]).argmax(-1).tolist()
        for level in range(L - 2, -1, -1):
            pairs = []
            for p in range(len(levels[level + 1])):
                kids = [c for c in range(len(levels[level])) if parent_of(level, c) == p]
                pairs += list(zip(kids[0::2], kids[1::2]))
            raw = scores(level, pairs).argmax(-1).tolist()
            if inputs.parent_constraint:
                raw = [min(r, chosen[level + 1][parent_of(level, c)]) for c, r in enumerate(raw)]
            chosen[level] = raw
    return chosen


def test_registered_and_built_with_the_reference_shapes():
    assert ALLOCATORS["paper"] is PaperAllocator
    ctl = controller_settings(allocator="paper")
    alloc = make_allocator(ctl.allocation, 3, CANDS, seed=0)
    assert len(alloc.layers) == 3
    shapes = {k: tuple(v.shape) for k, v in alloc.layers[0].items()}
    assert shapes == {
        "w1": (16, 29),
        "b1": (16,),
        "w2": (4, 16),
        "b2": (4,),
        "j1": (64, 116),
        "jb1": (64,),
        "j2": (8, 64),
        "jb2": (8,),
    }
    # PyTorch's default nn.Linear init: |w| <= 1/sqrt(fan_in)
    assert alloc.layers[0]["j1"].abs().max() <= 116**-0.5 and alloc.layers[0]["w1"].abs().max() <= 29**-0.5
    # the three layers are independent networks
    assert not torch.equal(alloc.layers[0]["w1"], alloc.layers[1]["w1"])


@pytest.mark.parametrize("hierarchy", [HIERARCHY, HIERARCHY_ODD], ids=["three-levels", "odd-children"])
@pytest.mark.parametrize("joint", [True, False])
@pytest.mark.parametrize("parent_constraint", [True, False])
def test_matches_the_transcribed_reference_procedure(hierarchy, joint, parent_constraint):
    n_head = sum(len(g) for g in hierarchy.levels[0])
    alloc = PaperAllocator(2, len(CANDS), seed=3, joint=joint)
    for seed in range(6):
        for layer in range(2):
            inputs = layer_inputs(hierarchy, seed, parent_constraint, layer, n_head)
            assert alloc(inputs) == reference_decision(alloc, inputs, joint)


def test_enriched_inputs_have_the_documented_parts():
    inputs = layer_inputs(HIERARCHY, seed=1)
    u = PaperAllocator.enriched_inputs(inputs)
    assert [tuple(x.shape) for x in u] == [(4, 29), (2, 29), (1, 29)]
    assert u[0][:, 9].tolist() == [0.0] * 4 and u[1][:, 9].tolist() == [0.5] * 2 and u[2][:, 9].tolist() == [1.0]
    assert u[0][:, 28].tolist() == pytest.approx([2 / 8, 1 / 8, 2 / 8, 3 / 8])  # heads per group
    assert u[1][:, 28].tolist() == pytest.approx([3 / 4, 1 / 4])  # child groups per parent
    assert torch.equal(u[2][:, 10:19], torch.zeros(1, 9, dtype=torch.float64))  # no parent above the top
    x = inputs.features[:, :9]
    assert torch.allclose(u[0][3, :9], x[5:8].mean(0))
    assert torch.allclose(u[0][3, 10:19], x[5:8].mean(0) - x[5:8].mean(0))  # group 3 is its parent's only child
    assert torch.allclose(u[0][0, 10:19], x[0:2].mean(0) - x[0:5].mean(0))


def test_the_joint_scorer_replaces_the_pair_logits():
    on, off = PaperAllocator(1, 4, seed=0), PaperAllocator(1, 4, seed=0, joint=False)
    differs = 0
    for seed in range(20):
        inputs = layer_inputs(Hierarchy([[[0, 1, 2, 3], [4, 5, 6, 7]]]), seed)
        differs += on(inputs) != off(inputs)
    assert differs > 0  # the joint scorer is not a no-op


def test_deterministic_for_a_seed_and_different_across_seeds():
    a, b, c = PaperAllocator(2, 4, seed=7), PaperAllocator(2, 4, seed=7), PaperAllocator(2, 4, seed=8)
    for k in a.layers[0]:
        assert torch.equal(a.layers[1][k], b.layers[1][k])
    assert not torch.equal(a.layers[0]["w1"], c.layers[0]["w1"])
    decisions = [[a(layer_inputs(HIERARCHY, s)) for s in range(10)], [b(layer_inputs(HIERARCHY, s)) for s in range(10)]]
    assert decisions[0] == decisions[1]


def test_parent_constraint_holds_and_turning_it_off_frees_children():
    alloc = PaperAllocator(1, 4, seed=0)
    wider = 0
    for seed in range(40):
        for constrained in (True, False):
            chosen = alloc(layer_inputs(HIERARCHY, seed, constrained))
            for level in range(2):
                for g, p in enumerate(HIERARCHY.parents(level)):
                    if constrained:
                        assert chosen[level][g] <= chosen[level + 1][p]
                    else:
                        wider += chosen[level][g] > chosen[level + 1][p]
    assert wider > 0  # without the constraint the untrained scorer does put children above their parent


def test_the_networks_have_no_gradient_path():
    alloc = PaperAllocator(1, 4, seed=0)
    assert all(not t.requires_grad for t in alloc.layers[0].values())
    inputs = layer_inputs(HIERARCHY, 0)
    inputs.features.requires_grad_(True)
    chosen = alloc(inputs)
    assert all(isinstance(i, int) for level in chosen for i in level)  # indices, nothing differentiable comes out


def test_weights_are_untouched_by_training_and_outside_the_optimizer(tmp_path, tiny_args):
    main(
        tiny_args(
            "--model.aah.policy=adaptive",
            "--model.aah.candidates=[4,8,16,32]",
            "--model.aah.seed=5",
            "--model.aah.controller.allocation.allocator=paper",
            "--model.aah.controller.schedule.warmup_steps=2",
            "--model.aah.controller.schedule.control_interval=2",
            steps=6,
        )
    )
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    state = ckpt["aah_policy"]
    assert state["decisions"] == 2  # steps 2 and 4
    fresh = PaperAllocator(2, 4, seed=5)
    for saved, init in zip(state["allocator"]["layers"], fresh.layers):
        for k in init:
            assert torch.equal(saved[k], init[k]), k  # bit-identical to the seeded initialisation
    # AdamW never saw them: none of its moment tensors has a scorer's shape, and the model's weights do not hold them
    shapes = {tuple(v["exp_avg"].shape) for v in ckpt["optimizer_states"][0]["state"].values()}
    assert shapes and not shapes & {(16, 29), (4, 16), (64, 116), (8, 64)}
    assert not any(tuple(v.shape) in {(16, 29), (64, 116)} for v in ckpt["state_dict"].values())


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_policy_state_round_trips_and_a_resumed_policy_decides_identically():
    def policy(seed):
        cfg = AAHConfig(
            policy="adaptive",
            candidates=CANDS,
            seed=seed,
            controller=controller_settings(allocator="paper", depth=3, warmup_steps=0, control_interval=1),
        )
        return make_policy(cfg, 2, 8, T)

    g = torch.Generator().manual_seed(0)
    a = policy(0)
    x = [
        synthetic_features(a, random_profiles(2, 8, len(CANDS), g), torch.rand(2, 8, 9, generator=g) + 0.5)
        for _ in range(4)
    ]
    a.decide(x[0], 0)
    a.decide(x[1], 1)
    b = policy(99)  # another seed: different networks until the state is loaded
    assert not torch.equal(a.allocator.layers[0]["w1"], b.allocator.layers[0]["w1"])
    b.load_state_dict(_roundtrip(a.state_dict()))
    for k in a.allocator.layers[1]:
        assert torch.equal(a.allocator.layers[1][k], b.allocator.layers[1][k])
    for i, step in ((2, 2), (3, 3)):
        assert torch.equal(a.decide(x[i], step), b.decide(x[i], step))
    assert a.group_windows == b.group_windows
