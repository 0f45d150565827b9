"""The ``retrieval`` need signal: copy probes built from the batch, copy-paste hits per head, and the need of each
window as the share of hits it keeps."""

import pytest
import torch

from aah_lightning.errors import ConfigError
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.windows.config import AAHConfig, ControllerConfig, NeedConfig
from aah_lightning.windows.controller.retrieval import copy_probes, retrieval_hits, run_retrieval_probe
from aah_lightning.windows.policy_base import make_policy
from helpers.controller_inputs import controller_settings

T, SPAN = 64, 6


def test_a_copy_probe_repeats_an_earlier_span_at_stratified_distances():
    tokens = torch.randint(0, 50, (3, T), generator=torch.Generator().manual_seed(0))
    probes, distance = copy_probes(tokens, 4, SPAN, torch.Generator().manual_seed(1))
    edges = torch.linspace(SPAN, T - SPAN, 5)
    for i, d in enumerate(distance.tolist()):
        assert edges[i] <= d <= edges[i + 1]  # probe i draws from stratum i
        assert torch.equal(probes[i, T - SPAN :], probes[i, T - SPAN - d : T - d])  # the copy of the source
        assert torch.equal(probes[i, : T - SPAN], tokens[i % 3, : T - SPAN])  # the rest is the row as it was
    with pytest.raises(ValueError, match="at least 13 tokens"):
        copy_probes(tokens[:, :12], 2, SPAN)


