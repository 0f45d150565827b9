"""Analytic BlockMask, balanced head order for the CPU flex kernel, and flex against the float64 reference."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from aah_lightning.model import backends, masks
from aah_lightning.model.backends import AttentionPlanner, LayerPlan, attend, balanced_order

from test_banded import random_qkv, reference


def dense_tiles(indices, counts, n_cols):
    """Ordered (count, index) tile lists -> bool [..., rows, n_cols]."""
    rows = torch.zeros(*indices.shape[:-1], n_cols, dtype=torch.bool)
    keep = torch.arange(indices.shape[-1]) < counts.unsqueeze(-1)
    return rows.scatter(-1, indices.long(), keep) if keep.any() else rows


@pytest.mark.parametrize("T,block", [(1, 128), (100, 128), (512, 128), (700, 128), (700, 64), (1024, 256)])
def test_analytic_block_mask_matches_the_mask_mod(T, block):
    row = torch.tensor([1, 64, 127, 128, 129, 300, T, T + 50], dtype=torch.int32)
    got = masks.window_block_mask(row, T, block)
    want = create_block_mask(masks.window_mask_mod(row), 1, len(row), T, T, device="cpu", BLOCK_SIZE=block)
    n = -(-T // block)
    tiles = {}
    for name, bm in (("got", got), ("want", want)):
        for field in ("kv", "full_kv", "q", "full_q"):
            tiles[name, field] = dense_tiles(getattr(bm, f"{field}_indices"), getattr(bm, f"{field}_num_blocks"), n)
    # the same non-empty tiles as create_block_mask, both orientations consistent
    assert torch.equal(tiles["got", "kv"] | tiles["got", "full_kv"], tiles["want", "kv"] | tiles["want", "full_kv"])
    assert torch.equal(tiles["got", "q"], tiles["got", "kv"].transpose(-1, -2))
    assert torch.equal(tiles["got", "full_q"], tiles["got", "full_kv"].transpose(-1, -2))
    # create_block_mask also counts padded query rows, so it may call a tile partial that is full over real rows
    assert not (tiles["want", "full_kv"] & ~tiles["got", "full_kv"]).any()
    # every tile called full is full over the real (q, kv) pairs, so skipping the mask_mod there is exact
    allowed = masks.dense_mask(masks.window_mask_mod(row), 1, len(row), T, "cpu")
    pad = n * block - T
    padded = torch.nn.functional.pad(allowed, (0, pad, 0, pad), value=True)[..., :, :T + pad]
    all_allowed = padded.view(1, len(row), n, block, n, block).all(5).all(3)
    assert not (tiles["got", "full_kv"] & ~all_allowed).any()


def test_balanced_order_splits_work_evenly():
    work = [1, 2, 4, 8, 16, 32, 32, 32]  # increasing windows: the contiguous halves carry 15 vs 112
    order = balanced_order(work, threads=2)
    assert sorted(order) == list(range(8))
    halves = [sum(work[h] for h in order[:4]), sum(work[h] for h in order[4:])]
    assert abs(halves[0] - halves[1]) <= 0.1 * sum(work)
    order3 = balanced_order([9, 1, 1, 9, 5, 5, 1], threads=3)  # rooms of 3, 2, 2 heads
    assert sorted(order3) == list(range(7))


def test_cpu_flex_plan_runs_heads_in_balanced_order(monkeypatch):
    T = 1024
    table = torch.tensor([[64, 128, 256, 512, 1024, 1024, 1024, 1024]], dtype=torch.int32)
    monkeypatch.setattr(backends.torch, "get_num_threads", lambda: 2)
    plan = AttentionPlanner().plans(table, T, "flex")[0]
    assert plan.order is not None and plan.order.tolist() != list(range(8))
    # the BlockMask follows the order: head i of the mask is head order[i] of the layer
    assert torch.equal(plan.mask.kv_num_blocks[0], masks.window_block_mask(table[0], T).kv_num_blocks[0][plan.order])
    # eager flex (no compile) on the permuted heads gives the reference in the layer's order
    q, k, v = (x.detach() for x in random_qkv(1, 8, T, 16, 0, torch.float32))
    with torch.no_grad():
        perm = [x.index_select(1, plan.order) for x in (q, k, v)]
        out = flex_attention(*perm, block_mask=plan.mask).index_select(1, plan.inverse)
        ref = reference(*(x.double() for x in (q, k, v)), table[0])
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_cpu_head_order_only_when_it_helps():
    T, increasing = 4096, torch.tensor([512, 512, 1024, 2048, 4096, 4096], dtype=torch.int32)
    assert backends.cpu_head_order(increasing, T, 128, threads=1) is None  # one thread: nothing to balance
    order = backends.cpu_head_order(increasing, T, 128, threads=2)
    assert order is not None
    partial, full = masks.window_tiles(increasing, T, 128)
    items = (partial | full).sum(-1)
    assert backends.cpu_makespan(items[order], 2) < 0.8 * backends.cpu_makespan(items, 2)
    interleaved = torch.tensor([4096, 512, 2048, 4096, 512, 1024], dtype=torch.int32)
    assert backends.cpu_head_order(interleaved, T, 128, threads=2) is None  # already balanced: no copies
    assert backends.cpu_head_order(torch.full((6,), 512, dtype=torch.int32), T, 128, threads=2) is None


@pytest.mark.heavy
def test_compiled_flex_balanced_equals_unbalanced_and_reference():
    T = 512
    row = torch.tensor([1, 37, 128, 200, 300, 512, 700, 512], dtype=torch.int32)
    q, k, v = (x.detach() for x in random_qkv(2, 8, T, 16, 1, torch.float32))
    order = torch.tensor(backends.balanced_order([float(min(w, T)) for w in row.tolist()], threads=2))
    assert order.tolist() != list(range(8))
    balanced = LayerPlan("flex", masks.window_block_mask(row[order], T), order, torch.argsort(order))
    plain = LayerPlan("flex", masks.window_block_mask(row, T))
    with torch.no_grad():
        a = attend(q, k, v, balanced)
        b = attend(q, k, v, plain)
        ref = reference(*(x.double() for x in (q, k, v)), row)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.double(), ref, atol=2e-5, rtol=2e-5)
