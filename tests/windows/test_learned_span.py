"""The learned soft span: its attention against a float64 reference (forward and backward, spans included), the
budget's projection, a span that grows where a copy needs it and shrinks where nothing does, hard windows after
``freeze_at``, and a Lightning run resumed across the freeze."""

import math
from fractions import Fraction

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from aah_lightning.errors import ConfigError
from aah_lightning.lit.module import AAHModule, OptimConfig
from aah_lightning.model.attention.soft_span import soft_span_attention, span_ramp
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.windows.config import AAHConfig, SpanConfig
from aah_lightning.windows.policy_base import make_policy
from aah_lightning.windows.span import project_to_budget
from helpers.step_data import StepData, quiet_trainer


def reference(q, k, v, span, width, docs=None):
    """float64, as adaptive span defines it: the causal softmax, times the ramp, renormalised (``docs``: each query
    within its document)."""
    B, H, T, D = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / D**0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if docs is not None:
        causal = causal & (docs[:, None, :, None] == docs[:, None, None, :])
    a = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    d = (torch.arange(T).view(T, 1) - torch.arange(T).view(1, T)).double()
    m = ((span.view(H, 1, 1) + width - d) / width).clamp(0, 1) * causal
    p = a * m
    return (p / p.sum(-1, keepdim=True)) @ v


def assert_matches_reference(q, k, v, span, width, docs, g):
    """The ramped attention and the gradients of q, k, v and the spans against the float64 reference; returns the
    gradients."""
    out, ref = soft_span_attention(q, k, v, span, width, docs), reference(q, k, v, span, width, docs)
    assert torch.allclose(out, ref, atol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, span))
    expected = torch.autograd.grad((ref * w).sum(), (q, k, v, span))
    for a, b in zip(grads, expected):
        assert torch.allclose(a, b, atol=1e-10)
    return grads


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_soft_span_attention_matches_the_float64_reference_forward_and_backward(kv_heads):
    g = torch.Generator().manual_seed(0)
    B, H, T, D, R = 2, 4, 24, 8, 5
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, kv_heads, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, kv_heads, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    # random spans, off the ramp's kinks, from none (only the ramp) to past the sequence
    span = torch.tensor([0.3, 6.7, 13.2, 30.0], dtype=torch.float64, requires_grad=True)
    grads = assert_matches_reference(q, k, v, span, R, None, g)
    assert bool((grads[3][:3] != 0).all())  # every span inside the sequence gets gradient
    assert grads[3][3] == 0  # a span past the sequence: every key at full weight, no gradient
    assert torch.autograd.gradcheck(lambda s: soft_span_attention(q, k, v, s, R, None), (span,))


@pytest.mark.parametrize("with_docs", [False, True])
def test_the_banded_ramp_over_many_chunks_and_documents_matches_the_float64_reference(with_docs):
    # T = 150: hard windows from 3 to the whole sequence, bodies of several chunks (the last one padded), two heads
    # sharing a window (one group, two ramps), grouped-query attention, and documents (the longest 90 tokens) that
    # cut the bands
    g = torch.Generator().manual_seed(3)
    B, H, T, D, R = 2, 6, 150, 8, 3
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, 2, T, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    span = torch.tensor([0.4, 40.2, 40.6, 7.5, 70.3, 160.0], dtype=torch.float64, requires_grad=True)
    docs = None
    if with_docs:
        docs = torch.zeros(B, T, dtype=torch.long)
        docs[0, 37:], docs[0, 120:], docs[1, 90:] = 1, 2, 1
    grads = assert_matches_reference(q, k, v, span, R, docs, g)
    assert bool((grads[3][:5] != 0).all())


