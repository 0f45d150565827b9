"""The controller settles: on a problem that does not change, the table stops changing after the second decision.

Two sources of change that are not the model's: probe noise around the coverage target (without a budget) and
near-ties between allocations (under a budget). ``settle_margin`` keeps the table in force unless a move gains
more than that (docs/controller.md, "Settling").
"""

import pytest
import torch

from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from helpers.controller_inputs import adaptive, random_profiles, synthetic_features

CANDS, T = [4, 8, 16, 32, 64], 64
BUDGETS = {"none": {}, "layer": {"target_acr": 0.3}, "model": {"target_acr": 0.3, "budget_scope": "model"}}


def near_target_profiles(g: torch.Generator) -> torch.Tensor:
    """Random monotone profiles ``[3, 6, K]`` with several heads' mass at some window right at the target 0.9."""
    m = random_profiles(3, 6, len(CANDS), g)
    m[:, ::2, 2] = 0.9  # every other head holds exactly the target at window 16
    m[:, ::2, :2] = torch.minimum(m[:, ::2, :2], torch.tensor(0.85, dtype=torch.float64))
    m[:, ::2, 3] = torch.maximum(m[:, ::2, 3], torch.tensor(0.95, dtype=torch.float64))
    return m


def decide_with_noise(margin: float, budget: dict, noise: float, decisions: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    base = near_target_profiles(g)
    policy = adaptive(3, 6, T, CANDS, depth=2, threshold=0.8, settle_margin=margin, **budget)
    tables = []
    for step in range(decisions):
        jitter = (torch.rand(base.shape, generator=g, dtype=torch.float64) - 0.5) * 2 * noise
        profiles = (base + jitter).clamp(0, 1)
        profiles[..., -1] = 1.0
        tables.append(policy.decide(synthetic_features(policy, profiles), step=step))
    return tables


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_probe_noise_moves_no_window_after_the_second_decision(budget):
    tables = decide_with_noise(0.02, BUDGETS[budget], noise=0.01)
    assert all(torch.equal(t, tables[1]) for t in tables[2:])


def test_without_a_margin_the_same_noise_keeps_moving_windows():
    # The test above could fail: with no dead band, the heads sitting on the target flip with the noise.
    tables = decide_with_noise(0.0, {}, noise=0.01)
    assert sum(not torch.equal(a, b) for a, b in zip(tables[1:], tables[2:])) >= 3


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_a_real_change_still_moves_windows(budget):
    # Settling is not freezing: when a head's reach really changes, its window follows. (Every head its own group,
    # so that each head's window answers to its own profile.)
    g = torch.Generator().manual_seed(5)
    base = near_target_profiles(g)
    policy = adaptive(3, 6, T, CANDS, grouping="none", depth=1, settle_margin=0.02, **BUDGETS[budget])
    budget = BUDGETS[budget]
    before = policy.decide(synthetic_features(policy, base), step=0)
    policy.decide(synthetic_features(policy, base), step=1)
    moved = base.clone()
    moved[:, 1] = torch.tensor([0.05, 0.1, 0.15, 0.2, 1.0], dtype=torch.float64)  # head 1 now needs the whole context
    moved[:, 3] = 1.0  # head 3 now needs only 4 tokens
    policy.settings.need.ema_alpha = 0.0  # the change arrives at once
    after = policy.decide(synthetic_features(policy, moved), step=2)
    assert not torch.equal(before, after)
    cand = torch.tensor(CANDS)
    kept = [float(moved.gather(-1, torch.searchsorted(cand, t).long().unsqueeze(-1)).sum()) for t in (before, after)]
    assert kept[1] > kept[0] + 0.04  # the new table holds clearly more of the changed heads' mass
    if not budget:  # without a budget each head follows its own need
        assert (after[:, 1] == 64).all() and (after[:, 3] == 4).all()


@pytest.mark.heavy
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_a_fixed_model_gets_a_fixed_table_after_the_second_decision(budget):
    # A real model, briefly trained on the synthetic copy task and then frozen; each decision probes another batch.
    torch.manual_seed(0)
    seq = 32
    dm = TextDataModule(source="synthetic", seq_len=seq, batch_size=16, synthetic={"documents": 2000}, seed=0)
    dm.setup("fit")
    model = GPT(GPTConfig(vocab_size=dm.vocab_size, seq_len=seq, n_layer=2, n_head=4, n_embd=64, backend="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = [torch.stack([dm.train_set[i * 16 + j]["tokens"] for j in range(16)]) for i in range(110)]
    for tokens in batches[:100]:
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    policy = adaptive(2, 4, seq, [4, 8, 16, 32], depth=2, probe_sequences=4, probe_queries=16, **BUDGETS[budget])
    tables = [
        policy.decide(policy.measure(model, tokens[:, :-1]), step=step) for step, tokens in enumerate(batches[100:])
    ]
    assert all(torch.equal(t, tables[1]) for t in tables[2:]), [t.tolist() for t in tables]
