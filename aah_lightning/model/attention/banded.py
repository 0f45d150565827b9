"""``banded``: per-head causal windows at a cost proportional to T * W, with autograd, from SDPA calls. CPU training
and inference (``auto`` from T = 256 on).

FlexAttention has no backward on CPU, and SDPA with the dense ``[T, T]`` mask of the mask_mod computes every pair
(docs/benchmarks.md: over twice a causal call at T=4096). This backend computes only a band around the diagonal, with
the fused SDPA kernels (flash attention on CPU, with a mask where one is needed) on strided views of q, k, v:

Heads of one layer are grouped by their window (clipped to T). A group whose window covers the sequence is one causal
SDPA call. A group with window ``W < T`` splits its queries into two parts, two SDPA calls:

* prefix  ``[0, W)``: every earlier key lies within the window, so this part is plain causal attention (over the full
  k and v: the causal kernel stops at the diagonal, and no slice of k, v needs a backward of its own);
* body    ``[W, T)`` in ``n = ceil((T - W) / C)`` chunks of ``C`` queries (the last one padded); the chunk starting at
  query ``s`` needs keys ``[s - W + 1, s + C)``; it is given ``[s - W, s + C)``, ``L = C + W`` keys, so that the
  spans are overlapping windows of k and v on the chunk grid (``unfold``: a view, not a copy). The mask inside a
  span is the same for every chunk, so one ``[C, L]`` mask serves every chunk of every head of the group in one call.
  Padded keys lie after every real query, so causality already hides them from real queries.

Work per head: ``W^2/2 + n C (C + W)`` pairs instead of ``T^2/2``. The masks are evaluated from
``masks.window_mask_mod`` (the single source of truth) at the absolute positions of the first chunk, when the plan is
built (at control steps; cached per (W, T)), never on the hot path. The prefix and full-window groups rely on the
identity "q < W implies every causal key is in the window", which the tests check against the float64 reference.

Few parts means few kernel launches and few memory passes: on a busy machine every parallel region pays for its
threads' scheduling, so the part count matters as much as the pair count. The CPU flash backward parallelises over
(batch, head) pairs only, so a group with fewer pairs than threads (one full-window head at batch 1) runs its backward
on fewer threads; the forward splits query blocks too.

With document masking (per-batch ``doc_ids``) the same parts run once per sequence, every part with a mask evaluated
from the mask_mod (per chunk in the body; prefix and full-window groups included), so documents are exact; these masks
are built per batch, like every document mask.

An attention sink (the first ``sink`` positions, of the sequence or of each document) changes only the body: every
chunk's keys are its span plus ``m`` sink columns, the sink positions before the span that a query of the chunk may
see (the first ``sink`` positions; with documents those of the chunk's queries' documents: one document for packed
runs). The columns are gathered copies of k and v, and the chunk masks (now per chunk) are the mask_mod at the sink
positions and at the span, so each key is counted once: before the span through the sink columns, inside it through
the span. The prefix needs nothing: a query ``q < W`` has every earlier key, sinks included, inside its window.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from aah_lightning.model.attention.registry import Backend, Plan, expand_kv, register
from aah_lightning.model.masks import document_positions, window_mask_mod

# Body chunk size: small chunks waste less of the span (about C^2 of the C * (C + W) pairs are masked), large chunks
# run the kernel more efficiently; the bounds are the measured best range (docs/benchmarks.md, banded chunk size).
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
    prefix_mask: Tensor | None  # [B, W, W] with documents, else None (causal)
    body_mask: Tensor | None  # [C, C + W], or [B, n, C, C + W] with documents (they differ per chunk); with a sink
    # [(B,) n, C, m + C + W]: the sink columns first
    sink_index: Tensor | None = None  # [(B,) n, m]: the sink columns' positions per chunk (None: no sink columns)


@dataclass(frozen=True, eq=False)
class BandedPlan(Plan):
    """A layer's banded execution: head groups in ascending window order, and the permutation that produced it."""

    row: tuple[int, ...]
    seq_len: int
    groups: tuple[HeadGroup, ...]
    order: Tensor | None  # heads in grouped order (index into the layer's heads); None = already grouped
    inverse: Tensor | None  # undoes ``order`` on the output
    batch: int | None = None  # with document masking: the batch size the masks were built for
    sink: int = 0
    kind = "banded"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return banded_attention(q, k, v, self)

    def computed_pairs(self, block_size: int) -> int:
        return sum(band_pairs(w, self.seq_len, self.sink) for w in self.row)


