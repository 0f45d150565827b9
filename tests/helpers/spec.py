"""The attention mask written from the spec (not from the code), and random per-head windows and inputs.

Query i of head h may attend to key j iff 0 <= i - j < W[h] (and, with documents, doc[i] == doc[j]). The float64
reference attention is the package's (``aah_lightning.model.attention.reference``, built from the mask_mod);
tests/model/test_masks.py holds the mask_mod and that reference to this mask.
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


def random_windows(heads, seq_len, generator):
    """Per-head windows covering 1, tiny, mid, >= T."""
    choices = torch.tensor([1, 2, 3, 5, 16, 64, 128, 200, seq_len, seq_len + 7])
    return choices[torch.randint(len(choices), (heads,), generator=generator)].clamp(min=1).to(torch.int32)


def random_qkv(B, H, T, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]
