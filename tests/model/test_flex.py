"""Analytic BlockMask, balanced head order for the CPU flex kernel, and flex against the float64 reference."""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from aah_lightning.model import masks
from aah_lightning.model.attention import AttentionPlanner, flex
from aah_lightning.model.attention.flex import FlexPlan, balanced_order
from aah_lightning.model.attention.reference import reference_attention
from helpers.spec import random_qkv


@pytest.mark.parametrize("T,block", [(1, 128), (100, 128), (700, 128), (700, 64), (1024, 256)])
def test_analytic_block_mask_backward_orientation_matches_torch(T, block):
    """q tiles per kv tile (what the backward reads) equal torch's own transpose of the kv tiles; the kv side is
    checked against the mask_mod in test_masks.py."""
    row = torch.tensor([1, 64, 127, 128, 129, 300, T, T + 50], dtype=torch.int32)
    ours = masks.window_block_mask(row, T, block)
    torchs = BlockMask.from_kv_blocks(
        ours.kv_num_blocks,
        ours.kv_indices,
        ours.full_kv_num_blocks,
        ours.full_kv_indices,
        BLOCK_SIZE=block,
        mask_mod=ours.mask_mod,
        seq_lengths=(T, T),
    )
    for field in ("q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, field), getattr(torchs, field)), field
    for field in ("kv_indices", "full_kv_indices", "q_indices", "full_q_indices"):
        assert getattr(ours, field).is_contiguous(), field  # kernels index them with their own strides
    for field, count in (("q_indices", "q_num_blocks"), ("full_q_indices", "full_q_num_blocks")):
        n = getattr(ours, count).unsqueeze(-1)
        keep = torch.arange(getattr(ours, field).shape[-1]) < n  # only the listed entries are meaningful
        assert torch.equal(getattr(ours, field)[keep], getattr(torchs, field)[keep]), field


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
    monkeypatch.setattr(flex.torch, "get_num_threads", lambda: 2)
    plan = AttentionPlanner().plans(table, T, "flex")[0]
    assert plan.order is not None and plan.order.tolist() != list(range(8))
    # the BlockMask follows the order: head i of the mask is head order[i] of the layer
    assert torch.equal(
        plan.block_mask.kv_num_blocks[0], masks.window_block_mask(table[0], T).kv_num_blocks[0][plan.order]
    )
    # eager flex (no compile) on the permuted heads gives the reference in the layer's order
    q, k, v = (x.detach() for x in random_qkv(1, 8, T, 16, 0, torch.float32))
    with torch.no_grad():
        perm = [x.index_select(1, plan.order) for x in (q, k, v)]
        out = flex_attention(*perm, block_mask=plan.block_mask).index_select(1, plan.inverse)
        ref = reference_attention(q, k, v, table[0])
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_cpu_head_order_only_when_it_helps():
    T, increasing = 4096, torch.tensor([512, 512, 1024, 2048, 4096, 4096], dtype=torch.int32)
    assert flex.cpu_head_order(increasing, T, 128, threads=1) is None  # one thread: nothing to balance
    order = flex.cpu_head_order(increasing, T, 128, threads=2)
    assert order is not None
    partial, full = masks.window_tiles(increasing, T, 128)
    items = (partial | full).sum(-1)
    assert flex.cpu_makespan(items[order], 2) < 0.8 * flex.cpu_makespan(items, 2)
    interleaved = torch.tensor([4096, 512, 2048, 4096, 512, 1024], dtype=torch.int32)
    assert flex.cpu_head_order(interleaved, T, 128, threads=2) is None  # already balanced: no copies
    assert flex.cpu_head_order(torch.full((6,), 512, dtype=torch.int32), T, 128, threads=2) is None


@pytest.mark.heavy
def test_compiled_flex_balanced_equals_unbalanced_and_reference():
    T = 512
    row = torch.tensor([1, 37, 128, 200, 300, 512, 700, 512], dtype=torch.int32)
    q, k, v = (x.detach() for x in random_qkv(2, 8, T, 16, 1, torch.float32))
    order = torch.tensor(flex.balanced_order([float(min(w, T)) for w in row.tolist()], threads=2))
    assert order.tolist() != list(range(8))
    balanced = FlexPlan(tuple(row.tolist()), T, masks.window_block_mask(row[order], T), order, torch.argsort(order))
    plain = FlexPlan(tuple(row.tolist()), T, masks.window_block_mask(row, T))
    with torch.no_grad():
        a = balanced(q, k, v)
        b = plain(q, k, v)
        ref = reference_attention(q, k, v, row)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.double(), ref, atol=2e-5, rtol=2e-5)
