"""The float64 reference every attention plan is held to, and the parity rule for plans in low precision.

``reference_attention`` is the definition of the attention aah computes: a softmax over the dense mask of
``masks.window_mask_mod`` (query ``i`` of head ``h`` attends to key ``j`` iff ``j <= i`` and ``i - j < W[h]`` or ``j``
is one of the first ``sink`` positions, and with document ids only within its document, whose first ``sink``
positions are then the sink), in float64. The tests hold every backend to it; ``tools/gpu_check.py`` and
``tools/gpu_tune.py`` hold every plan on a GPU to it with ``parity_limit``: a plan's largest error may be twice that
of SDPA with the same dense mask in the same dtype, or up to a floor per dtype, whichever is larger.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from aah_lightning.model import masks

# Errors below the floor pass whatever SDPA's own error is: float32, and every lower precision (bf16, fp16).
PARITY_FLOOR_FP32, PARITY_FLOOR_LOW = 1e-4, 2e-2


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, windows, doc_ids: Tensor | None = None, sink: int = 0
) -> Tensor:
    """Masked softmax in float64: ``q`` ``[B, H, T, D]``, ``k, v`` ``[B, Hkv, T, D]`` -> ``[B, H, T, D]`` (float64).
    With ``Hkv < H`` (grouped-query attention) query head ``h`` reads key/value head ``h // (H / Hkv)``; the window
    stays the query head's own. ``windows``: the layer's row of the window table (``[H]``, a tensor or a sequence of
    ints; values past T are plain causal); ``doc_ids``: ``[B, T]`` or None; ``sink``: the model's attention sink."""
    q, k, v = q.double(), k.double(), v.double()
    _, H, T, D = q.shape
    if k.shape[1] != H:
        k, v = (x.repeat_interleave(H // k.shape[1], dim=1) for x in (k, v))
    row = torch.as_tensor(windows).to(q.device)
    if doc_ids is not None:
        doc_ids = doc_ids.to(q.device)
    mask = masks.dense_mask(
        masks.window_mask_mod(row, doc_ids, sink), 1 if doc_ids is None else doc_ids.shape[0], H, T, q.device
    )
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def parity_floor(dtype: torch.dtype) -> float:
    """The error below which parity passes whatever SDPA's own error is."""
    return PARITY_FLOOR_FP32 if dtype == torch.float32 else PARITY_FLOOR_LOW


def parity_limit(sdpa_error: float, dtype: torch.dtype) -> float:
    """The largest error a plan may have against the float64 reference: twice SDPA's error with the same dense mask
    and dtype, or the dtype's floor."""
    return max(2 * sdpa_error, parity_floor(dtype))


def max_error(got: Tensor, want: Tensor) -> float:
    """The largest absolute difference, in float64."""
    return (got.double() - want.double()).abs().max().item()
