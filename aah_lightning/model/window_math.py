"""Counting what a window table costs: pairs, tiles, block density, causal coverage, default candidate windows.

One home for this arithmetic: the metrics the run logs, the FLOP count behind MFU, the BlockMask, the plans'
diagnostics and the benchmarks all import it from here.

* pairs: a head with window W attends ``pairs(W, T) = W(W+1)/2 + (T-W)W`` (query, key) pairs over T tokens, with
  ``W = min(W, T)`` - the work a perfect kernel does; full causal is ``T(T+1)/2``. An attention sink of S positions
  adds ``sink_pairs(W, S, T)``: the pairs of queries ``q >= W`` with the first S keys that lie outside their window,
  ``sum over t = 1 .. T - W of min(S, t)``.
* causal coverage: allowed causal pairs / all causal pairs, over every head.
* tiles: the ``block_size x block_size`` tiles of the ``T x T`` score matrix a block-sparse kernel visits, each
  *partial* (runs the mask) or *full* (every pair allowed, no mask); *causal* tiles are those of full causal attention.
* block density: visited (partial + full) tiles / causal tiles.
* grouped-query attention: every query head keeps its own window; a key/value head serves a group of query heads,
  and its keys must be kept as far back as the group's widest window reaches (``kv_group_windows``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def default_candidates(seq_len: int) -> list[int]:
    """The candidate windows policies choose from unless configured: T/8, T/4, T/2 and T (at least 1, no repeats)."""
    return sorted({max(1, seq_len // 8), max(1, seq_len // 4), max(1, seq_len // 2), seq_len})


def sink_pairs(window: int, sink: int, seq_len: int) -> int:
    """(query, key) pairs an attention sink of ``sink`` positions adds to a head with window ``window``: each query
    ``q >= W`` also sees the first keys ``j < sink`` with ``q - j >= W`` (``sum_{t=1}^{T-W} min(S, t)``; exact)."""
    m, s = max(0, seq_len - int(window)), min(int(sink), seq_len)
    return m * (m + 1) // 2 if m <= s else s * (s + 1) // 2 + (m - s) * s


def window_pairs(window: int, seq_len: int, sink: int = 0) -> int:
    """(query, key) pairs a head with window ``window`` (and the model's ``sink``) attends to over ``seq_len`` tokens
    (exact integer)."""
    w = min(int(window), seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w + sink_pairs(w, sink, seq_len)


def causal_pairs(windows: Tensor, seq_len: int, sink: int = 0) -> Tensor:
    """``window_pairs`` of every entry of a window tensor, as float64 (no host sync)."""
    w = torch.clamp(windows.to(torch.float64), max=seq_len)
    pairs = w * (w + 1) / 2 + (seq_len - w) * w
    if sink:
        m, s = seq_len - w, float(min(sink, seq_len))
        pairs = pairs + torch.where(m <= s, m * (m + 1) / 2, s * (s + 1) / 2 + (m - s) * s)
    return pairs


def causal_coverage(windows: Tensor, seq_len: int, sink: int = 0) -> Tensor:
    """Allowed causal pairs / all causal pairs, over every head of the table (sink pairs included)."""
    return causal_pairs(windows, seq_len, sink).mean() / (seq_len * (seq_len + 1) / 2)


def window_tiles(windows_row: Tensor, seq_len: int, block_size: int, sink: int = 0) -> tuple[Tensor, Tensor]:
    """Tile classes of the causal-window mask, in closed form.

    Returns bool ``(partial, full)`` of shape ``[H, n, n]`` (``n = ceil(T / block_size)``; q tile first): a tile is
    non-empty iff some pair in it satisfies ``0 <= q - kv < W`` (or, with a ``sink``, ``kv < sink <= ...``: the first
    kv tile column(s) below the diagonal), and full iff every pair does (so the kernel can skip the mask_mod there):
    each key is a sink or within the window of every query of the tile. Padded rows of the last q tile never make a
    tile full: the last kv tile only meets the diagonal.
    """
    n = math.ceil(seq_len / block_size)
    idx = torch.arange(n, device=windows_row.device)
    i, j = idx.view(n, 1), idx.view(1, n)
    w = windows_row.to(torch.int64).view(-1, 1, 1)
    q_max = torch.clamp(i * block_size + block_size - 1, max=seq_len - 1)
    closest = (i - j) * block_size - (block_size - 1)  # smallest q - kv inside tile (i, j)
    nonempty = (j <= i) & ((closest < w) | (j * block_size < sink))
    # Keys below ``sink`` are visible to every later query: only the tile's keys from ``sink`` on need the window,
    # so the largest q - kv that must fit is from the last query to the first of those keys.
    first_windowed = torch.clamp(j * block_size, min=sink)
    all_sink = first_windowed > j * block_size + block_size - 1
    full = (j < i) & (all_sink | (q_max - first_windowed < w))
    return nonempty & ~full, full


def causal_tiles(seq_len: int, block_size: int) -> int:
    """Tiles of one head's full causal mask: the lower triangle of the tile grid, diagonal included."""
    n = math.ceil(seq_len / block_size)
    return n * (n + 1) // 2


@dataclass(frozen=True)
class TileCounts:
    """Tiles a layer's kernel visits, summed over its heads, and the causal tiles of the same heads.

    ``source`` says where the numbers come from: ``"blockmask"`` (counted on the BlockMask the kernel ran with) or
    ``"analytic"`` (``window_tiles`` of the layer's windows at the model's tile size).
    """

    partial: int
    full: int
    causal: int
    source: str = "analytic"

    @property
    def density(self) -> float:
        """Visited tiles / causal tiles (the block density)."""
        return (self.partial + self.full) / self.causal


def tile_counts(windows_row, seq_len: int, block_size: int, sink: int = 0) -> TileCounts:
    """Analytic ``TileCounts`` of one layer (``windows_row``: ints or an int tensor ``[H]``)."""
    row = torch.as_tensor(windows_row, dtype=torch.int64).reshape(-1).cpu()
    partial, full = window_tiles(row, seq_len, block_size, sink)
    return TileCounts(int(partial.sum()), int(full.sum()), row.numel() * causal_tiles(seq_len, block_size))


def block_density(windows: Tensor, seq_len: int, block_size: int = 128, sink: int = 0) -> Tensor:
    """Non-empty (partial + full) tiles / causal tiles over every head of a table ``[..., H]``, for its analytic
    BlockMask (a 0-dim float64 tensor on the table's device)."""
    table = windows.reshape(-1, windows.shape[-1])
    used = sum(sum(t.sum() for t in window_tiles(row, seq_len, block_size, sink)) for row in table)
    return used.to(torch.float64) / (table.numel() * causal_tiles(seq_len, block_size))


def kv_group_windows(table, n_kv_head: int) -> Tensor:
    """The window of each key/value head under grouped-query attention: the widest window of the query heads that read
    it (query head ``h`` reads key/value head ``h // (n_head / n_kv_head)``). A decode cache must keep that many of
    its keys; a query head with a narrower window reads only its newest ones. ``table``: int ``[n_layer, n_head]``
    (a tensor or nested lists) -> ``[n_layer, n_kv_head]``; ``n_kv_head = n_head`` returns the table itself."""
    table = torch.as_tensor(table)
    n_layer, n_head = table.shape
    if n_kv_head < 1 or n_head % n_kv_head:
        raise ValueError(f"n_kv_head={n_kv_head} does not divide the table's {n_head} heads")
    return table.view(n_layer, n_kv_head, n_head // n_kv_head).amax(-1)
