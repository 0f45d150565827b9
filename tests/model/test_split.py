"""Split-by-window-group plans (``split``, ``varlen``) against the float64 reference, through CPU kernels.

``split`` runs full-window heads on causal SDPA and windowed heads on banded (CPU) or flex; ``varlen``'s GPU kernel
(FlashAttention through ``torch.nn.attention.varlen``) has no CPU implementation, so its plans run here on a float64
emulation of FlashAttention's documented window semantics (helpers/flash_stand_ins.py) - everything else (head grouping, token layout, document
sequences, the ``W - 1`` window convention, scatter back) is the real code.
"""

import logging

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from aah_lightning.model import window_math
from aah_lightning.model.attention import AttentionPlanner, registry, resolve_backend, split, varlen
from aah_lightning.model.attention.reference import reference_attention
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from helpers import flash_stand_ins
from helpers.spec import allowed, random_windows

CPU = torch.device("cpu")


def qkv(batch, heads, seq_len, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, heads, seq_len, dim, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    ]


def documents(batch, seq_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.cumsum((torch.rand(batch, seq_len, generator=g) < 0.03).long(), dim=1)


def assert_matches_reference(out, q, k, v, row, doc_ids=None, sink=0):
    ref = reference_attention(q, k, v, torch.tensor(row), doc_ids, sink)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("seq_len", [1, 77, 200, 333])
@pytest.mark.parametrize("docs", [False, True])
def test_split_matches_reference_forward_and_backward(seq_len, docs):
    g = torch.Generator().manual_seed(seq_len)
    row = tuple(random_windows(6, seq_len, g).tolist())
    sink = {1: 0, 77: 2, 200: 0, 333: 40}[seq_len]
    q, k, v = qkv(2, 6, seq_len, seed=seq_len)
    doc_ids = documents(2, seq_len, seed=seq_len) if docs else None
    plan = AttentionPlanner().plans(torch.tensor([row], dtype=torch.int32), seq_len, "split", doc_ids, sink)[0]
    assert plan.kind == ("causal" if min(row) >= seq_len and not docs else "split")
    assert_matches_reference(plan(q, k, v), q, k, v, row, doc_ids, sink)


def test_split_gathers_full_window_heads_onto_causal_sdpa():
    T = 130
    row = (T, 5, 300, 17, T, 5)  # full, windowed, full (W > T), windowed, full, windowed
    plan = split.SplitBackend().build(row, T, None, device=CPU, block_size=64)
    assert plan.sizes == (3, 3) and [p.kind for p in plan.parts] == ["banded", "causal"]
    assert plan.order.tolist() == [1, 3, 5, 0, 2, 4]  # windowed heads first, then the full ones
    assert torch.equal(plan.order[plan.inverse], torch.arange(6))
    q, k, v = qkv(1, 6, T)
    assert_matches_reference(plan(q, k, v), q, k, v, row)
    grouped = split.SplitBackend().build((5, 17, 5, T, T, 300), T, None, device=CPU, block_size=64)
    assert grouped.order is None and grouped.inverse is None  # already grouped: no gather, no scatter
    counts, analytic = plan.tile_counts(64), window_math.tile_counts(row, T, 64)
    assert (counts.partial, counts.full, counts.causal) == (analytic.partial, analytic.full, analytic.causal)


@pytest.mark.parametrize("docs", [False, True])
def test_split_with_flex_forward_for_windowed_heads(monkeypatch, docs):
    """The CUDA arrangement (flex for windowed heads) run on CPU: forward only, flex eager instead of compiled (with
    documents under an attention sink: each document's first tokens)."""
    monkeypatch.setattr(split, "compiled_flex_any_heads", lambda: flex_attention)
    T = 200
    sink = 5 if docs else 0
    row = (3, 200, 64, 130, 999, 1)
    doc_ids = documents(2, T) if docs else None
    q, k, v = (x.detach().float() for x in qkv(2, 6, T))
    with torch.no_grad():
        plan = split.SplitBackend(windowed="flex").build(row, T, doc_ids, device=CPU, block_size=128, sink=sink)
        out = plan(q, k, v)
    kinds = [p.kind for p in plan.parts]
    assert kinds == (["flex"] if docs else ["flex", "causal"])
    assert plan.tile_counts(128).source == ("blockmask" if docs else "analytic+blockmask")
    torch.testing.assert_close(
        out.double(), reference_attention(q, k, v, torch.tensor(row), doc_ids, sink), rtol=2e-5, atol=2e-5
    )


def test_gpt_split_equals_gpt_sdpa_logits_and_gradients():
    torch.manual_seed(0)
    T = 96
    model = GPT(GPTConfig(seq_len=T, n_layer=2, n_head=4, n_embd=32, document_mask=True)).double()
    model.set_windows([[5, 96, 33, 96], [1, 96, 96, 40]])
    tokens, doc_ids = torch.randint(257, (2, T)), documents(2, T)
    results = []
    for backend in ("split", "sdpa"):
        model.zero_grad()
        logits = model(tokens, doc_ids, backend=backend)
        logits.square().mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("seq_len", [1, 9, 64])
def test_flash_window_convention_is_w_minus_one(seq_len):
    """(W - 1, 0) in FlashAttention's inclusive convention is exactly 0 <= q - kv < W; W >= T is plain causal."""
    i, j = torch.arange(seq_len).view(-1, 1), torch.arange(seq_len).view(1, -1)
    for w in range(1, seq_len + 3):
        left, right = varlen.flash_window(w, seq_len)
        flash = (j <= i + right) & ((j >= i - left) if left >= 0 else True)
        assert torch.equal(flash, allowed([w], seq_len)[0, 0]), w
    assert varlen.flash_window(seq_len, seq_len) == (-1, 0)


def test_document_segments_are_the_document_runs():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 6, 6, 6, 6, 6]])
    cu, longest = varlen.document_segments(docs)
    assert cu.tolist() == [0, 2, 5, 6, 7, 12] and cu.dtype == torch.int32 and longest == 5
    with pytest.raises(ValueError, match="contiguous run"):
        varlen.document_segments(torch.tensor([[0, 1, 0, 0]]))  # document 0 in two pieces


