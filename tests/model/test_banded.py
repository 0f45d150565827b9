"""The banded backend against a float64 reference built from the mask_mod, forward and backward."""

import pytest
import torch

from aah_lightning.model.attention import AttentionPlanner, banded, resolve_backend
from aah_lightning.model.attention.reference import reference_attention
from helpers.spec import random_qkv, random_sink, random_windows


def random_row(H, T, seed):
    """The shared reference's windows plus ones around the banded chunking (W = T/3, T - 1, 37, 130)."""
    g = torch.Generator().manual_seed(seed)
    extra = torch.tensor([max(1, T // 3), max(1, T - 1), 37, 130], dtype=torch.int32)
    row = random_windows(H, T, g)
    pick = torch.rand(H, generator=g) < 0.4
    return torch.where(pick, extra[torch.randint(len(extra), (H,), generator=g)], row)


def check(q, k, v, row, doc_ids=None, tol=1e-10, sink=0):
    T = q.shape[2]
    plan = banded.build_plan(row, T, doc_ids, sink=sink)
    out = banded.banded_attention(q, k, v, plan)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = reference_attention(q, k, v, row, doc_ids, sink)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"grad {name}")


@pytest.mark.parametrize("T", [1, 2, 7, 33, 130, 257, 300])
def test_random_windows_forward_backward(T):
    g = torch.Generator().manual_seed(T)
    for seed in range(3):
        row = random_row(6, T, seed)
        check(*random_qkv(2, 6, T, 8, seed), row, sink=0 if seed == 0 else random_sink(T, g) or 1)


@pytest.mark.parametrize(
    "row",
    [
        [512, 512, 512, 512],  # one group, no permutation
        [64, 128, 256, 512],  # increasing
        [512, 32, 512, 96],  # interleaved groups
        [1, 511, 600, 100],  # W=1 (diagonal only), W = T - 1, W > T
    ],
)
@pytest.mark.parametrize("sink", [0, 4])
def test_chunked_layouts(row, sink):
    """T=512 exercises body chunks of every size (32..128), tails, and heads whose window exceeds T; a sink adds its
    columns to every chunk whose span starts after it."""
    check(*random_qkv(1, 4, 512, 16, 0), torch.tensor(row, dtype=torch.int32), sink=sink)


def test_float32_matches_float64_reference():
    q, k, v = random_qkv(1, 4, 384, 32, 1, torch.float32)
    row = torch.tensor([48, 384, 130, 200], dtype=torch.int32)
    out = banded.banded_attention(q, k, v, banded.build_plan(row, 384))
    ref = reference_attention(q, k, v, row)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_document_mask():
    T = 200
    g = torch.Generator().manual_seed(3)
    doc_ids = torch.cumsum((torch.rand(2, T, generator=g) < 0.03).long(), dim=1)
    for seed, sink in ((0, 0), (1, 0), (2, 3), (3, 40)):  # with a sink: each document's first tokens
        check(*random_qkv(2, 5, T, 8, seed), random_row(5, T, seed + 10), doc_ids, sink=sink)
    # documents in pieces (not what packing makes): a chunk's queries may need the sinks of several documents
    pieces = torch.randint(0, 3, (2, T), generator=g)
    check(*random_qkv(2, 5, T, 8, 4), random_row(5, T, 14), pieces, sink=2)


def test_changing_windows_changes_results():
    q, k, v = random_qkv(1, 3, 260, 8, 0)
    planner = AttentionPlanner()
    table = torch.tensor([[260, 260, 260]], dtype=torch.int32)
    before = planner.plans(table, 260, "banded")[0](q, k, v)
    table.copy_(torch.tensor([[16, 260, 100]]))
    after = planner.plans(table, 260, "banded")[0](q, k, v)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, reference_attention(q, k, v, table[0]))
    torch.testing.assert_close(before[:, 1], after[:, 1])  # the unchanged head


def test_band_pairs_counts_the_work():
    T = 4096
    assert banded.band_pairs(T, T) == T * (T + 1) // 2
    assert banded.band_pairs(10 * T, T) == T * (T + 1) // 2
    w = 512  # prefix W^2/2 + 28 chunks of 128 queries x 640 keys
    assert banded.band_pairs(w, T) == w * (w + 1) // 2 + (T - w) * (128 + w)
    assert banded.band_pairs(w, T, sink=4) == w * (w + 1) // 2 + (T - w) * (128 + w + 4)  # 4 sink columns per chunk


def test_auto_picks_a_backend_that_runs():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, True, 4096) == "banded"
    assert resolve_backend("auto", cpu, True, 64) == "sdpa"
    assert resolve_backend("auto", cpu, False, 4096) == "banded"  # faster than compiled flex on CPU, no compile
    q, k, v = random_qkv(1, 2, 300, 8, 0)
    table = torch.tensor([[40, 300]], dtype=torch.int32)
    for T in (64, 300):
        name = resolve_backend("auto", cpu, True, T)
        plan = AttentionPlanner().plans(table, T, name)[0]
        out = plan(*(x[:, :, :T] for x in (q, k, v)))
        out.sum().backward()
        torch.testing.assert_close(out, reference_attention(*(x[:, :, :T] for x in (q, k, v)), table[0]))


@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("document_mask", [False, True])
def test_gpt_banded_equals_dense_sdpa(document_mask, sink):
    """The whole model: banded and dense-mask SDPA give the same logits and parameter gradients."""
    from aah_lightning.model.config import GPTConfig
    from aah_lightning.model.gpt import GPT

    torch.manual_seed(0)
    T = 96
    model = GPT(GPTConfig(seq_len=T, n_layer=2, n_head=4, n_embd=32, document_mask=document_mask), sink=sink)
    model = model.double()
    model.set_windows([[5, 96, 33, 40], [96, 96, 96, 96]])
    tokens = torch.randint(257, (2, T))
    doc_ids = torch.cumsum((torch.rand(2, T) < 0.05).long(), dim=1)
    results = []
    for backend in ("banded", "sdpa"):
        model.zero_grad()
        logits = model(tokens, doc_ids, backend=backend)
        logits.square().mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    second = "banded" if document_mask else "causal"  # all heads W >= T: causal, unless documents split it
    assert [p.kind for p in model.attention_plans(T, doc_ids, "banded")] == ["banded", second]
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)