def test_the_ramp_scores_only_the_keys_of_its_hard_windows(monkeypatch):
    # Count the (query, key) scores every attention call computes: the ramp's must be the banded backend's pairs of
    # the hard windows ceil(z + R), far fewer than the T^2 per head the dense ramp scored.
    from aah_lightning.model.attention import banded
    from aah_lightning.model.attention.soft_span import SoftSpanPlan

    scored = []
    sdpa = F.scaled_dot_product_attention

    def counting(q, k, v, *args, **kwargs):
        scored.append(q.shape[:-1].numel() * k.shape[-2])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(banded.F, "scaled_dot_product_attention", counting)
    B, H, T, R = 1, 4, 512, 8
    q, k, v = (torch.randn(B, H, T, 16) for _ in range(3))
    span = torch.tensor([10.5, 20.0, 55.2, 120.0], requires_grad=True)
    hard = (span.detach() + R).ceil().int().tolist()  # [19, 28, 64, 128]
    plan = SoftSpanPlan(span, R, None, banded.build_plan(hard, T))
    plan(q, k, v).sum().backward()
    assert span.grad is not None and bool((span.grad != 0).all())
    assert sum(scored) == B * plan.computed_pairs(128) == B * sum(banded.biased_band_pairs(w, T) for w in hard)
    assert sum(scored) < 0.2 * H * T * T  # the dense ramp scored H T^2


@pytest.mark.parametrize("with_docs", [False, True])
def test_the_ramp_runs_on_the_planners_banded_plan_without_building_another(monkeypatch, with_docs):
    # The hard plan the planner built for a forward is already the ramp's banded plan: the ramp takes it as it is
    # (no second plan, no second set of document masks per batch) and gives what a plan built for it gives.
    from aah_lightning.model.attention import banded
    from aah_lightning.model.attention.soft_span import SoftSpanPlan

    g = torch.Generator().manual_seed(3)
    B, H, T, R = 2, 4, 96, 2
    q, k, v = (torch.randn(B, H, T, 8, generator=g, dtype=torch.float64) for _ in range(3))
    docs = None
    if with_docs:
        docs = torch.zeros(B, T, dtype=torch.long)
        docs[0, 40:], docs[1, 70:] = 1, 1
    span = torch.tensor([3.5, 30.0, 7.2, 60.0], dtype=torch.float64)
    hard = (span + R).ceil().int().tolist()
    expected = soft_span_attention(q, k, v, span, R, docs)  # builds its own plan
    plan = SoftSpanPlan(span, R, docs, banded.build_plan(hard, T, docs))
    built = []
    monkeypatch.setattr(banded, "build_plan", lambda *a, **kw: built.append(a))
    assert torch.equal(plan(q, k, v), expected)
    assert built == []
    # a hard plan with sink columns is not the ramp's plan: the ramp builds its own
    monkeypatch.undo()
    sunk = SoftSpanPlan(span, R, docs, banded.build_plan(hard, T, docs, sink=2))
    assert torch.equal(sunk(q, k, v), expected)


def test_a_span_past_the_sequence_is_full_attention_and_the_ramp_masks_past_span_plus_width():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 4, generator=g, dtype=torch.float64) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(soft_span_attention(q, k, v, torch.tensor([20.0, 16.0]), 4, None), full, atol=1e-12)
    # span 0, width 1: each query sees only itself
    assert torch.allclose(soft_span_attention(q, k, v, torch.zeros(2), 1, None), v, atol=1e-12)
    assert span_ramp(torch.tensor([0.0, 3.0, 5.0, 7.0]), torch.tensor(3.0), 4).tolist() == [1.0, 1.0, 0.5, 0.0]


def test_the_projection_lowers_every_span_by_one_amount_until_the_budget_holds():
    T, R = 64, 8
    z = torch.tensor([[40.0, 10.0], [2.0, 20.0]])
    cost = lambda z: float((z + R).clamp(max=T).mean()) / T  # noqa: E731
    assert torch.equal(project_to_budget(z, R, T, 0.6), z)  # within budget: unchanged
    p = project_to_budget(z, R, T, 0.3)
    assert cost(p) == pytest.approx(0.3, abs=1e-6)
    shift = z - p
    moved = p > 0
    assert torch.allclose(shift[moved], shift[moved][0].expand_as(shift[moved]))  # one common amount
    assert float(p[1, 0]) == 0.0  # clamped at 0, not below
    assert float(project_to_budget(torch.tensor([100.0]), R, T, 1.0)) == T - R  # at most T - R


T, VOCAB, DISTANCE = 48, 16, 24