@pytest.mark.parametrize("sink", [0, 4])
@pytest.mark.parametrize("seq_len", [50, 257])
@pytest.mark.parametrize("docs", [False, True])
def test_varlen_plan_matches_reference_through_flash_semantics(monkeypatch, seq_len, docs, sink):
    flash_stand_ins.install_varlen(monkeypatch, varlen)
    g = torch.Generator().manual_seed(seq_len + docs)
    row = tuple(random_windows(6, seq_len, g).tolist()) + (seq_len, 3)
    doc_ids = documents(2, seq_len, seed=seq_len) if docs else None
    plan = varlen.VarlenBackend().build(row, seq_len, doc_ids, device=CPU, block_size=128, sink=sink)
    assert plan.kind == "varlen"
    kinds = {p.kind for p in plan.parts}
    assert kinds == ({"varlen"} if docs else {"varlen", "causal"})  # with documents even full heads need varlen
    q, k, v = qkv(2, len(row), seq_len, seed=seq_len)
    assert_matches_reference(plan(q, k, v), q, k, v, row, doc_ids, sink)


def test_varlen_off_cuda_falls_back_to_split_with_one_log_line(caplog):
    registry._logged.clear()
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        names = [resolve_backend("varlen", CPU, needs_grad=True, seq_len=512) for _ in range(3)]
    assert names == ["split"] * 3
    assert len(caplog.records) == 1 and "runs on CUDA only" in caplog.records[0].getMessage()


@pytest.mark.heavy  # compiles flex on CPU (~15 s)
def test_compiled_split_is_exact_and_new_windows_in_the_same_groups_compile_nothing():
    import torch._dynamo.utils as dyn

    T = 256
    q, k, v = (x.detach().float() for x in qkv(1, 6, T))
    # three windowed heads and three full ones in every row: only window values change
    rows = [(8, 256, 64, 256, 100, 256), (3, 256, 5, 300, 7, 256), (1, 999, 255, 256, 128, 256)]
    graphs = []
    with torch.no_grad():
        for row in rows:
            plan = split.SplitBackend(windowed="flex").build(row, T, None, device=CPU, block_size=128)
            out = plan(q, k, v)
            graphs.append(dyn.counters["stats"]["unique_graphs"])
            torch.testing.assert_close(
                out.double(), reference_attention(q, k, v, torch.tensor(row)), rtol=2e-5, atol=2e-5
            )
    assert graphs[-1] == graphs[0]