def one_hot_attention(peak_back: list[int | None], d_model: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[1, H, T, T]``: head h's query at position p matches only the key ``peak_back[h]`` tokens back (None:
    itself), so its attention peaks exactly there."""
    k = torch.eye(T).expand(1, 1, T, T) * 50.0
    qs = []
    for back in peak_back:
        target = torch.arange(T) - (back or 0)
        qs.append(torch.nn.functional.one_hot(target.clamp(min=0), T).float() * 50.0)
    return torch.stack(qs).unsqueeze(0), k.expand(1, len(peak_back), T, T)


def test_a_head_hits_only_where_it_peaks_on_the_token_to_copy():
    """Three heads on one probe whose source lies 30 back: one peaks 29 back (the token after the source's match:
    a copy), one 30 back (the source's own token: no), one on itself (no)."""
    q, k = one_hot_attention([29, 30, None])
    hits = retrieval_hits(q, k, SPAN, torch.tensor([30]))
    assert hits.tolist() == [[1.0, 0.0, 0.0]]


def test_need_is_the_share_of_hits_each_window_keeps():
    """A model whose every head copies: the need of a window is the share of probes whose source lies within it,
    each probe's own hits counted, and it grows with the window; the standard error is that of the mean over probes."""

    class CopyingPlans:
        """Stands in for a GPT whose one layer's two heads peak on the copy source (head 0) or on themselves."""

        def __init__(self):
            self.training = False
            self.distance = None

        def eval(self):
            pass

        def train(self, mode):
            pass

        def attention_plans(self, seq_len):
            return [lambda q, k, v: q]

        def __call__(self, probes, docs, plans):
            n = probes.shape[0]
            qs, ks = [], []
            for d in self.distance.tolist():
                q, k = one_hot_attention([d - 1, None])
                qs.append(q)
                ks.append(k)
            q, k = torch.cat(qs), torch.cat(ks)
            for plan in plans:
                plan(q, k, k)
            return torch.zeros(n, T, 1)

    model = CopyingPlans()
    g = torch.Generator().manual_seed(2)
    _, model.distance = copy_probes(torch.zeros(1, T, dtype=torch.long), 4, SPAN, torch.Generator().manual_seed(2))
    candidates = [8, 16, 32, 64]
    need, se2, hits = run_retrieval_probe(model, torch.zeros(1, T, dtype=torch.long), candidates, 4, SPAN, g)
    assert hits[:, 0, 0].tolist() == [1.0] * 4 and hits[:, 0, 1].tolist() == [0.0] * 4
    within = torch.tensor([[d - 1 < w for w in candidates] for d in model.distance.tolist()], dtype=torch.float64)
    assert torch.allclose(need[0, 0], within.mean(0)) and torch.all(need[0, 1] == 0)
    assert torch.allclose(se2[0, 0], within.var(0) / 4)
    assert need[0, 0, -1] == 1.0 and torch.all(need[0, 0].diff() >= 0)


def test_the_controller_decides_with_it_within_the_budget_and_resumes_it():
    """``need.signal: retrieval`` on a real (untrained) GPT: a table within the budget at step 0, the need it decided
    on is the probe's, and the smoothed need survives the policy's state."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=T, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    settings = controller_settings(
        target_acr=0.5, budget_scope="model", warmup_steps=0, control_interval=1, grouping="none", signal="retrieval"
    )
    settings.need.copy_span = SPAN
    cfg = AAHConfig(policy="adaptive", candidates=[8, 16, 32, 64], controller=settings)
    cfg.validate(T, 2, 4)
    policy = make_policy(cfg, 2, 4, T)
    policy.set_run_length(10)
    model.set_windows(policy.initial_table())
    batch = {"tokens": torch.randint(0, 32, (2, T + 1), generator=torch.Generator().manual_seed(3))}
    table = policy.on_train_step(0, model, batch)
    assert table is not None and policy.report().need_signal == "retrieval"
    assert policy.report().need.shape == (2, 4, 4)
    again = make_policy(cfg, 2, 4, T)
    again.load_state_dict(policy.state_dict())
    assert torch.equal(again.gain_ema, policy.gain_ema)


def test_its_settings_are_checked():
    with pytest.raises(ConfigError, match="model.aah.controller.need.copy_span"):
        ControllerConfig(need=NeedConfig(signal="retrieval", copy_span=1)).validate([8, 64], T, 4)
    with pytest.raises(ConfigError, match=r"copy_span=32 is not allowed: at most \(seq_len - 1\) / 2 = 31"):
        ControllerConfig(need=NeedConfig(signal="retrieval", copy_span=32)).validate([8, 64], T, 4)
    unbudgeted = controller_settings(signal="retrieval")
    unbudgeted.need.copy_span = SPAN
    with pytest.raises(ConfigError, match="only with a budget"):
        AAHConfig(policy="adaptive", candidates=[8, 64], controller=unbudgeted).validate(T, 1, 4)


def test_kv_head_groups_give_each_key_value_head_one_window():
    """``groups.method: kv_heads``: every decision gives the query heads of one key/value head one window, so the
    budget buys only windows that a key/value head's cache can keep; another count than the model's is refused."""
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=32, seq_len=T, n_layer=2, n_head=6, n_kv_head=3, n_embd=48))
    settings = controller_settings(
        target_acr=0.4, budget_scope="model", warmup_steps=0, control_interval=1, signal="retrieval", depth=1
    )
    settings.need.copy_span = SPAN
    settings.groups.method, settings.groups.kv_heads = "kv_heads", 3
    cfg = AAHConfig(policy="adaptive", candidates=[8, 16, 32, 64], controller=settings)
    policy = make_policy(cfg, 2, 6, T)
    policy.set_run_length(10)
    model.set_windows(policy.initial_table())
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        table = policy.on_train_step(step, model, {"tokens": torch.randint(0, 32, (2, T + 1), generator=g)})
        if table is not None:  # None: the table in force stays
            model.set_windows(table)
        for row in model.windows.tolist():
            assert row[0] == row[1] and row[2] == row[3] and row[4] == row[5], model.windows
    assert len(set(model.windows.flatten().tolist())) > 1  # not one window for all: the groups differ
    assert policy.partitions[0] == [[0, 1], [2, 3], [4, 5]]
    settings.groups.kv_heads = 4
    with pytest.raises(ConfigError, match="model.aah.controller.groups.kv_heads=4 .*divides n_head=6"):
        AAHConfig(policy="adaptive", candidates=[8, 64], controller=settings).validate(T, 2, 6)


def test_a_run_refuses_kv_head_groups_of_another_count_than_its_model():
    from aah_lightning.lit.module import AAHModule
    from aah_lightning.model.config import GPTConfig as Config

    gpt = Config(vocab_size=32, seq_len=T, n_layer=1, n_head=6, n_kv_head=3, n_embd=48)
    controller = {"groups": {"method": "kv_heads", "kv_heads": 2, "depth": 1}, "budget": {"target_acr": 0.5}}
    controller |= {"need": {"signal": "retrieval", "copy_span": SPAN}}
    aah = AAHConfig(policy="adaptive", candidates=[8, 64], controller=controller)
    with pytest.raises(ConfigError, match=r"groups.kv_heads=2 .*the model's n_kv_head, 3"):
        AAHModule(gpt=gpt, aah=aah)
    controller["groups"]["kv_heads"] = 3
    AAHModule(gpt=gpt, aah=AAHConfig(policy="adaptive", candidates=[8, 64], controller=controller))