def _split(window: int, seq_len: int) -> tuple[int, int, int]:
    """(window clipped to T, chunk size, number of body chunks, the last one padded)."""
    w = min(window, seq_len)
    if w >= seq_len:
        return w, 0, 0
    c = chunk_size(w)
    return w, c, -(-(seq_len - w) // c)


def band_pairs(window: int, seq_len: int, sink: int = 0) -> int:
    """(query, key) pairs the banded backend computes for one head (masked and padded pairs included; with documents
    a chunk may carry more sink columns than ``sink``)."""
    w, c, n = _split(window, seq_len)
    return w * (w + 1) // 2 + n * c * (c + w + min(sink, seq_len))


def biased_band_pairs(window: int, seq_len: int) -> int:
    """(query, key) pairs a biased group computes for one head (``banded_attention`` with a ``bias``): its prefix is
    scored as a full square (a float mask, no causal kernel), its body as ``band_pairs`` counts it."""
    w = min(window, seq_len)
    return band_pairs(window, seq_len) + w * (w - 1) // 2


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


def sink_columns(doc_ids: Tensor, window: int, seq_len: int, sink: int) -> tuple[Tensor, Tensor]:
    """The sink columns of a windowed group's body chunks: positions ``[B, n, m]`` and whether each is real
    ``[B, n, m]`` (padding columns point at position 0). Chunk ``i`` (queries from ``W + i C``, its span from ``i C``)
    gets the sink positions before its span (a document's first ``sink`` tokens, ``masks.document_positions``) of the
    documents its queries belong to. ``doc_ids``: ``[B, T]`` (one document for all without document masking)."""
    w, c, n = _split(window, seq_len)
    device = doc_ids.device
    rank = document_positions(doc_ids)
    first = torch.arange(n, device=device) * c  # where each chunk's span starts
    q_pos = (w + first.view(n, 1) + torch.arange(c, device=device)).clamp(max=seq_len - 1)  # [n, C]
    rows_index, rows_valid = [], []
    for docs, ranks in zip(doc_ids, rank):
        sinks = (ranks < sink).nonzero().flatten()  # every sink position of the row, ascending
        mine = (docs[q_pos].unsqueeze(-1) == docs[sinks].view(1, 1, -1)).any(1)  # [n, P]: a chunk query's document
        valid = mine & (sinks.view(1, -1) < first.view(n, 1))  # ... and before the chunk's span
        order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)  # real columns first, ascending
        rows_index.append(sinks[order]), rows_valid.append(valid.gather(-1, order))
    m = max(1, max(int(v.sum(-1).max()) if v.numel() else 0 for v in rows_valid))
    pad = [max(0, m - x.shape[-1]) for x in rows_index]
    index = torch.stack([torch.nn.functional.pad(x, (0, p))[:, :m] for x, p in zip(rows_index, pad)])
    valid = torch.stack([torch.nn.functional.pad(x, (0, p))[:, :m] for x, p in zip(rows_valid, pad)])
    return torch.where(valid, index, 0), valid


def _group_masks(mask_mod, head: int, window: int, seq_len: int, batch: int | None, device, doc_ids=None, sink=0):
    """(prefix, body, sink_index) masks of a head group, evaluated from ``mask_mod`` at the parts' absolute positions
    (``sink_index``: the sink columns' positions, None without a sink)."""
    w, c, n = _split(window, seq_len)

    def pos(start: int, count: int) -> Tensor:
        return torch.arange(start, start + count, device=device)

    prefix = None if batch is None else _eval_mask(mask_mod, head, batch, pos(0, w)[:, None], pos(0, w)[None])
    if not n:
        return prefix, None, None
    span = c + w
    if batch is None and not sink:  # the band is the same in every chunk: evaluate it on the first one
        return prefix, _eval_mask(mask_mod, head, None, pos(w, c)[:, None], pos(0, span)[None]), None
    first = torch.arange(n, device=device).view(n, 1, 1) * c
    q_idx, kv_idx = first + pos(w, c).view(1, c, 1), first + pos(0, span).view(1, 1, span)
    # Padded positions (>= T) have no document: evaluate at T - 1 (padded queries then see the last key, so no row
    # is empty) and hide padded keys.
    last = seq_len - 1
    body = _eval_mask(mask_mod, head, batch, q_idx.clamp(max=last), kv_idx.clamp(max=last)) & (kv_idx <= last)
    if not sink:
        return prefix, body, None
    docs = torch.zeros(1, seq_len, dtype=torch.long, device=device) if doc_ids is None else doc_ids
    index, valid = sink_columns(docs, window, seq_len, sink)  # [B or 1, n, m]
    h = torch.tensor(head, device=device)
    if batch is None:  # the same columns for every sequence
        index, valid = index[0], valid[0]
        b = torch.zeros((), dtype=torch.long, device=device)
    else:
        b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    sinks = mask_mod(b, h, q_idx.clamp(max=last), index.unsqueeze(-2)) & valid.unsqueeze(-2)  # [(B,) n, C, m]
    return prefix, torch.cat([sinks, body], dim=-1), index


