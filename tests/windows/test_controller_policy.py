"""The adaptive policy: schedule (warmup, interval, freeze, reuse), EMA, grouping variants, settings, state."""

import io
from dataclasses import asdict

import pytest
import torch

from aah_lightning.checkpoint import FLAT_CONTROLLER_SETTINGS
from aah_lightning.errors import ConfigError
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.windows.config import AAHConfig, ControllerConfig
from aah_lightning.windows.controller.adaptive import AdaptivePolicy
from aah_lightning.windows.policy_base import POLICIES, make_policy
from helpers.controller_inputs import adaptive, controller_settings, synthetic_features

T = 64
CANDS = [4, 8, 16, 32, 64]
LOCAL = torch.tensor([0.95, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
FAR = torch.tensor([0.05, 0.1, 0.2, 0.5, 1.0], dtype=torch.float64)
MID = torch.tensor([0.2, 0.4, 0.95, 1.0, 1.0], dtype=torch.float64)


class NoModel:
    """Stands in for the model where the controller must not probe: any use fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the controller touched the model ({name}) outside a control step")


class FeatureFeed(AdaptivePolicy):
    """An adaptive policy whose probe is replaced by a queue of constructed features."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.feed = []

    def measure(self, model, tokens, doc_ids=None):
        return self.feed.pop(0)


def feed_policy(n_layer=1, n_head=6, **controller) -> FeatureFeed:
    settings = dict(warmup_steps=0, control_interval=1)
    settings.update(controller)
    cfg = AAHConfig(policy="adaptive", candidates=CANDS, controller=controller_settings(**settings))
    cfg.validate(T, n_layer, n_head)
    return FeatureFeed(cfg, n_layer, n_head, T)


BATCH = {"tokens": torch.zeros(2, T + 1, dtype=torch.long), "doc_ids": torch.zeros(2, T + 1, dtype=torch.long)}


def feats(policy, *rows):
    return synthetic_features(policy, torch.stack(rows).unsqueeze(0))


def test_adaptive_is_registered_and_starts_full():
    assert POLICIES["adaptive"] is AdaptivePolicy
    policy = adaptive(2, 4, T, CANDS, warmup_steps=10)
    assert policy.initial_table().tolist() == [[T] * 4] * 2


def test_schedule_warmup_interval_and_freeze():
    policy = feed_policy(warmup_steps=10, control_interval=5, freeze_after=20)
    decided = []
    for step in range(40):
        if policy.is_control_step(step):
            policy.feed.append(feats(policy, LOCAL, LOCAL, LOCAL, FAR, FAR, MID))
            assert policy.on_train_step(step, None, BATCH) is not None or policy.decisions > 1
            decided.append(step)
        else:
            assert policy.on_train_step(step, NoModel(), BATCH) is None  # no probe, no decision
    assert decided == [10, 15, 20]
    assert policy.decisions == 3 and policy.last_step == 20


def test_unchanged_decision_returns_none_and_changes_return_the_table():
    policy = feed_policy()
    policy.feed += [feats(policy, LOCAL, LOCAL, LOCAL, FAR, FAR, FAR)] * 2 + [feats(policy, *[FAR] * 6)]
    assert policy.on_train_step(0, None, BATCH).tolist() == [[4, 4, 4, 64, 64, 64]]
    assert policy.on_train_step(1, None, BATCH) is None
    # alpha 0.5: the EMA of the local heads is now 0.5 * LOCAL + 0.5 * FAR, which needs window 64 (0.75 at 32)
    assert policy.on_train_step(2, None, BATCH).tolist() == [[64] * 6]


def test_ema_smooths_and_alpha_zero_disables_it():
    a = feats(feed_policy(), LOCAL, FAR, MID, LOCAL, FAR, MID)
    b = feats(feed_policy(), FAR, LOCAL, LOCAL, MID, MID, FAR)
    smooth, raw = feed_policy(ema_alpha=0.75), feed_policy(ema_alpha=0.0)
    for policy in (smooth, raw):
        policy.decide(a, 0)
        policy.decide(b, 1)
    assert torch.allclose(smooth.ema, 0.75 * a + 0.25 * b)
    assert torch.equal(raw.ema, b)


def test_reuse_groups_freezes_level0_but_keeps_allocating():
    policy = feed_policy(reuse_groups=True, depth=1)
    policy.decide(feats(policy, LOCAL, LOCAL, LOCAL, FAR, FAR, FAR), 0)
    first = policy.hierarchies[0].levels[0]
    assert first == [[0, 1, 2], [3, 4, 5]]
    # The heads trade places; a fresh grouping would follow them, the reused one keeps the first partition.
    table = policy.decide(feats(policy, FAR, FAR, FAR, LOCAL, LOCAL, LOCAL), 1)
    assert policy.hierarchies[0].levels[0] == first
    fresh = feed_policy(depth=1, ema_alpha=0.0)
    fresh.decide(feats(fresh, LOCAL, LOCAL, LOCAL, FAR, FAR, FAR), 0)
    fresh.decide(feats(fresh, LOCAL, FAR, LOCAL, FAR, LOCAL, FAR), 1)
    assert fresh.hierarchies[0].levels[0] == [[0, 2, 4], [1, 3, 5]]
    # Windows are still re-allocated from the (EMA) profiles: both groups now need the whole context.
    assert table.tolist() == [[64] * 6]


def test_grouping_none_and_fixed_random():
    policy = feed_policy(grouping="none", depth=1)
    policy.decide(feats(policy, LOCAL, LOCAL, LOCAL, FAR, FAR, MID), 0)
    assert policy.hierarchies[0].levels == [[[h] for h in range(6)]]

    def random_run(seed):
        cfg = AAHConfig(
            policy="adaptive",
            candidates=CANDS,
            seed=seed,
            controller=controller_settings(grouping="fixed_random", random_groups=3, warmup_steps=0, depth=1),
        )
        p = FeatureFeed(cfg, 4, 6, T)
        x = synthetic_features(p, torch.stack([LOCAL, LOCAL, LOCAL, FAR, FAR, MID]).expand(4, 6, 5))
        p.decide(x, 0)
        parts = [h.levels[0] for h in p.hierarchies]
        p.decide(x.flip(1), 1)  # new features do not move a fixed partition
        assert [h.levels[0] for h in p.hierarchies] == parts
        return parts

    parts = random_run(0)
    assert all(sorted(len(g) for g in part) == [2, 2, 2] for part in parts)
    assert len({str(p) for p in parts}) > 1  # drawn per layer, not one split for the whole model
    assert random_run(0) == parts and random_run(1) != parts


@pytest.mark.parametrize(
    "settings, name",
    [
        (dict(feature_set="attention"), "feature_set"),
        (dict(grouping="kmeans"), "grouping"),
        (dict(metric="manhattan"), "metric"),
        (dict(allocator="oracle"), "allocator"),
        (dict(coverage_target=0.0), "coverage_target"),
        (dict(coverage_target=1.5), "coverage_target"),
        (dict(ema_alpha=1.0), "ema_alpha"),
        (dict(target_acr=0.01), "target_acr"),  # window 4 of 64 already costs 0.0625
        (dict(target_causal_coverage=0.05), "target_causal_coverage"),
        (dict(target_acr=0.5, target_causal_coverage=0.5), "target_acr"),
        (dict(warmup_steps=100, freeze_after=50), "freeze_after"),
        (dict(min_group_size=7), "min_group_size"),
        (dict(depth=0), "depth"),
        (dict(control_interval=0), "control_interval"),
    ],
)
def test_bad_settings_name_the_setting(settings, name):
    cfg = AAHConfig(policy="adaptive", candidates=CANDS, controller=controller_settings(**settings))
    block, field = FLAT_CONTROLLER_SETTINGS[name]  # the setting's place in the controller's blocks
    with pytest.raises(ConfigError, match=rf"model\.aah\.controller\.{block}\.{field}"):
        make_policy(cfg, 2, 6, T)


def test_settings_travel_as_plain_dicts():
    aah = AAHConfig(policy="adaptive", controller=controller_settings(depth=3, target_acr=0.4))
    again = AAHConfig(**asdict(aah))
    assert again == aah and isinstance(again.controller, ControllerConfig)
    module = AAHModule(gpt=GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=T), aah=asdict(aah))
    assert isinstance(module.policy, AdaptivePolicy) and module.policy.settings.groups.depth == 3
    assert module.hparams["aah"]["controller"]["budget"]["target_acr"] == 0.4


# -- checkpoint round trip on a real (tiny) model --------------------------------------------------------------------


def _train_and_control(model, policy, opt, steps, data):
    tables = []
    for step in steps:
        table = policy.on_train_step(step, model, data[step])
        if table is not None:
            model.set_windows(table)
        tables.append(model.windows.clone())
        logits = model(data[step]["tokens"][:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[step]["tokens"][:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return tables


def _fresh(grouping):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=T, n_layer=2, n_head=4, n_embd=32, backend="sdpa"))
    cfg = AAHConfig(
        policy="adaptive",
        candidates=CANDS,
        seed=3,
        controller=controller_settings(
            grouping=grouping,
            warmup_steps=2,
            control_interval=3,
            ema_alpha=0.5,
            probe_queries=16,
            depth=2,
            threshold=0.5,
            target_acr=0.4,  # a ceiling, so that decisions differ from the full context
            settle_margin=0.0,  # every decision may move windows, so that the resume is tested on moving tables
        ),
    )
    policy = make_policy(cfg, 2, 4, T)
    model.set_windows(policy.initial_table())
    return model, policy, torch.optim.SGD(model.parameters(), lr=0.5)


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("grouping", ["cluster", "fixed_random"])
def test_checkpoint_round_trip_gives_identical_state_and_decisions(grouping):
    g = torch.Generator().manual_seed(0)
    data = [
        {"tokens": torch.randint(0, 32, (4, T + 1), generator=g), "doc_ids": torch.zeros(4, T + 1, dtype=torch.long)}
        for _ in range(15)
    ]
    model, policy, opt = _fresh(grouping)
    straight = _train_and_control(model, policy, opt, range(15), data)

    model, policy, opt = _fresh(grouping)
    first = _train_and_control(model, policy, opt, range(9), data)
    saved = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "aah_policy": policy.state_dict()})
    model, policy, opt = _fresh(grouping)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    policy.load_state_dict(saved["aah_policy"])
    _same_state(policy.state_dict(), saved["aah_policy"])
    resumed = first + _train_and_control(model, policy, opt, range(9, 15), data)

    assert policy.decisions == 5  # steps 2, 5, 8, 11, 14
    assert len({str(t.tolist()) for t in straight}) > 2  # the windows really moved
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    model_a, policy_a, opt_a = _fresh(grouping)
    _train_and_control(model_a, policy_a, opt_a, range(15), data)
    _same_state(policy_a.state_dict(), policy.state_dict())


def test_diagnostics_read_the_decision_from_the_policy_and_from_its_checkpointed_state():
    from aah_lightning.windows import metrics as diagnostics

    policy = feed_policy(n_layer=2, depth=2, threshold=0.5)
    assert policy.report().trees is None and policy.report().last_step is None  # before the first decision
    rows = torch.stack([torch.stack([LOCAL, LOCAL, MID, MID, FAR, FAR]), torch.stack([LOCAL] * 5 + [FAR])])
    table = policy.decide(synthetic_features(policy, rows), step=7)
    state = _roundtrip(policy.state_dict())
    for report in (policy.report(), AdaptivePolicy.report_from_state(state, CANDS)):
        trees = report.trees
        assert [t.levels for t in trees] == [h.levels for h in policy.hierarchies]
        assert [t.windows for t in trees] == policy.group_windows
        assert diagnostics.group_stats(trees) == (
            [h.levels_used for h in policy.hierarchies],
            [h.group_counts for h in policy.hierarchies],
        )
        assert report.last_step == 7 and report.candidates == CANDS
    assert [t.windows[0] for t in policy.report().trees] == [
        [int(table[layer, g[0]]) for g in policy.hierarchies[layer].levels[0]] for layer in range(2)
    ]
