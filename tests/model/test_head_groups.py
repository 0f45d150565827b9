"""Heads in groups without activation copies: with a plan that declares ``head_groups`` (``split``, ``varlen``), the
attention layer reorders its projection weights instead of q, k, v and adds the groups' outputs up through the output
projection's columns. The model must compute exactly what it computes when the plan gathers and scatters the heads
itself, and what the float64 reference attention gives, for any window table, forward and backward."""

from __future__ import annotations

import pytest
import torch

from aah_lightning.model.attention import Plan, split
from aah_lightning.model.attention.reference import reference_attention
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT


class Gathered:
    """A plan as the layer sees it without ``head_groups``: the layer hands it every head's q, k, v."""

    eager, head_groups = False, None

    def __init__(self, plan):
        self.plan = plan

    def __call__(self, q, k, v):
        return self.plan(q, k, v)


class Reference(Plan):
    """The float64 reference attention of one layer's windows."""

    def __init__(self, row):
        self.row = row

    def __call__(self, q, k, v):
        return reference_attention(q, k, v, torch.tensor(self.row))


def _model(bias: bool, seed: int, T: int = 64, n_head: int = 6) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=T, n_layer=3, n_head=n_head, n_embd=n_head * 8, bias=bias)).double()
    g = torch.Generator().manual_seed(seed)
    # random windows below T, with full-window heads (W >= T) between them in every layer: heads 0 and 3
    table = torch.randint(1, T, (3, n_head), generator=g, dtype=torch.int32)
    table[:, ::3] = T + torch.arange(3, dtype=torch.int32).view(-1, 1)
    model.set_windows(table)
    for p in model.parameters():  # biases start at zero: give them values, so a wrong bias row would show
        if p.dim() == 1:
            p.data.normal_(0, 0.1, generator=g)
    return model


def _run(model, tokens, plans):
    model.zero_grad()
    logits = model(tokens, plans=plans)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grouped_layers_equal_the_gathering_plan_and_the_reference_forward_and_backward(bias, seed, monkeypatch):
    T = 64
    model = _model(bias, seed, T)
    tokens = torch.randint(model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))
    plans = model.attention_plans(T, backend="split")
    rows = [tuple(r.tolist()) for r in model.windows]
    # The groups really are reordered heads in several groups (windowed ones on banded, full ones on causal SDPA).
    assert all(p.kind == "split" and p.head_groups.order is not None and len(p.head_groups.sizes) == 2 for p in plans)

    reference = _run(model, tokens, [Reference(r) for r in rows])
    gathered = _run(model, tokens, [Gathered(p) for p in plans])
    calls = []
    original = split.SplitPlan.__call__
    monkeypatch.setattr(split.SplitPlan, "__call__", lambda *a: calls.append(1) or original(*a))
    grouped = _run(model, tokens, plans)
    assert not calls  # the layer ran the groups itself: the plan's gather / scatter was never used

    for other in (gathered, reference):
        torch.testing.assert_close(grouped[0], other[0], rtol=1e-10, atol=1e-10)
        assert grouped[1].keys() == other[1].keys()
        for name in grouped[1]:
            torch.testing.assert_close(grouped[1][name], other[1][name], rtol=1e-9, atol=1e-10, msg=name)


def test_a_layer_whose_heads_are_already_grouped_reorders_nothing():
    T = 32
    model = _model(False, 0, T, n_head=4)
    model.set_windows([[5, 7, T, T]] * 3)  # windowed heads first, full ones last: the groups' order is the layer's
    plans = model.attention_plans(T, backend="split")
    assert all(p.head_groups.order is None and p.head_groups.sizes == (2, 2) for p in plans)
    tokens = torch.randint(model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    grouped, gathered = _run(model, tokens, plans), _run(model, tokens, [Gathered(p) for p in plans])
    torch.testing.assert_close(grouped[0], gathered[0], rtol=1e-10, atol=1e-10)
    for name in grouped[1]:
        torch.testing.assert_close(grouped[1][name], gathered[1][name], rtol=1e-9, atol=1e-10, msg=name)


def test_the_probe_records_every_head_in_the_layers_order_under_a_split_plan():
    # The controller's probe wraps each layer's plan (Recording: no head_groups), so the layer hands it q, k, v of
    # every head in the layer's own order, and the logits are the grouped model's.
    from aah_lightning.model.attention import Recording

    T = 32
    model = _model(True, 3, T, n_head=4)
    tokens = torch.randint(model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(3))
    plans = model.attention_plans(T, backend="split")
    recorded = [Recording(p) for p in plans]
    with torch.no_grad():
        probed, grouped = model(tokens, plans=recorded), model(tokens, plans=plans)
        recorded_ref = [Recording(Reference(tuple(r.tolist()))) for r in model.windows]
        model(tokens, plans=recorded_ref)
    torch.testing.assert_close(probed, grouped, rtol=1e-10, atol=1e-10)
    for a, b in zip(recorded, recorded_ref):
        for x, y in zip(a.records[0], b.records[0]):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
