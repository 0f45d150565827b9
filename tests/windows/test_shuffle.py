"""The ``shuffle`` policy (shuffle-post-select): the controller's table, permuted among each layer's heads."""

import io

import torch

from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.policy_base import POLICIES, make_policy
from aah_lightning.windows.shuffle import ShufflePolicy
from helpers.controller_inputs import controller_settings, synthetic_features

T = 64
CANDS = [4, 8, 16, 32, 64]
BATCH = {"tokens": torch.zeros(2, T + 1, dtype=torch.long), "doc_ids": torch.zeros(2, T + 1, dtype=torch.long)}


def make(policy="shuffle", seed=0, redraw_interval=0, **controller):
    settings = dict(warmup_steps=2, control_interval=3, coverage_target=0.9, depth=2, ema_alpha=0.0)
    settings.update(controller)
    cfg = AAHConfig(
        policy=policy,
        candidates=CANDS,
        seed=seed,
        redraw_interval=redraw_interval,
        controller=controller_settings(**settings),
    )
    return make_policy(cfg, 2, 6, T)


def feed(policy, features):
    """Replace the probe by a queue of constructed features (the shuffle's wrapped controller or the controller)."""
    target = policy.inner if isinstance(policy, ShufflePolicy) else policy
    queue = list(features)
    target.measure = lambda model, tokens, doc_ids=None: queue.pop(0)


def reach_profile(index: int) -> torch.Tensor:
    """A mass profile over CANDS that first reaches 0.9 at candidate ``index``."""
    m = torch.tensor([0.2 * (j + 1) / (index + 1) if j < index else 0.95 for j in range(len(CANDS))])
    m[-1] = 1.0
    return m.double()


def features(n, seed=0):
    """``n`` feature sets in which the heads of a layer need different windows (rolled from one set to the next)."""
    ref = make("adaptive")
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        idx = [[(h + i + layer) % len(CANDS) for h in range(6)] for layer in range(2)]
        profiles = torch.stack([torch.stack([reach_profile(j) for j in row]) for row in idx])
        out.append(synthetic_features(ref, profiles, torch.rand(2, 6, 9, generator=g, dtype=torch.float64) + 0.5))
    return out


def run(policy, steps):
    """The table in use after each step (the policy's initial table until it returns a new one)."""
    table, out = policy.initial_table(), []
    for step in range(steps):
        new = policy.on_train_step(step, None, BATCH)
        if new is not None:
            table = new
        out.append(table.clone())
    return out


def test_registered_and_full_during_warmup():
    assert POLICIES["shuffle"] is ShufflePolicy
    p = make()
    feed(p, features(1))
    assert (p.initial_table() == T).all()
    assert p.on_train_step(0, None, BATCH) is None and p.on_train_step(1, None, BATCH) is None


def test_each_layer_keeps_the_controllers_histogram_with_heads_permuted():
    feats = features(4)
    shuffled, chosen = make(), make("adaptive")
    feed(shuffled, feats)
    feed(chosen, feats)
    a, b = run(shuffled, 12), run(chosen, 12)  # decisions at steps 2, 5, 8, 11
    moved = 0
    for step in (2, 5, 8, 11):
        assert [t.windows for t in shuffled.report().trees] == shuffled.inner.group_windows  # the controller's groups
        for layer in range(2):
            assert sorted(a[step][layer].tolist()) == sorted(b[step][layer].tolist())  # same per-layer histogram
        moved += not torch.equal(a[step], b[step])
    assert moved >= 3  # the heads really got other heads' windows
    assert torch.equal(shuffled.inner.table, b[11])  # the wrapped controller decided exactly as the plain one


def test_permuted_at_decisions_only_unless_redraw_interval_is_set():
    p = make()
    feed(p, features(4))
    tables = run(p, 12)
    for step in range(3, 5):  # between decisions the table stays
        assert torch.equal(tables[step], tables[2])
    assert p.shuffles == 4

    q = make(redraw_interval=1)  # the authors' lab: a new permutation every step
    feed(q, features(4))
    tables = run(q, 12)
    assert q.shuffles == 10  # steps 2..11
    assert sum(not torch.equal(tables[s], tables[s - 1]) for s in range(3, 12)) >= 6


def test_seeded_and_a_resumed_policy_permutes_identically():
    feats = features(4)
    a, b, c = make(seed=1), make(seed=1), make(seed=2)
    for p in (a, b, c):
        feed(p, feats)
    ta, tb, tc = run(a, 12), run(b, 12), run(c, 12)
    assert all(torch.equal(x, y) for x, y in zip(ta, tb))
    assert any(not torch.equal(x, y) for x, y in zip(ta, tc))

    first = make(seed=1)
    feed(first, feats)
    run(first, 6)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = make(seed=1)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    feed(resumed, feats[2:])  # decisions at 2 and 5 consumed two feature sets
    later = []
    for step in range(6, 12):
        new = resumed.on_train_step(step, None, BATCH)
        later.append(new if new is not None else (later[-1] if later else resumed.table))
    assert all(torch.equal(x, y) for x, y in zip(later, ta[6:]))
