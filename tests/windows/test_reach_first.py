"""Reach first and the gain signal: the controller's two ways of finding the heads that need context from step 0.

A tiny task whose answer is known: every target repeats the token ``DISTANCE`` back, so one head must see that far
and nothing else needs to. Trained by hand (no Lightning) for a few hundred steps on the CPU's banded backend.
"""

import pytest
import torch
import torch.nn.functional as F

from aah_lightning.errors import ConfigError
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.windows.config import AAHConfig, ControllerConfig
from aah_lightning.windows.controller.allocators import LayerInputs
from aah_lightning.windows.controller.budget import allocate_within_budget
from aah_lightning.windows.controller.gain import run_gain_probe
from aah_lightning.windows.groups import Hierarchy
from aah_lightning.windows.policy_base import make_policy
from helpers.controller_inputs import controller_settings

T, VOCAB, DISTANCE, HEADS = 32, 16, 20, 4
CANDS = [4, 8, 16, 32]


def copy_batch(g: torch.Generator, n: int = 16) -> dict:
    """Token t repeats token t - DISTANCE; only those targets count (``loss_mask``)."""
    x = torch.randint(0, VOCAB, (n, T + 1), generator=g)
    x[:, DISTANCE:] = x[:, : T + 1 - DISTANCE].clone()
    mask = torch.zeros(n, T, dtype=torch.bool)
    mask[:, DISTANCE - 1 :] = True
    return {"tokens": x, "loss_mask": mask}


def loss_of(model: GPT, batch: dict) -> torch.Tensor:
    inputs, targets, mask = batch["tokens"][:, :-1], batch["tokens"][:, 1:], batch["loss_mask"]
    losses = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="none")
    return (losses * mask.flatten()).sum() / mask.sum()


def train(model: GPT, steps: int, policy=None, seed: int = 1) -> tuple[float, list[torch.Tensor]]:
    """Train ``model`` (the policy deciding before each step, as the LightningModule does); the last loss, tables."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    tables = []
    for step in range(steps):
        batch = copy_batch(g)
        if policy is not None:
            table = policy.on_train_step(step, model, batch)
            if table is not None:
                model.set_windows(table)
        tables.append(model.windows.clone())
        loss = loss_of(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach()), tables


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=T, n_layer=1, n_head=HEADS, n_embd=64))


def reach_first(signal: str, formation: int = 100, target: float = 0.35) -> ControllerConfig:
    return controller_settings(
        signal=signal,
        explorers=1,
        formation_steps=formation,
        warmup_steps=0,
        control_interval=25,
        coverage_target=1.0,
        target_acr=target,
        budget_scope="model",
        budget_over_run=True,
        grouping="none",
        probe_queries=32,
    )


@pytest.mark.parametrize("signal", ["mass", "gain"])
def test_an_explorer_learns_to_use_its_reach_and_keeps_it(signal):
    """From step 0 head 0 holds the whole context (the explorer table costs ACR 0.344, within the budget 0.35); the
    task needs it; after formation the signal measures that need, so the reach stays, and the loss is solved."""
    model = tiny_model()
    policy = make_policy(AAHConfig(policy="adaptive", candidates=CANDS, controller=reach_first(signal)), 1, HEADS, T)
    policy.set_run_length(300)
    assert policy.initial_table().tolist() == [[32, 4, 4, 4]]
    model.set_windows(policy.initial_table())
    loss, tables = train(model, 300, policy)
    assert all(t[0, 0] == 32 for t in tables[:100])  # held through formation
    assert loss < 0.1  # the head with reach learned to copy from 20 tokens back
    final = tables[-1][0]
    assert int(final.max()) > DISTANCE  # and after formation some head still reaches the answer
    assert policy.decisions >= 8  # decisions went on after formation (every 25 steps)


def test_without_reach_the_task_is_not_learned():
    """The control: the same budget spent as one window for all (8 tokens: ACR 0.25) cannot see 20 back."""
    model = tiny_model()
    model.set_windows(torch.full((1, HEADS), 8))
    loss, _ = train(model, 300)
    assert loss > 1.5  # near chance (ln 16 = 2.77)


def test_gain_ranks_the_head_that_needs_reach_above_those_that_do_not():
    """A trained model where head 0 has the whole context and uses it, heads 1..3 have 4 tokens: the gain of the
    widest window is far larger for head 0, and it is the real loss change of taking head 0's reach away."""
    model = tiny_model()
    model.set_windows(torch.tensor([[32, 4, 4, 4]]))
    train(model, 200)
    batch = copy_batch(torch.Generator().manual_seed(7), n=4)
    tokens, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    _, gain, se2 = run_gain_probe(model, tokens, targets, None, batch["loss_mask"], CANDS, n_sequences=4, n_queries=32)
    assert gain.shape == (1, HEADS, len(CANDS)) and torch.all(gain[..., 0] == 0)  # relative to the narrowest
    far = gain[0, :, -1]
    assert far[0] > 0.5  # losing reach costs head 0 more than half a nat
    assert far[0] > 10 * far[1:].abs().max()
    assert float(se2[0, 0, -1].sqrt()) < far[0] / 4  # measured, not noise
    with torch.no_grad():  # the same number by hand: head 0 narrowed like the others
        full = float(loss_of(model, batch))
        model.set_windows(torch.tensor([[4, 4, 4, 4]]))
        narrow = float(loss_of(model, batch))
    assert abs(float(far[0]) - (narrow - full)) < 1e-3 * max(1.0, narrow - full)


