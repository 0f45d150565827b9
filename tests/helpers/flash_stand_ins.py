"""Stand-ins for FlashAttention kernels that have no CPU implementation, written from FlashAttention's documented
semantics: ``flash_varlen_emulation`` for torch's ``varlen_attn`` (the ``varlen`` backend), and the two functions of
flash-attn-4 that ``fa4_window`` calls (``_flash_attn_fwd``, ``_flash_attn_bwd`` of ``flash_attn.cute.interface``): ``[B, T, H, D]`` or varlen
``[tokens, H, D]`` layouts, query i sees keys ``i - left .. i + right`` and none after i when causal, the log-sum-exp
``[B, H, T]`` / ``[H, tokens]`` (float32, float64 for float64 inputs); the backward recomputes the probabilities from
the log-sum-exp it is handed, as FlashAttention's does. ``install(monkeypatch)`` puts it where ``fa4_window`` imports
it from; ``varlen_forward`` / ``varlen_backward`` stand in for the ``varlen`` backend's kernel calls of torch's
FlashAttention ops (``install_varlen``)."""

from __future__ import annotations

import math
import sys
import types

import torch


def flash_varlen_emulation(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):
    """FlashAttention's varlen semantics in float64, from its documentation: sequences are the ``cu`` ranges of the
    ``[tokens, heads, D]`` inputs; within one, query i sees key j iff ``i - left <= j <= i + right`` (a negative
    bound is unbounded)."""
    assert torch.equal(cu_q, cu_k) and max_q == max_k == int(cu_q.diff().max())
    left, right = window_size
    outs = []
    for start, stop in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        i, j = torch.arange(stop - start).view(-1, 1), torch.arange(stop - start).view(1, -1)
        ok = torch.ones(stop - start, stop - start, dtype=torch.bool)
        if right >= 0:
            ok &= j <= i + right
        if left >= 0:
            ok &= j >= i - left
        s = torch.einsum("ihd,jhd->hij", q[start:stop], k[start:stop]) / math.sqrt(q.shape[-1])
        p = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1)
        outs.append(torch.einsum("hij,jhd->ihd", p, v[start:stop]))
    return torch.cat(outs)


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
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    if batched:
        return torch.stack(outs), torch.stack(lses).to(lse_dtype), None, None, None
    return torch.cat(outs), torch.cat(lses, -1).to(lse_dtype), None, None, None


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
        row_q, row_k, row_v, row_o, row_do, row_dq, row_dk, row_dv, row_lse = (
            x if r is None else x[r] for x in (q, k, v, out, dout, dq, dk, dv, lse)
        )
        for a, b in _sequences(cu_seqlens_q, row_q.shape[0]):
            qq, kk, vv, oo, do = (x[a:b] for x in (row_q, row_k, row_v, row_o, row_do))
            p, own, scale = _probs(qq, kk, causal, window_size_left, window_size_right, softmax_scale)
            p = p * torch.exp(own - row_lse[:, a:b].to(own.dtype)).unsqueeze(-1)  # exp(s - lse) of the lse handed in
            dp = torch.einsum("qhd,khd->hqk", do, vv)
            ds = p * (dp - (do * oo).sum(-1).transpose(0, 1).unsqueeze(-1))
            row_dv[a:b] = torch.einsum("hqk,qhd->khd", p, do)
            row_dq[a:b] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
            row_dk[a:b] = torch.einsum("hqk,qhd->khd", ds, qq) * scale
    return dq, dk, dv


def install(monkeypatch) -> list[tuple]:
    """Install the stand-in for one test; returns the list of its forward calls (kind, window)."""
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.ModuleType("flash_attn.cute"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    CALLS.clear()
    return CALLS


def _fa4_window(window_size):
    """FlashAttention-2's ``(left, right)`` (-1: unbounded) as FA4's keywords (None: unbounded)."""
    left, right = window_size
    return {"window_size_left": None if left < 0 else left, "window_size_right": None if right < 0 else right}


def varlen_forward(q, k, v, cu_seqlens, max_len, window_size):
    """The ``varlen`` backend's forward kernel call (torch's FlashAttention varlen op): ``(out, lse [H, tokens])``."""
    out, lse, *_ = _flash_attn_fwd(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, return_lse=True, **_fa4_window(window_size)
    )
    return out, lse


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens, max_len, window_size):
    """The ``varlen`` backend's backward kernel call: ``(dq, dk, dv)`` from the output and log-sum-exp handed in."""
    return _flash_attn_bwd(
        q, k, v, out, dout, lse, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, **_fa4_window(window_size)
    )


def install_varlen(monkeypatch, varlen_module) -> None:
    """The ``varlen`` backend's kernels on the CPU: ``varlen_attn`` and the two calls its sink path makes."""
    monkeypatch.setattr(varlen_module, "varlen_attn", flash_varlen_emulation)
    monkeypatch.setattr(varlen_module, "kernel_forward", varlen_forward)
    monkeypatch.setattr(varlen_module, "kernel_backward", varlen_backward)
