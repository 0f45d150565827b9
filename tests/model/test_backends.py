"""Every attention backend against the float64 dense reference, with random per-head windows and attention sinks."""

import pytest
import torch

from aah_lightning.model.attention import AttentionPlanner, BackendUnavailable, resolve_backend
from aah_lightning.model.attention.reference import reference_attention
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from helpers.spec import random_sink, random_windows

SEQ_LENS = [1, 7, 130, 257]


def qkv(seq_len, heads=5, dim=16, batch=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, dim, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]


def run_backend(backend, q, k, v, windows, doc_ids=None, sink=0):
    table = windows.view(1, -1)
    plan = AttentionPlanner(block_size=128).plans(table, q.shape[2], backend, doc_ids, sink)[0]
    return plan(q, k, v)


@pytest.mark.parametrize("sink", [0, "random"])
@pytest.mark.parametrize("seq_len", SEQ_LENS + [512])
def test_sdpa_matches_reference_forward_and_backward(seq_len, sink):
    g = torch.Generator().manual_seed(seq_len)
    w = random_windows(5, seq_len, g)
    sink = random_sink(seq_len, g) or 2 if sink else 0
    q, k, v = qkv(seq_len)
    out = run_backend("sdpa", q, k, v, w, sink=sink)
    ref = reference_attention(q, k, v, w, sink=sink)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("sink", [0, 3])
def test_sdpa_with_documents_matches_reference(sink):
    q, k, v = qkv(40, heads=3)
    docs = torch.cat([torch.zeros(2, 10), torch.ones(2, 25), torch.full((2, 5), 2.0)], dim=1).long()
    docs[1, :3] = 7  # a different layout in the second sequence
    w = torch.tensor([40, 4, 12], dtype=torch.int32)
    out = run_backend("sdpa", q, k, v, w, docs, sink)
    torch.testing.assert_close(out, reference_attention(q, k, v, w, docs, sink), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("sink", [0, 4])
def test_full_window_layers_run_causal_and_match(sink):
    q, k, v = qkv(33)
    w = torch.tensor([33, 40, 1000, 33, 33], dtype=torch.int32)
    plan = AttentionPlanner().plans(w.view(1, -1), 33, "sdpa", sink=sink)[0]
    assert plan.kind == "causal"  # a sink changes nothing for heads that see the whole sequence
    torch.testing.assert_close(plan(q, k, v), reference_attention(q, k, v, w, sink=sink))


@pytest.mark.heavy
@pytest.mark.parametrize("seq_len", SEQ_LENS + [1024])
def test_compiled_flex_forward_matches_reference(seq_len):
    # Compiled flex on CPU: float32 only, forward only (torch has no CPU backward for it). Each length compiles its
    # own graph, so each also takes one sink (none at 1 and 257).
    g = torch.Generator().manual_seed(seq_len)
    w = random_windows(5, seq_len, g)
    sink = {1: 0, 7: 3, 130: 17, 257: 0, 1024: 200}[seq_len]
    q, k, v = (x.detach().float() for x in qkv(seq_len))
    with torch.no_grad():
        out = run_backend("flex", q, k, v, w, sink=sink)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, w, sink=sink), rtol=2e-5, atol=2e-5)


def test_flex_training_on_cpu_is_refused_with_advice():
    with pytest.raises(BackendUnavailable, match="model.gpt.backend=flex cannot train on cpu.*auto"):
        resolve_backend("flex", torch.device("cpu"), needs_grad=True, seq_len=64)
    assert resolve_backend("auto", torch.device("cpu"), needs_grad=True, seq_len=4096) == "banded"
    assert resolve_backend("auto", torch.device("cpu"), needs_grad=False, seq_len=4096) == "banded"
    assert resolve_backend("auto", torch.device("cpu"), needs_grad=True, seq_len=64) == "sdpa"
    assert resolve_backend("auto", torch.device("cuda"), needs_grad=True, seq_len=64) == "flex_tuned"


def tiny_gpt(seq_len=64, **kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, seq_len=seq_len, n_layer=2, n_head=4, n_embd=32, **kw)).double()


def test_changing_the_table_gives_the_new_result_not_a_stale_one():
    model = tiny_gpt()
    x = torch.randint(0, 50, (2, 64))
    first = model(x)
    new = torch.tensor([[1, 2, 8, 64], [64, 3, 3, 5]], dtype=torch.int32)
    model.set_windows(new)
    after = model(x)
    fresh = tiny_gpt()
    fresh.set_windows(new)
    torch.testing.assert_close(after, fresh(x))
    assert not torch.allclose(first, after)
    # A write that bypasses set_windows (e.g. load_state_dict, in-place indexing) is noticed too.
    model.windows[1, 0] = 2
    fresh.windows[1, 0] = 2
    torch.testing.assert_close(model(x), fresh(x))


def test_masks_are_cached_per_row_and_rebuilt_only_for_changed_layers():
    model = tiny_gpt()
    x = torch.randint(0, 50, (1, 64))
    model.set_windows(torch.tensor([[4, 8, 16, 64], [4, 8, 16, 64]]))
    model(x)
    assert model.planner.builds == 1  # identical rows share one mask
    model(x)
    assert model.planner.builds == 1  # nothing changed: nothing rebuilt
    model.set_windows(torch.tensor([[4, 8, 16, 64], [2, 8, 16, 64]]))
    model(x)
    assert model.planner.builds == 2  # only the changed layer


def test_state_dict_carries_the_window_table():
    model = tiny_gpt()
    model.set_windows(torch.tensor([[4, 8, 16, 64], [2, 8, 16, 32]]))
    other = tiny_gpt()
    other.load_state_dict(model.state_dict())
    assert torch.equal(other.windows, model.windows)
    x = torch.randint(0, 50, (1, 64))
    torch.testing.assert_close(other(x), model(x))


def test_document_mask_stops_information_crossing_documents():
    model = tiny_gpt(document_mask=True)
    x = torch.randint(0, 50, (1, 64))
    docs = torch.cat([torch.zeros(1, 30), torch.ones(1, 34)], dim=1).long()
    base = model(x, docs)
    y = x.clone()
    y[0, :30] = (y[0, :30] + 1) % 50  # change only document 0
    changed = model(y, docs)
    torch.testing.assert_close(changed[0, 30:], base[0, 30:])
    assert not torch.allclose(changed[0, :30], base[0, :30])


@pytest.mark.heavy
def test_gpt_with_flex_equals_gpt_with_sdpa_and_window_changes_do_not_recompile():
    import torch._dynamo.utils as dyn

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, seq_len=256, n_layer=2, n_head=4, n_embd=32))
    x = torch.randint(0, 50, (2, 256))
    tables = [torch.tensor([[16, 32, 64, 256], [8, 256, 130, 3]]), torch.tensor([[1, 200, 5, 64], [256, 9, 17, 100]])]
    with torch.no_grad():
        for i, table in enumerate(tables):
            model.set_windows(table)
            flex = model(x, backend="flex")
            if i == 0:
                graphs = dyn.counters["stats"]["unique_graphs"]
            sdpa = model(x, backend="sdpa")
            torch.testing.assert_close(flex, sdpa, rtol=1e-4, atol=1e-4)
    assert dyn.counters["stats"]["unique_graphs"] == graphs  # new window values: no new graph