def test_floors_hold_in_the_knapsack_and_alone_when_they_overspend():
    """An explorer's floor is a hard lower bound of its window; floors that alone exceed the ceiling hold anyway,
    with every other head at its narrowest."""
    h = Hierarchy([[[0], [1], [2], [3]]])
    profile = torch.tensor([[0.1, 0.2, 0.3, 1.0], [0.2, 0.9, 1.0, 1.0], [0.3, 0.95, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0]])
    inputs = LayerInputs(h, profile.double(), profile.double(), CANDS, T, 1.0, floors=[3, 0, 0, 0])
    chosen = allocate_within_budget([inputs], "acr", 0.5)[0][0]
    assert chosen[0] == 3 and sum(CANDS[j] for j in chosen) <= 0.5 * 4 * T
    tight = allocate_within_budget([inputs], "acr", 0.3)[0][0]  # 32 + 3 x 4 = 44 > 0.3 x 128
    assert tight == [3, 0, 0, 0]


def test_gain_values_are_not_capped_by_coverage():
    """With ``capped=False`` (the gain signal) every candidate is open: a head whose gain keeps rising takes the
    widest window the budget allows, though its 'profile' is no mass share."""
    h = Hierarchy([[[0], [1]]])
    gain = torch.tensor([[0.0, 0.01, 0.02, 0.8], [0.0, -0.01, -0.02, -0.03]], dtype=torch.float64)
    inputs = LayerInputs(h, gain, gain, CANDS, T, 1.0, capped=False)
    assert allocate_within_budget([inputs], "acr", (32 + 4) / 64)[0][0] == [3, 0]


def test_reach_first_settings_are_checked():
    def check(**kw):
        base = dict(target_acr=0.35, budget_scope="model", budget_over_run=True, warmup_steps=0)
        cfg = AAHConfig(policy="adaptive", candidates=CANDS, controller=controller_settings(**{**base, **kw}))
        make_policy(cfg, 1, HEADS, T)

    with pytest.raises(ConfigError, match="model.aah.controller.reach.explore_window"):
        check(explorers=1, formation_steps=10, explore_window=20)
    with pytest.raises(ConfigError, match="model.aah.controller.reach.formation_steps"):
        check(explorers=1, formation_steps=0)
    with pytest.raises(ConfigError, match="model.aah.controller.reach.explorers"):
        check(explorers=5, formation_steps=10)
    with pytest.raises(ConfigError, match="model.aah.controller.need.signal"):
        check(signal="attention")
    with pytest.raises(ConfigError, match="only with a budget"):
        AAHConfig(policy="adaptive", candidates=CANDS, controller=controller_settings(signal="gain")).validate(
            T, 1, HEADS
        )
    # Explorers that cannot fit the run's budget are refused before training, naming formation_steps.
    cfg = AAHConfig(policy="adaptive", candidates=CANDS, controller=reach_first("mass", formation=290, target=0.2))
    policy = make_policy(cfg, 1, HEADS, T)
    with pytest.raises(ConfigError, match="formation_steps"):
        policy.set_run_length(300)


def test_the_gain_signal_state_survives_a_checkpoint():
    """The smoothed gain and the need that decided travel through ``state_dict`` (and are identical after it)."""
    model = tiny_model()
    cfg = AAHConfig(policy="adaptive", candidates=CANDS, controller=reach_first("gain"))
    policy = make_policy(cfg, 1, HEADS, T)
    policy.set_run_length(300)
    model.set_windows(policy.initial_table())
    train(model, 60, policy)
    state = policy.state_dict()
    again = make_policy(cfg, 1, HEADS, T)
    again.load_state_dict(state)
    assert torch.equal(again.gain_ema, policy.gain_ema) and torch.equal(again.last_need, policy.last_need)
    assert again.report().need_signal == "gain" and torch.equal(again.report().need, policy.report().need)


