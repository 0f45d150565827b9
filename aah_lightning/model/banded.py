"""Banded attention: per-head causal windows at a cost proportional to T * W, with autograd, from SDPA calls.

FlexAttention has no backward on CPU, and SDPA with the dense ``[T, T]`` mask of the mask_mod computes every pair
(~2.3x a causal call at T=4096). This backend computes only a band around the diagonal, with the fused SDPA kernels
(flash attention on CPU, with a mask where one is needed) on strided views of q, k, v:

Heads of one layer are grouped by their window (clipped to T). A group whose window covers the sequence is one causal
SDPA call. A group with window ``W < T`` splits its queries into three parts:

* prefix  ``[0, W)``: every earlier key lies within the window, so this part is plain causal attention over ``[0, W)``;
* body    ``n = (T - W) // C`` chunks of ``C`` queries; the chunk starting at query ``s`` needs keys
  ``[s - W + 1, s + C)``, i.e. ``L = C + W - 1`` keys. The chunks' key spans are overlapping windows of k and v
  (``unfold``: a view, not a copy), and the mask inside a span is the same for every chunk, so one ``[C, L]`` mask
  serves them all in one SDPA call;
* tail    the last ``< C`` queries, with their own span and mask.

Work per head: ``W^2/2 + (T - W)(C + W - 1)`` pairs instead of ``T^2/2``. The masks are evaluated from
``masks.window_mask_mod`` (the single source of truth) at the absolute positions of the first chunk and of the tail,
when the plan is built (at control steps), never on the hot path. The prefix and full-window groups rely on the
identity "q < W implies every causal key is in the window", which the tests check against the mask_mod.

With document masking (per-batch ``doc_ids``) the same parts run once per sequence, every part with its mask evaluated
from the mask_mod (prefix and full-window groups included), so documents are exact; the masks are built per batch,
like every document mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from aah_lightning.model.masks import window_mask_mod

# Body chunk size: small chunks waste less of the span (the masked triangle is C(C-1)/2 of C*L pairs), large chunks
# run the kernel more efficiently. Measured on a 2-core CPU (fp32, T=4096, fwd+bwd): 128 is best for W >= 512,
# within noise of 256; 64 and 32 cost 10-60 % more there.
MAX_CHUNK = 128
MIN_CHUNK = 32


def chunk_size(window: int) -> int:
    """Body chunk size for a window: W/4, clipped to [MIN_CHUNK, MAX_CHUNK]."""
    return max(MIN_CHUNK, min(MAX_CHUNK, window // 4))


@dataclass(frozen=True)
class HeadGroup:
    """Heads of one layer that share a window. ``start:stop`` is their range in the layer's grouped head order.

    Masks are bool (True = attend), evaluated from the mask_mod; with document masking each has a leading batch dim.
    ``prefix_mask`` None means plain causal. A group whose window covers the sequence is all prefix.
    """

    start: int
    stop: int
    window: int  # clipped to T
    chunk: int
    prefix_mask: Tensor | None  # [(B,) W, W]
    body_mask: Tensor | None  # [C, C + W - 1], or [B, n, C, C + W - 1] (documents differ per chunk)
    tail_mask: Tensor | None  # [(B,) tail, tail + W - 1]


@dataclass(frozen=True)
class BandedPlan:
    """A layer's banded execution: head groups in ascending window order, and the permutation that produced it."""

    seq_len: int
    groups: tuple[HeadGroup, ...]
    order: Tensor | None  # heads in grouped order (index into the layer's heads); None = already grouped
    inverse: Tensor | None  # undoes ``order`` on the output
    batch: int | None = None  # with document masking: the batch size the masks were built for


def _split(window: int, seq_len: int) -> tuple[int, int, int]:
    """(window clipped to T, chunk size, number of body chunks); the tail is what is left."""
    w = min(window, seq_len)
    if w >= seq_len:
        return w, 0, 0
    c = chunk_size(w)
    return w, c, (seq_len - w) // c


def band_pairs(window: int, seq_len: int) -> int:
    """(query, key) pairs the banded backend computes for one head (masked pairs included)."""
    w, c, n = _split(window, seq_len)
    tail = seq_len - w - n * c
    return w * (w + 1) // 2 + n * c * (c + w - 1) + tail * (tail + w - 1)


