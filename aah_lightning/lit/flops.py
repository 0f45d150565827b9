"""Window-aware training FLOPs of the GPT, for ``perf/mfu``.

What a perfect kernel computes for one training sequence of length T (forward + backward = 3 x forward):

* matmuls: ``2 * N`` FLOPs per token forward, N = weights of every linear layer (q/k/v, attention output, both MLP
  matrices, and the LM head, which is tied to the embedding; the embedding lookup itself is no matmul). Biases,
  norms, GELU, RoPE and softmax are elementwise and not counted: this is the usual ``6 * N`` rule.
* attention: ``4 * head_dim`` FLOPs per (query, key) pair forward (``q . k`` and ``p * v``), counted only for the
  causal pairs inside each head's window: ``pairs(W, T) = W(W+1)/2 + (T-W)W`` with ``W = min(W, T)``.

A kernel that visits whole tiles (FlexAttention) or full rows does more work than this; MFU measured this way says
how close the run is to doing only the useful work at the device's peak.
"""

from __future__ import annotations

from collections.abc import Iterable

from aah_lightning.model.config import GPTConfig
from aah_lightning.model.window_math import window_pairs


def matmul_weights(cfg: GPTConfig) -> int:
    """Weights that take part in a matmul per token: every ``nn.Linear`` of the GPT, the tied LM head once."""
    c, hidden = cfg.n_embd, int(cfg.mlp_ratio * cfg.n_embd)
    per_layer = c * 3 * c + c * c + c * hidden + hidden * c
    return cfg.n_layer * per_layer + cfg.vocab_size * c


def attention_pairs(rows: Iterable[Iterable[int]], seq_len: int) -> int:
    """Causal in-window pairs summed over every (layer, head) of a window table given as rows of ints."""
    return sum(window_pairs(w, seq_len) for row in rows for w in row)


def forward_flops(cfg: GPTConfig, rows: Iterable[Iterable[int]], seq_len: int) -> int:
    """Forward FLOPs of one sequence of ``seq_len`` tokens under the window table ``rows``."""
    return 2 * matmul_weights(cfg) * seq_len + 4 * cfg.head_dim * attention_pairs(rows, seq_len)


def training_flops(cfg: GPTConfig, rows: Iterable[Iterable[int]], seq_len: int) -> int:
    """Forward + backward FLOPs of one training sequence (backward = 2 x forward)."""
    return 3 * forward_flops(cfg, rows, seq_len)
