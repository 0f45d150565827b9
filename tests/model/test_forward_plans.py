"""One forward for training, the probe and generation: plans supplied by the caller, RoPE at given positions."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from aah_lightning.model import generate as gen
from aah_lightning.model.attention import Recording
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.windows.probe import run_probe


def tiny_model(dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, seq_len=64, n_layer=2, n_head=4, n_embd=32, backend="sdpa"))
    model.set_windows([[3, 64, 5, 7], [64, 2, 16, 9]])
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_at_positions_is_the_table_bit_for_bit(dtype):
    rotary = tiny_model(dtype).rotary  # under model.to(float64) its frequencies are float64
    cos, sin = rotary(5000, torch.device("cpu"), torch.float32)
    positions = torch.randint(5000, (3, 7), generator=torch.Generator().manual_seed(0))
    c, s = rotary.at(positions, torch.float32)
    assert c.shape == (3, 1, 7, cos.shape[-1])
    assert torch.equal(c[:, 0], cos[positions]) and torch.equal(s[:, 0], sin[positions])


def test_positions_zero_to_t_are_the_default_forward():
    model = tiny_model()
    idx = torch.randint(40, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(idx, positions=torch.arange(20).expand(2, -1)), model(idx))


def test_recording_plans_record_and_change_nothing():
    model = tiny_model()
    idx = torch.randint(40, (2, 20), generator=torch.Generator().manual_seed(1))
    plans = [Recording(plan) for plan in model.attention_plans(20)]
    with torch.no_grad():
        assert torch.equal(model(idx, plans=plans), model(idx))
    assert [len(p.records) for p in plans] == [1, 1]
    q, k, v = plans[1].records[0]
    assert q.shape == k.shape == v.shape == (2, 4, 20, 8) and not q.requires_grad


@pytest.mark.heavy  # compiles the blocks
def test_probe_and_generation_through_compiled_blocks():
    """Compiled blocks (``model.gpt.compile_blocks``): the probe runs the compiled graphs and compiles once; generation's
    eager plans run the blocks uncompiled, compile nothing, and decode as the eager model does, with activation
    checkpointing too."""
    from torch._dynamo.utils import counters

    from aah_lightning.lit.distributed import prepare_model

    eager = tiny_model()
    tokens = torch.randint(40, (2, 64), generator=torch.Generator().manual_seed(1))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cfg = gen.GenerationConfig(max_new_tokens=10, temperature=0)
    want = [c.tokens for c in gen.generate(eager, prompts, cfg)]
    ref = run_probe(eager, tokens, generator=torch.Generator().manual_seed(2))
    for checkpointed in (False, True):
        model = copy.deepcopy(eager)
        prepare_model(SimpleNamespace(model=model), compile_blocks=True, activation_checkpointing=checkpointed)
        with torch.no_grad():
            model(tokens)
        graphs = counters["stats"]["unique_graphs"]
        assert [c.tokens for c in gen.generate(model, prompts, cfg)] == want
        assert counters["stats"]["unique_graphs"] == graphs
        if checkpointed:  # a list append inside checkpointing's graph is an unsafe side effect to dynamo
            continue
        probes = [run_probe(model, tokens, generator=torch.Generator().manual_seed(2)) for _ in range(2)]
        assert counters["stats"]["unique_graphs"] == graphs + 1  # one graph for the recording plans, then reused
        for probe in probes:
            for got, exp in zip(probe.k + probe.probs, ref.k + ref.probs):
                torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)


def test_every_kind_of_plan_meets_the_layer_plan_contract():
    """Backend plans and the plans callers pass (probe, generation, gain probe) all say whether they group heads and
    whether they run eager; an object that only computes attention is refused where GPT.forward reads them."""
    from aah_lightning.model.attention import LayerPlan, get_backend
    from aah_lightning.windows.controller.gain import OneHeadWindow

    model = tiny_model()
    cpu = torch.device("cpu")
    built = [
        get_backend(name).build((4, 8, 16, 20), 20, None, device=cpu, block_size=16) for name in ("banded", "split")
    ]
    cache, _ = gen.prefill(model, [[1, 2, 3]], max_new_tokens=2)
    wrappers = [Recording(built[0]), OneHeadWindow(built[0], 1, 8, None), *cache.plans]
    for plan in built + wrappers:
        assert isinstance(plan, LayerPlan), type(plan).__name__
    assert built[1].head_groups is not None and not built[1].eager  # split runs its groups through the layer

    class OnlyAttention:
        def __call__(self, q, k, v):
            return q

    assert not isinstance(OnlyAttention(), LayerPlan)
    idx = torch.randint(40, (1, 20), generator=torch.Generator().manual_seed(1))
    with pytest.raises(AttributeError, match="head_groups|eager"):
        model(idx, plans=[OnlyAttention(), OnlyAttention()])