@pytest.mark.parametrize("sink", [0, 3])
def test_gain_under_grouped_query_attention_is_the_measured_loss_change(sink):
    """With 2 key/value heads for 4 query heads, the gain of one query head's window is the loss change of that
    head alone at that window (its key/value head shared with another query head stays as it is); with an attention
    sink, the head's measured window keeps the sink as the model's own forward does."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=T, n_layer=1, n_head=HEADS, n_kv_head=2, n_embd=64), sink)
    model.set_windows(torch.tensor([[32, 4, 16, 4]]))
    batch = copy_batch(torch.Generator().manual_seed(3), n=2)
    tokens, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    _, gain, _ = run_gain_probe(model, tokens, targets, None, batch["loss_mask"], CANDS, n_sequences=2, n_queries=8)

    def measured(w):
        with torch.no_grad():
            model.set_windows(torch.tensor([[32, 4, w, 4]]))
            return float(loss_of(model, batch))

    losses = [measured(4), measured(32)]
    assert float(gain[0, 2, -1]) == pytest.approx(losses[0] - losses[1], abs=1e-5)
    assert float(gain[0, 2, 1]) == pytest.approx(losses[0] - measured(8), abs=1e-5)  # 8 < T: the sink counts


def test_even_fill_holds_one_window_for_the_other_heads_while_the_explorers_form():
    """``formation_fill: even``: beside the explorer every other head holds the widest window the budget leaves
    ((32 + 3 x 8) / 128 = 0.4375 <= 0.5; 16 would cost 0.625) until formation ends, while the signal is still
    measured; afterwards the knapsack decides, and the explorer's learned reach stays."""
    model = tiny_model()
    ctl = reach_first("gain", formation=100, target=0.5)
    ctl.reach.formation_fill = "even"
    policy = make_policy(AAHConfig(policy="adaptive", candidates=CANDS, controller=ctl), 1, HEADS, T)
    policy.set_run_length(250)
    assert policy.initial_table().tolist() == [[32, 8, 8, 8]]
    model.set_windows(policy.initial_table())
    loss, tables = train(model, 250, policy)
    assert all(t.tolist() == [[32, 8, 8, 8]] for t in tables[:100])
    assert policy.last_need is not None and policy.decisions == 10  # steps 0, 25, ..., 225
    assert loss < 0.1 and int(tables[-1][0].max()) > DISTANCE
    with pytest.raises(ConfigError, match="model.aah.controller.reach.formation_fill"):
        bad = reach_first("gain")
        bad.reach.formation_fill = "random"
        make_policy(AAHConfig(policy="adaptive", candidates=CANDS, controller=bad), 1, HEADS, T)


def kept_reach_controller(reach_heads: int, target: float = 0.35) -> ControllerConfig:
    """A retrofit's controller: the first decision at step 0 from the trained model, one budget for the model."""
    return controller_settings(
        signal="gain",
        warmup_steps=0,
        control_interval=25,
        coverage_target=1.0,
        target_acr=target,
        budget_scope="model",
        grouping="none",
        probe_sequences=8,
        probe_queries=32,
        reach_heads=reach_heads,
    )


def test_kept_reach_trades_heads_of_partial_reach_for_one_head_of_full_reach():
    """Constructed gains at ACR 0.25 for the whole model, of a model whose layer-1 heads share a retrieval: three
    heads at 128 add up to more gain than one at 256 beside narrower ones, so the additive knapsack buys them and no
    head reaches past 128. ``reach_heads: 1`` keeps the widest
    window one head can hold within the budget (256: 256 + 7 x 16 <= 512) on the head whose gain there is largest
    (layer 1, head 1), and the knapsack places the rest around it."""
    T, cands = 256, [16, 32, 64, 128, 256]
    flat = [0.0, 0.0001, 0.0001, 0.0001, 0.0001]
    gain = torch.tensor(
        [
            [flat, flat, flat, flat],
            [
                [0.0, 0.030, 0.050, 0.110, 0.120],
                [0.0, 0.090, 0.110, 0.190, 0.250],
                [0.0, 0.005, 0.008, 0.013, 0.013],
                [0.0, 0.020, 0.080, 0.130, 0.160],
            ],
        ],
        dtype=torch.float64,
    )

    def decide(reach_heads: int) -> list[list[int]]:
        ctl = kept_reach_controller(reach_heads, target=0.25)
        policy = make_policy(AAHConfig(policy="adaptive", candidates=cands, controller=ctl), 2, 4, T)
        x = torch.zeros(2, 4, policy.layout.packed_size, dtype=torch.float64)
        return policy.decide(torch.cat([x, gain, torch.zeros_like(gain)], dim=-1), 0).tolist()

    assert decide(0) == [[16, 16, 16, 16], [128, 128, 64, 128]]
    assert decide(1) == [[16, 16, 16, 16], [32, 256, 32, 128]]

    # Settling never undoes the kept reach: a table in force without it (as after a formation that gave no head the
    # reach window) is replaced however little the move gains, while without kept reach it stays.
    for reach_heads, expected in ((0, [[16, 16, 16, 16], [128, 64, 128, 128]]), (1, [[16] * 4, [32, 256, 32, 128]])):
        ctl = kept_reach_controller(reach_heads, target=0.25)
        ctl.settle.margin = 0.5  # no move gains half a nat per head here
        policy = make_policy(AAHConfig(policy="adaptive", candidates=cands, controller=ctl), 2, 4, T)
        policy.table = torch.tensor([[16, 16, 16, 16], [128, 64, 128, 128]], dtype=torch.int32)
        x = torch.zeros(2, 4, policy.layout.packed_size, dtype=torch.float64)
        assert policy.decide(torch.cat([x, gain, torch.zeros_like(gain)], dim=-1), 50).tolist() == expected