def copy_batch(g: torch.Generator, n: int = 16) -> dict:
    x = torch.randint(0, VOCAB, (n, T + 1), generator=g)
    x[:, DISTANCE:] = x[:, : T + 1 - DISTANCE].clone()
    mask = torch.zeros(n, T, dtype=torch.bool)
    mask[:, DISTANCE - 1 :] = True
    return {"tokens": x, "loss_mask": mask}


def span_policy(target: float, width: int = 16, freeze_at: int = 10_000):
    cfg = AAHConfig(
        policy="learned_span", span=SpanConfig(target_acr=target, width=width, freeze_at=freeze_at, lr=3e-2)
    )
    return make_policy(cfg, 1, 2, T)


def train_copy(policy, steps: int) -> tuple[GPT, list[float]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=T, n_layer=1, n_head=2, n_embd=64))
    model.set_windows(policy.initial_table())
    groups = [{"params": list(model.parameters())}, {"params": list(policy.spans.parameters()), "lr": policy.lr}]
    opt = torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.0)
    g, losses = torch.Generator().manual_seed(1), []
    for step in range(steps):
        batch = copy_batch(g)
        table = policy.on_train_step(step, model, batch)
        if table is not None:
            model.set_windows(table)
        x, y, mask = batch["tokens"][:, :-1], batch["tokens"][:, 1:], batch["loss_mask"]
        loss = (F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none") * mask.flatten()).sum()
        loss = loss / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return model, losses


def test_a_span_grows_where_a_copy_needs_it_and_the_other_gives_its_span_up():
    # Both heads start at span 12 (window 28): the copy 24 back sits in their ramps at a quarter weight. The budget
    # is what they start with, so a head reaches further only as the other gives span up.
    policy = span_policy(target=28 / T)
    assert policy.tokens().detach().tolist() == [[12.0, 12.0]]
    model, losses = train_copy(policy, 300)
    assert losses[-1] < 0.15 * losses[0]  # the copy is learned
    z = policy.tokens().detach()[0]
    # the head that copies: the one whose attention (ramp included) puts the most weight 24 back
    copier = int(copy_weights(model, policy).argmax())
    other = 1 - copier
    assert float(z[copier]) >= 12 + 2  # its span grew: the copy's key at a higher weight
    assert float(z[other]) <= 12 - 2  # the other head gave span up to it
    assert float((z + 16).clamp(max=T).mean()) / T <= 28 / T + 1e-6  # within the budget
    need = policy.report().need  # the ramp's weight at each candidate's distance (1 inside the span)
    assert need.shape == (1, 2, 4) and policy.report().need_signal == "span"


def copy_weights(model: GPT, policy) -> torch.Tensor:
    """Each head's mean attention weight, over the copy's queries, on the key ``DISTANCE`` back (ramps included)."""
    x = copy_batch(torch.Generator().manual_seed(7), n=8)["tokens"][:, :-1]
    seen = {}

    class Keep:
        eager, head_groups = True, None

        def __init__(self, inner):
            self.inner = inner

        def __call__(self, q, k, v):
            seen["qk"] = (q, k)
            return self.inner(q, k, v)

    with torch.no_grad():
        model(x, plans=[Keep(p) for p in model.attention_plans(T)])
        q, k = seen["qk"]
        probe = torch.eye(T, dtype=q.dtype).expand(q.shape[0], k.shape[1], T, T)
        weights = soft_span_attention(q, k, probe, policy.tokens()[0], policy.width, None)  # rows = attention
    rows = torch.arange(DISTANCE, T)
    return weights[:, :, rows, rows - DISTANCE].mean(dim=(0, 2))


def test_without_the_copy_in_reach_no_span_grows():
    # start at span 0 (window 16): the copy 24 back is outside every ramp, so nothing pulls a span out to it
    policy = span_policy(target=16 / T)
    _, losses = train_copy(policy, 150)
    assert float(policy.tokens().detach().max()) + 16 < DISTANCE
    assert losses[-1] > 0.5 * losses[0]


def test_the_spans_become_hard_windows_at_freeze_at():
    policy = span_policy(target=28 / T, freeze_at=5)
    model, _ = train_copy(policy, 5)
    assert model.soft_plans is not None  # learning: the ramped plans
    table = policy.hard_table()
    policy.on_train_step(5, model, None)
    assert model.soft_plans is None  # frozen: the hard windows' plans
    with torch.no_grad():
        policy.spans.fraction.add_(0.25)  # momentum moving the parameter after the freeze changes nothing
    assert torch.equal(policy.hard_table(), table)
    assert policy.on_train_step(6, model, None) is None


def test_hard_windows_give_back_the_keys_rounding_adds_past_the_budget():
    # A whole-context head and 11 spans between 0 and 1 past a ramp of 2 hold 256 + 22 + 4.75 = 282.75 keys; ceil
    # alone pays 256 + 11 * 3 = 289. At a budget of 283 keys the six heads whose last key the ramp weighs least (the
    # shortest spans) give that key back.
    from aah_lightning.windows.span import hard_windows

    z = torch.tensor([[0.2, 0.9, 0.5, 0.2], [0.1, 0.6, 0.3, 0.8], [254.0, 0.4, 0.7, 0.05]])
    w = hard_windows(z, 2, 256, 283)
    ceil = (z + 2).ceil()
    assert int(w.sum()) == 283 and int(w[2, 0]) == 256  # the whole-context head keeps its keys
    assert bool(((ceil - w) >= 0).all()) and bool(((ceil - w) <= 1).all())  # at most one key a head
    assert bool((w.float() >= (z + 2).floor()).all())
    lost = (ceil - w).bool()
    assert sorted(z[lost].tolist()) == pytest.approx([0.05, 0.1, 0.2, 0.2, 0.3, 0.4])
    # a table already within the budget is ceil itself
    assert torch.equal(hard_windows(z, 2, 256, 10_000), ceil.int())
    # random spans at a budget they keep: the windows never pass it, and each head keeps floor(z + R)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        z = torch.rand(3, 4, generator=g) * 60
        budget = int((z + 4).sum())  # what the spans cost, rounded down
        w = hard_windows(z, 4, 64, budget)
        assert int(w.sum()) <= budget and bool((w.float() >= (z + 4).floor()).all())


def test_full_heads_give_the_widest_spans_the_whole_context_at_the_freeze_and_the_rest_pay_for_them():
    cfg = AAHConfig(
        policy="learned_span", span=SpanConfig(target_acr=0.45, width=8, freeze_at=1, lr=1e-2, full_heads=1)
    )
    policy = make_policy(cfg, 2, 2, T)
    learned = torch.tensor([[6.0, 4.0], [20.0, 9.0]])  # head (1, 0) won the distance but holds 28 of 48 tokens
    with torch.no_grad():
        policy.spans.fraction.copy_(learned / T)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=T, n_layer=2, n_head=2, n_embd=32))
    table = policy.on_train_step(1, model, None)
    assert int(table[1, 0]) == T  # the widest span: the whole context
    assert int(table.sum()) <= int(Fraction(0.45) * 4 * T)  # the budget holds in keys, rounding included
    z = policy.held()
    given_up = (learned - z)[torch.tensor([[True, True], [False, True]])]
    assert float(given_up.min()) > 0  # every other head paid ...
    moved = z[torch.tensor([[True, True], [False, True]])] > 0
    assert torch.allclose(given_up[moved], given_up[moved][0].expand_as(given_up[moved]))  # ... one common amount
    # without full heads the same spans freeze as learned
    plain = make_policy(AAHConfig(policy="learned_span", span=SpanConfig(0.45, 8, 1, 1e-2)), 2, 2, T)
    with torch.no_grad():
        plain.spans.fraction.copy_(learned / T)
    assert plain.on_train_step(1, model, None).tolist() == [[14, 12], [28, 17]]


