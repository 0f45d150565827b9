"""The attention mask written from the spec (not from the code), and random per-head windows, sinks and inputs.

Query i of head h may attend to key j iff j <= i and (i - j < W[h] or j is among the first S positions: the attention
sink), and, with documents, doc[i] == doc[j] (the sink is then the first S positions of the query's own document).
The float64 reference attention is the package's (``aah_lightning.model.attention.reference``, built from the
mask_mod); tests/model/test_masks.py holds the mask_mod and that reference to this mask.
"""

import torch


def allowed(windows, seq_len, doc_ids=None, sink=0):
    """bool [B or 1, H, T, T] built with explicit index arithmetic."""
    i = torch.arange(seq_len).view(-1, 1)
    j = torch.arange(seq_len).view(1, -1)
    d = i - j
    if doc_ids is None:
        is_sink = (j < sink).unsqueeze(0)  # [1, 1, T]
    else:  # j's position in its own document: the earlier tokens of its row with the same id
        is_sink = torch.tensor(
            [[sum(1 for t in range(p) if row[t] == row[p]) < sink for p in range(seq_len)] for row in doc_ids.tolist()]
        ).unsqueeze(1)  # [B, 1, T]
    m = torch.stack([(d >= 0) & ((d < int(w)) | is_sink) for w in windows], dim=1)  # [B or 1, H, T, T]
    if doc_ids is not None:
        m = m & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    return m


def random_windows(heads, seq_len, generator):
    """Per-head windows covering 1, tiny, mid, >= T."""
    choices = torch.tensor([1, 2, 3, 5, 16, 64, 128, 200, seq_len, seq_len + 7])
    return choices[torch.randint(len(choices), (heads,), generator=generator)].clamp(min=1).to(torch.int32)


def random_sink(seq_len, generator):
    """An attention sink: none, one position, a few, or more than a tile of 16."""
    choices = [0, 1, 3, 4, 17, seq_len // 3]
    return choices[int(torch.randint(len(choices), (1,), generator=generator))]


def random_qkv(B, H, T, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]