@functools.lru_cache(maxsize=64)
def _window_masks(window: int, seq_len: int, device: torch.device, sink: int):
    """Masks of a window without documents: they depend on (W, T, sink) only, so layers and rebuilds share them."""
    mask_mod = window_mask_mod(torch.tensor([window], dtype=torch.int32, device=device), sink=sink)
    return _group_masks(mask_mod, 0, window, seq_len, None, device, sink=sink)


def build_plan(windows_row, seq_len: int, doc_ids: Tensor | None = None, device=None, sink: int = 0) -> BandedPlan:
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
        mask_mod = window_mask_mod(torch.tensor(windows, dtype=torch.int32, device=device), doc_ids, sink)
    groups, start = [], 0
    while start < len(order):
        head = order[start]  # any head of the group stands for all: they share the window
        stop = start
        while stop < len(order) and row[order[stop]] == row[head]:
            stop += 1
        w, c, _ = _split(row[head], seq_len)
        if doc_ids is None:
            masks = _window_masks(w, seq_len, device, sink)
        else:
            masks = _group_masks(mask_mod, head, w, seq_len, doc_ids.shape[0], device, doc_ids, sink)
        groups.append(HeadGroup(start, stop, w, c, *masks))
        start = stop
    batch = None if doc_ids is None else doc_ids.shape[0]
    if order == sorted(order):
        return BandedPlan(tuple(windows), seq_len, tuple(groups), None, None, batch, sink)
    perm = torch.tensor(order, device=device)
    return BandedPlan(tuple(windows), seq_len, tuple(groups), perm, torch.argsort(perm), batch, sink)


def _group(q: Tensor, k: Tensor, v: Tensor, g: HeadGroup, b: int | None) -> Tensor:
    """Attention of heads sharing window ``g.window``. q, k, v: ``[B, h, T, D]`` -> ``[B, h, T, D]``. ``b``: the batch
    element (the tensors hold only it) whose masks to use, with document masking."""

    def mask(m: Tensor | None) -> Tensor | None:
        return m if m is None or b is None else m[b]

    B, h, T, D = q.shape
    w, c = g.window, g.chunk
    prefix_mask = mask(g.prefix_mask)
    if w >= T:
        if prefix_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=prefix_mask)
    q_prefix, q_body = q.split([w, T - w], dim=2)
    if prefix_mask is None:  # q < W: every causal key is inside the window; top-left causal over all of k
        prefix = F.scaled_dot_product_attention(q_prefix, k, v, is_causal=True)
    else:
        prefix = F.scaled_dot_product_attention(q_prefix, k[:, :, :w], v[:, :, :w], attn_mask=prefix_mask)
    n = -(-(T - w) // c)
    pad = n * c - (T - w)
    if pad:  # only when C does not divide T - W (powers of two never pad)
        q_body, k, v = F.pad(q_body, (0, 0, 0, pad)), F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    qc = q_body.reshape(B * h, n, c, D)
    # The chunk starting at query W + i*C reads keys [i*C, W + (i+1)*C): overlapping views of k and v, no copy. The
    # first key of each span is never visible (it is W keys back); it keeps every span aligned to the chunk grid.
    kc, vc = (x.reshape(B * h, T + pad, D).unfold(1, c + w, c).transpose(-1, -2) for x in (k, v))
    if g.sink_index is not None:  # each chunk's sink columns before its span: gathered copies
        index = mask(g.sink_index)  # [n, m]
        kc, vc = (
            torch.cat([x.index_select(2, index.flatten()).reshape(B * h, n, -1, D), span], dim=2)
            for x, span in ((k, kc), (v, vc))
        )
    # reshape, not view: SDPA's CUDA kernels may return these chunks in a layout a view cannot merge (fp32, H200)
    body = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask(g.body_mask)).reshape(B, h, n * c, D)
    return torch.cat([prefix, body[:, :, : T - w] if pad else body], dim=2)


