"""``sdpa``: ``scaled_dot_product_attention`` with the dense boolean mask of the mask_mod - the reference, and CPU
training of short sequences. Both take grouped-query attention natively (SDPA's ``enable_gqa``). ``CausalPlan`` (fused causal SDPA) also runs every layer whose heads all see the whole
sequence, under every backend, and the full-window heads of the split plans."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from aah_lightning.model import masks
from aah_lightning.model.attention.registry import Backend, Plan, register


@dataclass(frozen=True, eq=False)
class CausalPlan(Plan):
    """Plain causal attention (every head's window covers T, no documents): SDPA's fused causal kernel."""

    row: tuple[int, ...]
    seq_len: int
    kind = "causal"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


@dataclass(frozen=True, eq=False)
class DensePlan(Plan):
    """SDPA with the dense ``[B or 1, H, T, T]`` mask evaluated from the mask_mod (every pair computed)."""

    row: tuple[int, ...]
    seq_len: int
    mask: Tensor
    sink: int = 0
    kind = "dense"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=k.shape[1] != q.shape[1])

    def computed_pairs(self, block_size: int) -> int:
        return len(self.row) * self.seq_len * self.seq_len


@register
class SdpaBackend(Backend):
    name = "sdpa"

    def build(self, row, seq_len, doc_ids, *, device, block_size, sink=0) -> Plan:
        mask_mod = masks.window_mask_mod(torch.tensor(row, dtype=torch.int32, device=device), doc_ids, sink)
        batch = 1 if doc_ids is None else doc_ids.shape[0]
        return DensePlan(row, seq_len, masks.dense_mask(mask_mod, batch, len(row), seq_len, device), sink)
