"""Diagnostics of a window table (definitions: docs/method.md). Pure tensor math, no host syncs.

* ACR (the paper's definition, kept exactly): mean over (layer, head) of ``min(W, T) / T``.
* causal coverage: allowed causal pairs / all causal pairs, ``pairs(W, T) = W(W+1)/2 + (T-W)W`` for ``W <= T``
  over ``T(T+1)/2`` - the work a perfect kernel does.
* block density: non-empty tiles of the BlockMask / causal tiles - the work FlexAttention does.
* window fractions: share of heads on each candidate window.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aah_lightning.model.masks import window_tiles


def _clipped(windows: Tensor, seq_len: int) -> Tensor:
    return torch.clamp(windows.to(torch.float64), max=seq_len)


def acr(windows: Tensor, seq_len: int) -> Tensor:
    """Attention coverage ratio of a window table ``[..., H]`` at sequence length ``seq_len``."""
    return (_clipped(windows, seq_len) / seq_len).mean()


def causal_pairs(windows: Tensor, seq_len: int) -> Tensor:
    """Number of (query, key) pairs a head with window W attends to over a length-T sequence."""
    w = _clipped(windows, seq_len)
    return w * (w + 1) / 2 + (seq_len - w) * w


def causal_coverage(windows: Tensor, seq_len: int) -> Tensor:
    """Allowed causal pairs / all causal pairs, over every head of the table."""
    return causal_pairs(windows, seq_len).mean() / (seq_len * (seq_len + 1) / 2)


def block_density(windows: Tensor, seq_len: int, block_size: int = 128) -> Tensor:
    """Non-empty (partial + full) tiles / causal tiles over every head, for the analytic BlockMask of the table."""
    table = windows.reshape(-1, windows.shape[-1])
    used = sum(sum(t.sum() for t in window_tiles(row, seq_len, block_size)) for row in table)
    n = -(-seq_len // block_size)
    return used.to(torch.float64) / (table.numel() * n * (n + 1) / 2)


def window_fractions(windows: Tensor, candidates: list[int]) -> dict[int, Tensor]:
    """Share of heads whose window equals each candidate."""
    flat = windows.reshape(-1)
    return {c: (flat == c).to(torch.float64).mean() for c in candidates}
