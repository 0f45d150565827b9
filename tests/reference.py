"""A float64 dense reference for attention with per-head windows, written from the spec (not from the code).

Query i of head h may attend to key j iff 0 <= i - j < W[h] (and, with documents, doc[i] == doc[j]).
"""

import torch


def allowed(windows, seq_len, doc_ids=None):
    """bool [B or 1, H, T, T] built with explicit index arithmetic."""
    i = torch.arange(seq_len).view(-1, 1)
    j = torch.arange(seq_len).view(1, -1)
    d = i - j
    m = torch.stack([(d >= 0) & (d < int(w)) for w in windows]).unsqueeze(0)
    if doc_ids is not None:
        m = m & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    return m


def reference_attention(q, k, v, windows, doc_ids=None):
    """Explicit masked softmax in float64: q, k, v [B, H, T, D] -> [B, H, T, D]."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed(windows, q.shape[2], doc_ids), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def random_windows(heads, seq_len, generator):
    """Per-head windows covering 1, tiny, mid, >= T."""
    choices = torch.tensor([1, 2, 3, 5, 16, 64, 128, 200, seq_len, seq_len + 7])
    return choices[torch.randint(len(choices), (heads,), generator=generator)].clamp(min=1).to(torch.int32)
