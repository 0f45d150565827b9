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

# Pairs, coverage and tiles are counted in one place (model/window_math.py); the run's metrics re-export them.
from aah_lightning.model.window_math import block_density, causal_coverage, causal_pairs

__all__ = ["acr", "block_density", "causal_coverage", "causal_pairs", "window_fractions"]


def acr(windows: Tensor, seq_len: int) -> Tensor:
    """Attention coverage ratio of a window table ``[..., H]`` at sequence length ``seq_len``."""
    return (torch.clamp(windows.to(torch.float64), max=seq_len) / seq_len).mean()


def window_fractions(windows: Tensor, candidates: list[int]) -> dict[int, Tensor]:
    """Share of heads whose window equals each candidate."""
    flat = windows.reshape(-1)
    return {c: (flat == c).to(torch.float64).mean() for c in candidates}