def test_learned_span_settings_are_checked():
    def check(**span):
        cfg = AAHConfig(
            policy="learned_span", span=SpanConfig(**{"target_acr": 0.5, "width": 8, "freeze_at": 10, **span})
        )
        make_policy(cfg, 1, 2, T)

    check()
    with pytest.raises(ConfigError, match="model.aah.span.target_acr"):
        check(target_acr=None)
    with pytest.raises(ConfigError, match="model.aah.span.target_acr.*width / seq_len"):
        check(target_acr=0.1, width=8)
    with pytest.raises(ConfigError, match="model.aah.span.freeze_at"):
        check(freeze_at=None)
    with pytest.raises(ConfigError, match="model.aah.span.width"):
        check(width=0)
    check(target_acr=0.6, full_heads=1)  # one head of 48 and one of 8: 56 of the 57.6 tokens paid for
    with pytest.raises(ConfigError, match=r"model.aah.span.full_heads.*\[0, 0\]"):  # 48 + 8 > 0.5 * 96
        check(full_heads=1)
    with pytest.raises(ConfigError, match=r"model.aah.span.full_heads.*\[0, 1\]"):  # never every head
        check(target_acr=1.0, full_heads=2)
    with pytest.raises(ConfigError, match="model.aah.span.full_heads"):
        check(full_heads=-1)
    # One whole head and one ramp of 17 cost 65/96 of the context, to the token; the float just below it (where
    # float arithmetic rounds up to 1) cannot pay for the whole head, the float just above it can.
    exact = float(Fraction(48 + 17, 2 * 48))
    check(target_acr=math.nextafter(exact, 1.0), width=17, full_heads=1)
    with pytest.raises(ConfigError, match=r"model.aah.span.full_heads.*\[0, 0\]"):
        check(target_acr=math.nextafter(exact, 0.0), width=17, full_heads=1)
    with pytest.raises(ConfigError, match="model.aah.sink"):
        make_policy(AAHConfig(policy="learned_span", sink=2, span=SpanConfig(0.5, 8, 10)), 1, 2, T)


