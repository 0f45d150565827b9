"""``fa4_window`` on CPU, with a stand-in for the two functions of flash-attn-4 it calls (``_flash_attn_fwd``,
``_flash_attn_bwd`` of ``flash_attn.cute.interface``), written from FlashAttention's documented semantics: ``[B, T, H,
D]`` or varlen ``[tokens, H, D]`` layouts, query i sees keys ``i - left .. i + right`` and none after i when causal,
the log-sum-exp ``[B, H, T]`` / ``[H, tokens]``. What this checks is aah's side: the window convention, the layouts,
the custom ops and their autograd, the groups, documents as varlen sequences, the layer's weight path, a compiled
block. FlashAttention-4 itself runs on a Hopper GPU only (``tools/gpu_tune.py`` and ``tools/gpu_check.py`` check it
there against the same float64 reference)."""

from __future__ import annotations

import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from aah_lightning.lit import distributed
from aah_lightning.model.attention import fa4_window, get_backend, registry, resolve_backend
from aah_lightning.model.attention.reference import reference_attention
from aah_lightning.model.attention.registry import AVAILABLE
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT

CALLS: list[tuple] = []


def _probs(q, k, causal, left, right, softmax_scale):
    """One sequence, ``[T, H, D]``: the attention probabilities ``[H, T, T]`` and log-sum-exp ``[H, T]`` under
    FlashAttention's rule, and the scale."""
    T, D = q.shape[0], q.shape[-1]
    if causal:
        right = 0
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    allowed = torch.ones(T, T, dtype=torch.bool)
    if left is not None:
        allowed &= j >= i - left
    if right is not None:
        allowed &= j <= i + right
    scale = softmax_scale or 1 / math.sqrt(D)
    scores = (torch.einsum("qhd,khd->hqk", q, k) * scale).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1), torch.logsumexp(scores, -1), scale


def _sequences(cu_seqlens, n):
    bounds = [0, n] if cu_seqlens is None else cu_seqlens.tolist()
    return list(zip(bounds, bounds[1:]))


def _flash_attn_fwd(
    q,
    k,
    v,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    softmax_scale=None,
    causal=False,
    window_size_left=None,
    window_size_right=None,
    return_lse=False,
    **_,
):
    CALLS.append(("varlen" if cu_seqlens_q is not None else "batch", (window_size_left, window_size_right)))
    if cu_seqlens_q is not None:
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max_seqlen_k == int(
            cu_seqlens_q.diff().max()
        )
    batched = cu_seqlens_q is None
    rows = [(q[b], k[b], v[b]) for b in range(q.shape[0])] if batched else [(q, k, v)]
    outs, lses = [], []
    for qq, kk, vv in rows:
        for a, b in _sequences(cu_seqlens_q, qq.shape[0]):
            p, lse, _ = _probs(qq[a:b], kk[a:b], causal, window_size_left, window_size_right, softmax_scale)
            outs.append(torch.einsum("hqk,khd->qhd", p, vv[a:b]))
            lses.append(lse)
    if batched:
        return torch.stack(outs), torch.stack(lses).float(), None, None, None
    return torch.cat(outs), torch.cat(lses, -1).float(), None, None, None


def _flash_attn_bwd(
    q,
    k,
    v,
    out,
    dout,
    lse,
    softmax_scale=None,
    causal=False,
    softcap=0.0,
    window_size_left=None,
    window_size_right=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    **_,
):
    """The softmax attention backward by its formulas (custom ops run their kernels without autograd)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    batched = cu_seqlens_q is None
    for r in range(q.shape[0]) if batched else [None]:
        row_q, row_k, row_v, row_o, row_do, row_dq, row_dk, row_dv = (
            x if r is None else x[r] for x in (q, k, v, out, dout, dq, dk, dv)
        )
        for a, b in _sequences(cu_seqlens_q, row_q.shape[0]):
            qq, kk, vv, oo, do = (x[a:b] for x in (row_q, row_k, row_v, row_o, row_do))
            p, _, scale = _probs(qq, kk, causal, window_size_left, window_size_right, softmax_scale)
            dp = torch.einsum("qhd,khd->hqk", do, vv)
            ds = p * (dp - (do * oo).sum(-1).transpose(0, 1).unsqueeze(-1))
            row_dv[a:b] = torch.einsum("hqk,qhd->khd", p, do)
            row_dq[a:b] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
            row_dk[a:b] = torch.einsum("hqk,qhd->khd", ds, qq) * scale
    return dq, dk, dv


@pytest.fixture
def stand_in(monkeypatch):
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.ModuleType("flash_attn.cute"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
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
    forward_calls = [c for c in stand_in]
    assert sorted((w for _, w in forward_calls), key=str) == sorted(
        (fa4_window.fa4_window_size(w, T) for w in windowed), key=str
    )  # one forward call per window group
    assert {kind for kind, _ in forward_calls} == {"varlen" if documents else "batch"}


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
    assert {w for _, w in stand_in} == {(4, 0), (11, 0), (2, 0), (19, 0)}


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


@pytest.mark.heavy  # compiles two blocks on CPU (~20 s)
def test_compiled_blocks_call_the_custom_ops_and_train_like_eager(stand_in, monkeypatch):
    """Blocks compile with fullgraph=True: FA4's calls must be graph nodes (the custom ops), not graph breaks."""
    monkeypatch.setattr(fa4_window.Fa4WindowBackend, "available", lambda self, device, needs_grad: AVAILABLE)
    T = 32
    table = torch.tensor([[5, T, 5, 12], [T, 3, 20, 3]], dtype=torch.int32)
    tokens = torch.randint(97, (2, T + 1), generator=torch.Generator().manual_seed(0))

    def step(compiled: bool):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=97, seq_len=T, n_layer=2, n_head=4, n_embd=32, backend="fa4_window"))
        model.set_windows(table)
        if compiled:
            distributed.prepare_model(SimpleNamespace(model=model), compile_blocks=True, activation_checkpointing=False)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    eager, compiled = step(False), step(True)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert len(stand_in) == 2 * 4  # two runs x (2 layers x 2 windowed groups): every group reached FA4, compiled too