def test_kept_reach_holds_the_head_that_needs_it_through_a_fine_tune():
    """A model trained with every head at full context on the copy task, retrofitted at ACR 0.35 with
    ``reach_heads: 1``: the first decision (step 0) gives one head the widest window (32 beside 3 x 4) and every other
    head the narrowest; the head is the one whose measured gain at 32 is largest, it holds the reach at every later
    decision, and the fine-tuned model copies."""
    source = tiny_model()
    train(source, 200)  # full context everywhere (the initial table)
    model = tiny_model()
    model.load_state_dict(source.state_dict())
    policy = make_policy(
        AAHConfig(policy="adaptive", candidates=CANDS, controller=kept_reach_controller(1)), 1, HEADS, T
    )
    policy.set_run_length(150)
    loss, tables = train(model, 150, policy, seed=2)
    first = tables[0][0].tolist()
    assert sorted(first) == [4, 4, 4, 32]
    holder = first.index(32)
    assert all(t[0].tolist() == first for t in tables)  # every decision (steps 0, 25, ..., 125) kept it
    assert int(policy.last_need[0, :, -1].argmax()) == holder
    assert loss < 0.1


def test_kept_reach_settings_are_checked():
    def check(**kw):
        ctl = kept_reach_controller(kw.pop("reach_heads", 1), target=kw.pop("target", 0.35))
        if "reach_window" in kw:
            ctl.reach.window = kw.pop("reach_window")
        AAHConfig(policy="adaptive", candidates=CANDS, controller=ctl).validate(T, 1, HEADS)

    check()
    check(reach_window=16)
    with pytest.raises(ConfigError, match="model.aah.controller.reach.heads"):
        check(reach_heads=5)
    with pytest.raises(ConfigError, match="model.aah.controller.reach.window=20"):
        check(reach_window=20)
    with pytest.raises(ConfigError, match=r"reach\.window=32 does not fit the budget.*the widest that fits is 16"):
        check(reach_window=32, target=0.3)  # 32 + 3 x 4 = 44 > 0.3 x 128; 16 + 12 = 28 fits
    with pytest.raises(ConfigError, match=r"reach\.heads=4.*no window wider than the narrowest"):
        check(reach_heads=4, target=0.125)  # 4 x 4 = 16 = 0.125 x 128: nothing wider fits
    with pytest.raises(ConfigError, match="only with a budget"):
        AAHConfig(policy="adaptive", candidates=CANDS, controller=controller_settings(reach_heads=1)).validate(
            T, 1, HEADS
        )


def test_kept_reach_decides_the_same_after_a_checkpoint():
    """Which head keeps reach is derived from the smoothed need in the policy's state, so a policy restored from
    ``state_dict`` makes the same decisions as the one that went on (reach first, then kept reach)."""
    ctl = reach_first("gain", formation=50, target=0.35)
    ctl.reach.heads = 1
    cfg = AAHConfig(policy="adaptive", candidates=CANDS, controller=ctl)
    policy = make_policy(cfg, 1, HEADS, T)
    policy.set_run_length(200)
    model = tiny_model()
    model.set_windows(policy.initial_table())
    train(model, 60, policy)
    again = make_policy(cfg, 1, HEADS, T)
    again.set_run_length(200)
    again.load_state_dict(policy.state_dict())
    g = torch.Generator().manual_seed(11)
    for step in range(60, 130):
        batch = copy_batch(g)
        a, b = policy.on_train_step(step, model, batch), again.on_train_step(step, model, batch)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        if a is not None:
            model.set_windows(a)
    assert torch.equal(policy.table, again.table) and int((policy.table >= 32).sum()) >= 1  # one head keeps reach