def _eval_mask(mask_mod, head: int, batch: int | None, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """The mask_mod on absolute positions (``q_idx [..., nq, 1]``, ``kv_idx [..., 1, nkv]``); leading batch dim iff
    ``batch`` is given."""
    device = q_idx.device
    shape = torch.broadcast_shapes(q_idx.shape, kv_idx.shape)
    h = torch.tensor(head, device=device)
    if batch is None:
        b = torch.zeros((), dtype=torch.long, device=device)
    else:
        b = torch.arange(batch, device=device).view((batch,) + (1,) * len(shape))
        shape = (batch,) + shape
    return mask_mod(b, h, q_idx, kv_idx).expand(shape).contiguous()


def _group_masks(mask_mod, head: int, window: int, seq_len: int, batch: int | None, device):
    """(prefix, body, tail) masks of a head group, evaluated from ``mask_mod`` at the parts' absolute positions."""
    w, c, n = _split(window, seq_len)
    end = w + n * c
    tail = seq_len - end

    def pos(start: int, count: int) -> Tensor:
        return torch.arange(start, start + count, device=device)

    prefix = None if batch is None else _eval_mask(mask_mod, head, batch, pos(0, w)[:, None], pos(0, w)[None])
    body = None
    if n:
        span = c + w - 1
        if batch is None:  # the band is the same in every chunk: evaluate it on the first one
            q_idx, kv_idx = pos(w, c)[:, None], pos(1, span)[None]
        else:
            first = torch.arange(n, device=device).view(n, 1, 1) * c
            q_idx, kv_idx = first + pos(w, c).view(1, c, 1), first + pos(1, span).view(1, 1, span)
        body = _eval_mask(mask_mod, head, batch, q_idx, kv_idx)
    tail_mask = None
    if tail:
        tail_mask = _eval_mask(mask_mod, head, batch, pos(end, tail)[:, None], pos(end - w + 1, tail + w - 1)[None])
    return prefix, body, tail_mask


@functools.lru_cache(maxsize=64)
def _window_masks(window: int, seq_len: int, device: torch.device):
    """Masks of a window without documents: they depend on (W, T) only, so layers and rebuilds share them."""
    mask_mod = window_mask_mod(torch.tensor([window], dtype=torch.int32, device=device))
    return _group_masks(mask_mod, 0, window, seq_len, None, device)


def build_plan(windows_row, seq_len: int, doc_ids: Tensor | None = None, device=None) -> BandedPlan:
    """Group a layer's heads by window and evaluate the masks from the mask_mod, on ``device``.

    ``windows_row``: the layer's windows as ints (the planner's host mirror) or a tensor (read on the host). Call at
    plan-building time (control steps), not per step. With ``doc_ids [B, T]`` the masks are per batch element.
    """
    if device is None:
        device = doc_ids.device if doc_ids is not None else getattr(windows_row, "device", "cpu")
    device = torch.device(device)
    windows = [int(w) for w in windows_row]
    row = [min(w, seq_len) for w in windows]
    order = sorted(range(len(row)), key=lambda h: row[h])
    if doc_ids is not None:
        mask_mod = window_mask_mod(torch.tensor(windows, dtype=torch.int32, device=device), doc_ids)
    groups, start = [], 0
    while start < len(order):
        head = order[start]  # any head of the group stands for all: they share the window
        stop = start
        while stop < len(order) and row[order[stop]] == row[head]:
            stop += 1
        w, c, _ = _split(row[head], seq_len)
        if doc_ids is None:
            masks = _window_masks(w, seq_len, device)
        else:
            masks = _group_masks(mask_mod, head, w, seq_len, doc_ids.shape[0], device)
        groups.append(HeadGroup(start, stop, w, c, *masks))
        start = stop
    batch = None if doc_ids is None else doc_ids.shape[0]
    if order == sorted(order):
        return BandedPlan(seq_len, tuple(groups), None, None, batch)
    perm = torch.tensor(order, device=device)
    return BandedPlan(seq_len, tuple(groups), perm, torch.argsort(perm), batch)


def _group(q: Tensor, k: Tensor, v: Tensor, g: HeadGroup, b: int | None) -> Tensor:
    """Attention of heads sharing window ``g.window``. q, k, v: ``[B, h, T, D]`` -> ``[B, h, T, D]``. ``b``: the batch
    element (the tensors hold only it) whose masks to use, with document masking."""

    def mask(m: Tensor | None) -> Tensor | None:
        return m if m is None or b is None else m[b]

    B, h, T, D = q.shape
    w, c = g.window, g.chunk
    n = (T - w) // c if c else 0
    end = w + n * c
    prefix = mask(g.prefix_mask)
    qp, kp, vp = q[:, :, :w], k[:, :, :w], v[:, :, :w]
    if prefix is None:  # q < W: every causal key is inside the window
        parts = [F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)]
    else:
        parts = [F.scaled_dot_product_attention(qp, kp, vp, attn_mask=prefix)]
    if n:
        span = c + w - 1
        qc = q[:, :, w:end].reshape(B * h, n, c, D)
        # Overlapping key spans [s - w + 1, s + c) for chunk starts s = w, w + c, ...: a strided view, not a copy.
        kc = k.reshape(B * h, T, D)[:, 1:end].unfold(1, span, c).transpose(-1, -2)
        vc = v.reshape(B * h, T, D)[:, 1:end].unfold(1, span, c).transpose(-1, -2)
        body = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask(g.body_mask))
        parts.append(body.view(B, h, n * c, D))
    if end < T:
        s = end - w + 1
        tail_mask = mask(g.tail_mask)
        parts.append(F.scaled_dot_product_attention(q[:, :, end:], k[:, :, s:], v[:, :, s:], attn_mask=tail_mask))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _layer(q: Tensor, k: Tensor, v: Tensor, plan: BandedPlan, b: int | None) -> Tensor:
    outs = [_group(*(x[:, g.start : g.stop] for x in (q, k, v)), g, b) for g in plan.groups]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def banded_attention(q: Tensor, k: Tensor, v: Tensor, plan: BandedPlan) -> Tensor:
    """q, k, v: ``[B, H, T, D]`` -> ``[B, H, T, D]``, exactly the mask_mod's attention."""
    if q.shape[2] != plan.seq_len:
        raise ValueError(f"banded plan built for T={plan.seq_len}, called with T={q.shape[2]}")
    if plan.order is not None:
        q, k, v = (x.index_select(1, plan.order) for x in (q, k, v))
    if plan.batch is None:
        y = _layer(q, k, v, plan, None)
    else:  # document masks differ per sequence: one pass per batch element, its masks broadcast over heads
        if q.shape[0] != plan.batch:
            raise ValueError(f"banded plan built for batch {plan.batch}, called with {q.shape[0]}")
        y = torch.cat([_layer(q[i : i + 1], k[i : i + 1], v[i : i + 1], plan, i) for i in range(plan.batch)])
    return y if plan.inverse is None else y.index_select(1, plan.inverse)
