"""``fa4_window`` on CPU, with a stand-in for flash-attn-4's two functions written from FlashAttention's documented
semantics (``[B, T, H, D]`` / varlen ``[tokens, H, D]`` layouts; query i sees keys ``i - left .. i + right``, and none
after i when causal; ``(out, lse)`` returned). What this checks is aah's side: the window convention, the layouts,
the groups, documents as varlen sequences, the layer's weight path. FlashAttention-4 itself runs on a Hopper GPU only
(``tools/gpu_tune.py`` and ``tools/gpu_check.py`` check it there against the same float64 reference)."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from aah_lightning.model.attention import fa4_window, get_backend, registry, resolve_backend
from aah_lightning.model.attention.reference import reference_attention
from aah_lightning.model.attention.registry import AVAILABLE
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT

CALLS: list[tuple] = []


def _attend(q, k, v, causal, window_size, softmax_scale=None):
    """One sequence, ``[T, H, D]``, FlashAttention's rule."""
    T, D = q.shape[0], q.shape[-1]
    left, right = window_size
    if causal:
        right = 0
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    allowed = torch.ones(T, T, dtype=torch.bool)
    if left is not None:
        allowed &= j >= i - left
    if right is not None:
        allowed &= j <= i + right
    scores = torch.einsum("qhd,khd->hqk", q, k) * (softmax_scale or 1 / math.sqrt(D))
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v), torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1)


def flash_attn_func(q, k, v, causal=False, window_size=(None, None), softmax_scale=None, **_):
    CALLS.append(("func", tuple(q.shape), window_size))
    outs = [_attend(q[b], k[b], v[b], causal, window_size, softmax_scale) for b in range(q.shape[0])]
    return torch.stack([o for o, _ in outs]), torch.stack([s for _, s in outs])


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    causal=False,
    window_size=(None, None),
    softmax_scale=None,
    **_,
):
    CALLS.append(("varlen", tuple(q.shape), window_size))
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == int(cu_seqlens_q.diff().max())
    bounds = cu_seqlens_q.tolist()
    outs = [_attend(q[a:b], k[a:b], v[a:b], causal, window_size, softmax_scale) for a, b in zip(bounds, bounds[1:])]
    return torch.cat([o for o, _ in outs]), torch.cat([s for _, s in outs], -1)


@pytest.fixture
def stand_in(monkeypatch):
    package = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func, cute.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    CALLS.clear()
    return CALLS


def test_window_size_is_inclusive_and_full_windows_pass_none():
    assert fa4_window.fa4_window_size(1, 64) == (0, 0)  # the query's own key only
    assert fa4_window.fa4_window_size(17, 64) == (16, 0)
    assert fa4_window.fa4_window_size(64, 64) == (None, None)
    assert fa4_window.fa4_window_size(100, 64) == (None, None)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("documents", [False, True])
def test_plan_equals_the_float64_reference_forward_and_backward(stand_in, seed, documents):
    B, H, T, D = 2, 6, 48, 8
    g = torch.Generator().manual_seed(seed)
    row = torch.randint(1, T + 8, (H,), generator=g).tolist()
    row[1] = row[4] = 9  # two heads share a window: one call for both
    doc_ids = None
    if documents:  # contiguous runs, as packing makes them
        doc_ids = torch.tensor([[0] * 20 + [1] * 28, [3] * 5 + [4] * 40 + [5] * 3])
    plan = get_backend("fa4_window").build(tuple(row), T, doc_ids, device=torch.device("cpu"), block_size=16)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ours = plan(q, k, v)
    want = reference_attention(q, k, v, row, doc_ids)
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-10)
    d_out = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(ours, (q, k, v), d_out)
    theirs = torch.autograd.grad(want, (q, k, v), d_out)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    windowed = {min(w, T) for w in row} - ({T} if not documents else set())
    assert sorted((w for _, _, w in stand_in), key=str) == sorted(
        (fa4_window.fa4_window_size(w, T) for w in windowed), key=str
    )  # one call per window group
    assert {kind for kind, _, _ in stand_in} == {"varlen" if documents else "func"}


def test_model_runs_the_groups_through_its_weights_like_sdpa(stand_in, monkeypatch):
    """The layer runs fa4_window's groups itself (head_groups) and trains exactly like the dense reference backend."""
    monkeypatch.setattr(fa4_window.Fa4WindowBackend, "available", lambda self, device, needs_grad: AVAILABLE)
    T = 32
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=T, n_layer=2, n_head=4, n_embd=32)).double()
    model.set_windows(torch.tensor([[5, T, 5, 12], [T, 3, 20, 3]], dtype=torch.int32))
    tokens = torch.randint(model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))

    def run(backend):
        model.zero_grad()
        logits = model(tokens, plans=model.attention_plans(T, backend=backend))
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    plans = model.attention_plans(T, backend="fa4_window")
    assert all(p.kind == "fa4_window" and p.head_groups.order is not None for p in plans)
    ours, want = run("fa4_window"), run("sdpa")
    torch.testing.assert_close(ours[0], want[0], rtol=1e-10, atol=1e-10)
    for a, b in zip(ours[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert {w for _, _, w in stand_in} == {(4, 0), (11, 0), (2, 0), (19, 0)}


def test_without_a_hopper_gpu_and_the_package_it_runs_varlen_then_split(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    reason = get_backend("fa4_window").available(cuda, needs_grad=True).reason
    assert "compute capability >= 9.0, this GPU has 8.0" in reason
    registry._logged.clear()
    assert resolve_backend("fa4_window", cuda, needs_grad=True, seq_len=4096) == "varlen"
    assert resolve_backend("fa4_window", torch.device("cpu"), needs_grad=True, seq_len=4096) == "split"
    monkeypatch.setattr(fa4_window.flex, "fa4_missing", lambda device: None)
    assert get_backend("fa4_window").available(cuda, needs_grad=True) == AVAILABLE