# -- a Lightning run across the freeze ----------------------------------------------------------------------------
STEPS = 8


class StopAt(L.Callback):
    def __init__(self, stop_at):
        self.stop_at = stop_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True


def fit(ckpt_path=None, stop_at=None, full_heads=0):
    L.seed_everything(0)
    # with a full head: the whole context for one head, 24 tokens (a span of 8 and the ramp) for the other
    target = (T + 24) / (2 * T) if full_heads else 28 / T
    span = SpanConfig(target_acr=target, width=16, freeze_at=4, full_heads=full_heads)
    module = AAHModule(
        gpt=GPTConfig(n_layer=1, n_head=2, n_embd=32, seq_len=T, vocab_size=VOCAB),
        aah=AAHConfig(policy="learned_span", span=span),
        optim=OptimConfig(lr=1e-2, warmup_steps=1),
    )
    trainer = quiet_trainer(STEPS, [StopAt(stop_at)])
    data = StepData(lambda step: copy_batch(torch.Generator().manual_seed(1000 + step), n=4), STEPS)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, module


@pytest.mark.parametrize("stop_at,full_heads", [(2, 0), (6, 0), (2, 1), (6, 1)])
def test_a_learned_span_run_resumed_before_or_after_the_freeze_ends_as_the_uninterrupted_run(
    tmp_path, stop_at, full_heads
):
    _, straight = fit(full_heads=full_heads)
    assert straight.spans.fraction.requires_grad
    assert any(id(p) == id(straight.spans.fraction) for g in straight.parameter_groups() for p in g["params"])
    if full_heads:  # the widened table holds after the freeze: one whole head, the other its 24 (ceil may add one)
        other, whole = sorted(straight.model.windows.flatten().tolist())
        assert whole == T and other in (24, 25)
    trainer, _ = fit(stop_at=stop_at, full_heads=full_heads)
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    assert "spans.fraction" in torch.load(tmp_path / "stop.ckpt", weights_only=True)["state_dict"]
    _, resumed = fit(ckpt_path=str(tmp_path / "stop.ckpt"), full_heads=full_heads)
    assert torch.equal(resumed.spans.fraction, straight.spans.fraction)
    assert torch.equal(resumed.model.windows, straight.model.windows)
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(straight.policy.frozen, resumed.policy.frozen)
