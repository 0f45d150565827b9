"""The attention sink beside a sliding-window kernel that has none (FlashAttention's: ``varlen``, ``fa4_window``).

A FlashAttention call computes one band, keys ``q - W + 1 .. q``. With a sink, a query ``q >= W`` also sees the first
``sink`` keys of its sequence (its document, under the document mask: each document is its own varlen sequence) that
lie outside that band. Those few keys are scored here, in plain torch, and merged with the kernel's result through
the log-sum-exp: ``lse = logaddexp(lse_band, lse_sink)``, ``out = exp(lse_band - lse) out_band + sum_j p_j v_j``. The
backward needs no gradient of the kernel's log-sum-exp: a FlashAttention backward recomputes the probabilities from
the log-sum-exp and the output it is handed, so given the *merged* ones it returns the band's share of the gradient of
the whole softmax (the rule ring attention relies on), and ``sink_grads`` adds the sink keys' share.

Every tensor is in the varlen layout: q, k, v ``[tokens, heads, D]``, ``cu_seqlens`` (int32 ``[n + 1]``) the sequence
starts, the log-sum-exp ``[heads, tokens]`` in float32. The sink keys are gathered per query (``[tokens, sink, heads,
D]``, sink times the keys of the group, while the op runs) and recomputed in the backward, not saved.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _sink_keys(q: Tensor, cu_seqlens: Tensor, window: int, sink: int) -> tuple[Tensor, Tensor]:
    """Per query, the positions of its sequence's first ``sink`` tokens ``[tokens, sink]`` and whether it sees each
    through the sink (inside the sequence, and outside the query's band: ``q - j >= W``)."""
    tokens = q.shape[0]
    t = torch.arange(tokens, device=q.device)
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    seq = torch.searchsorted(cu[1:], t, right=True)
    start, length = cu[seq], cu[seq + 1] - cu[seq]
    j = torch.arange(sink, device=q.device)
    seen = (j < length.view(-1, 1)) & ((t - start).view(-1, 1) - j >= window)
    return start.view(-1, 1) + torch.where(seen, j, 0), seen


def _sink_scores(q: Tensor, k: Tensor, cu_seqlens: Tensor, window: int, sink: int):
    """The sink keys' scores ``[tokens, heads, sink]`` (-inf where not seen), their positions, and the precision."""
    acc = torch.promote_types(q.dtype, torch.float32)
    index, seen = _sink_keys(q, cu_seqlens, window, sink)
    keys = k[index].to(acc)  # [tokens, sink, heads, D]
    scores = torch.einsum("thd,tshd->ths", q.to(acc), keys) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~seen.unsqueeze(1), -math.inf), index, keys, acc


def merge_sink(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor, window: int, sink: int
) -> tuple[Tensor, Tensor]:
    """The band's ``out`` and ``lse`` (a kernel's, window ``window``) merged with the sink keys: the attention of the
    window and the sink, and its log-sum-exp ``[heads, tokens]`` (float32)."""
    scores, index, _, acc = _sink_scores(q, k, cu_seqlens, window, sink)
    band = lse.transpose(0, 1).to(acc)  # [tokens, heads]
    total = torch.logaddexp(band, torch.logsumexp(scores, -1))
    p = torch.exp(scores - total.unsqueeze(-1))  # [tokens, heads, sink]
    merged = out.to(acc) * torch.exp(band - total).unsqueeze(-1) + torch.einsum("ths,tshd->thd", p, v[index].to(acc))
    return merged.to(out.dtype), total.transpose(0, 1).to(lse.dtype).contiguous()


def sink_grads(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    window: int,
    sink: int,
    band_grads: tuple[Tensor, Tensor, Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """``band_grads`` (the kernel's backward, handed the merged ``out`` and ``lse``) plus the sink keys' share of the
    gradient of the whole softmax."""
    scores, index, keys, acc = _sink_scores(q, k, cu_seqlens, window, sink)
    p = torch.exp(scores - lse.transpose(0, 1).to(acc).unsqueeze(-1))  # the sink keys' probabilities
    do = dout.to(acc)
    values = v[index].to(acc)
    ds = p * (torch.einsum("thd,tshd->ths", do, values) - (do * out.to(acc)).sum(-1, keepdim=True))
    scale = 1 / math.sqrt(q.shape[-1])
    dq, dk, dv = (g.to(acc) for g in band_grads)
    dq = dq + torch.einsum("ths,tshd->thd", ds, keys) * scale
    flat = index.flatten()
    dk = dk.index_add(0, flat, (torch.einsum("ths,thd->tshd", ds, q.to(acc)) * scale).flatten(0, 1))
    dv = dv.index_add(0, flat, torch.einsum("ths,thd->tshd", p, do).flatten(0, 1))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