def _biased_group(q: Tensor, k: Tensor, v: Tensor, g: HeadGroup, b: int | None, bias) -> Tensor:
    """``_group`` with an additive score bias that depends on each head and on the distance (query minus key):
    ``bias(distance)`` maps a float tensor of distances to ``[h, *distance.shape]`` (``-inf``: the key is masked). The
    same parts as ``_group`` (prefix, chunked body), each an SDPA call with a float mask: the window's mask where it
    is False, the bias where it is True. A separate function, so the unbiased path stays exactly as it is."""
    if g.sink_index is not None:
        raise ValueError("a biased banded group takes no sink columns")

    def mask(m: Tensor | None) -> Tensor | None:
        return m if m is None or b is None else m[b]

    def attend(q: Tensor, k: Tensor, v: Tensor, distance: Tensor, allowed: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(allowed, bias(distance), float("-inf")))

    B, h, T, D = q.shape
    w, c = g.window, g.chunk
    pos = torch.arange(T + w + c, device=q.device, dtype=torch.float64)
    prefix_mask = mask(g.prefix_mask)
    if w >= T:
        d = pos[:T, None] - pos[None, :T]
        return attend(q, k, v, d, d >= 0 if prefix_mask is None else prefix_mask)
    q_prefix, q_body = q.split([w, T - w], dim=2)
    d = pos[:w, None] - pos[None, :w]
    prefix = attend(q_prefix, k[:, :, :w], v[:, :, :w], d, d >= 0 if prefix_mask is None else prefix_mask)
    n = -(-(T - w) // c)
    pad = n * c - (T - w)
    if pad:
        q_body, k, v = F.pad(q_body, (0, 0, 0, pad)), F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    # [B, h, n, C, D] queries against [B, h, n, C + W, D] overlapping key spans (as in _group); the bias is the same
    # in every chunk (query i of a chunk and key j of its span lie W + i - j apart), the window mask per chunk with
    # documents.
    qc = q_body.reshape(B, h, n, c, D)
    kc, vc = (  # each with its own last dim: a value may be wider than the keys
        x.reshape(B * h, T + pad, -1).unfold(1, c + w, c).transpose(-1, -2).reshape(B, h, n, c + w, -1) for x in (k, v)
    )
    d = (w + pos[:c, None]) - pos[None, : c + w]
    body_bias = bias(d).unsqueeze(1)  # [h, 1, C, C + W]
    body = F.scaled_dot_product_attention(
        qc, kc, vc, attn_mask=torch.where(mask(g.body_mask), body_bias, float("-inf"))
    ).reshape(B, h, n * c, -1)
    return torch.cat([prefix, body[:, :, : T - w] if pad else body], dim=2)


def _layer(q: Tensor, k: Tensor, v: Tensor, plan: BandedPlan, b: int | None, bias=None) -> Tensor:
    def run(qg: Tensor, kg: Tensor, vg: Tensor, g: HeadGroup) -> Tensor:
        if bias is None:
            return _group(qg, kg, vg, g, b)
        # on q's device: no host copy on the training path
        heads = torch.arange(g.start, g.stop, device=q.device) if plan.order is None else plan.order[g.start : g.stop]
        return _biased_group(qg, kg, vg, g, b, functools.partial(bias, heads))

    if len(plan.groups) == 1:
        return run(q, k, v, plan.groups[0])
    sizes = [g.stop - g.start for g in plan.groups]
    parts = zip(*(x.split(sizes, dim=1) for x in (q, k, v)))  # split, not slices: one backward copy per tensor
    return torch.cat([run(qg, kg, vg, g) for (qg, kg, vg), g in zip(parts, plan.groups)], dim=1)


def banded_attention(q: Tensor, k: Tensor, v: Tensor, plan: BandedPlan, bias=None) -> Tensor:
    """q ``[B, H, T, D]``, k, v ``[B, Hkv, T, D]`` -> ``[B, H, T, D]``, exactly the mask_mod's attention.

    ``bias``: None, or ``bias(heads, distance)`` -> ``[len(heads), *distance.shape]``, an additive score bias for the
    layer's heads ``heads`` (an index tensor on q's device) at float64 distances (query minus key), ``-inf`` to mask a key; the
    learned span's ramp (``soft_span.py``) is one. The scores are biased only inside each head's window."""
    if q.shape[2] != plan.seq_len:
        raise ValueError(f"banded plan built for T={plan.seq_len}, called with T={q.shape[2]}")
    # Window groups cut across key/value groups: under grouped-query attention each query head gets its own copy of
    # its key/value head (expand_kv), in the plan's head order.
    k, v = (expand_kv(x, q.shape[1], plan.order) for x in (k, v))
    if plan.order is not None:
        q = q.index_select(1, plan.order)
    if plan.batch is None:
        y = _layer(q, k, v, plan, None, bias)
    else:  # document masks differ per sequence: one pass per batch element, its masks broadcast over heads
        if q.shape[0] != plan.batch:
            raise ValueError(f"banded plan built for batch {plan.batch}, called with {q.shape[0]}")
        y = torch.cat([_layer(q[i : i + 1], k[i : i + 1], v[i : i + 1], plan, i, bias) for i in range(plan.batch)])
    return y if plan.inverse is None else y.index_select(1, plan.inverse)


@register
class BandedBackend(Backend):
    name = "banded"

    def build(self, row, seq_len, doc_ids, *, device, block_size, sink=0) -> Plan:
        return build_plan(row, seq_len, doc_ids, device, sink)
