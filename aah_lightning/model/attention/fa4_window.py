"""``fa4_window``: heads grouped by window, one FlashAttention-4 sliding-window call per group.

FlashAttention-4's own kernels (``flash_attn.cute.flash_attn_func`` with ``causal=True, window_size=(W - 1, 0)``) take
one window per call and run it natively: no mask_mod, no BlockMask, no torch code generation in between (unlike
``flex_fa4``, which reaches the same kernels through flex's FLASH backend). It is ``varlen``'s layout with a faster
kernel: full-window heads run fused causal SDPA, each other window group is one call on its slice of heads (the layer
reorders its weights, ``head_groups``: no activation is copied), and with documents every document is its own
sequence of a varlen call (``flash_attn_varlen_func``), which needs every document to be one contiguous run of
positions in its row. FlashAttention's windows are inclusive (query i sees keys ``i - left .. i``), so W keys are
``left = W - 1``; a group whose window covers the sequence passes no window (plain causal).

Needs a CUDA GPU of compute capability 9.0 or newer, ``flash-attn-4`` (``pip install -e ".[fa4]"``) and bf16 / fp16;
otherwise it runs ``varlen`` (torch's bundled FlashAttention-2 sliding windows, the same grouping) with one log line.
flash-attn-4 registers no custom op for ``torch.compile``, so each call is kept out of compiled graphs
(``torch.compiler.disable``): in a compiled block every windowed group is a graph break.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aah_lightning.model.attention import flex
from aah_lightning.model.attention.registry import AVAILABLE, Availability, Backend, Plan, register
from aah_lightning.model.attention.sdpa import CausalPlan
from aah_lightning.model.attention.split import SplitPlan, split_plan
from aah_lightning.model.attention.varlen import document_segments


def fa4_window_size(window: int, seq_len: int) -> tuple[int | None, int | None]:
    """FlashAttention-4's ``window_size`` for our window of W keys: ``(W - 1, 0)``; ``(None, None)`` (no window: plain
    causal) when it covers the sequence. FA4 reads a left size of -1 as a window, not as "none", unlike FA2."""
    return (None, None) if window >= seq_len else (int(window) - 1, 0)


@torch.compiler.disable  # flash-attn-4 is opaque to dynamo: a graph break, never a traced guess
def fa4_attention(q, k, v, window_size, cu_seqlens: Tensor | None, max_len: int | None) -> Tensor:
    """``[B, h, T, D]`` attention of heads that share ``window_size``, through FlashAttention-4 (``[B, T, h, D]``
    layout there); with ``cu_seqlens``, the ``B * T`` tokens as varlen sequences."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    B, h, T, D = q.shape
    if cu_seqlens is None:
        out, _ = flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=True, window_size=window_size)
        return out.transpose(1, 2)
    tokens = [x.transpose(1, 2).reshape(B * T, h, D) for x in (q, k, v)]
    out, _ = flash_attn_varlen_func(
        *tokens,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
        causal=True,
        window_size=window_size,
    )
    return out.view(B, T, h, D).transpose(1, 2)


@dataclass(frozen=True, eq=False)
class Fa4WindowPlan(Plan):
    """One FlashAttention-4 call for heads that share a window. ``cu_seqlens``/``max_len``: the document sequences,
    or None: one sequence per row."""

    row: tuple[int, ...]
    seq_len: int
    window_size: tuple[int | None, int | None]
    cu_seqlens: Tensor | None = None
    max_len: int | None = None
    kind = "fa4_window"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return fa4_attention(q, k, v, self.window_size, self.cu_seqlens, self.max_len)


class Fa4GroupsPlan(SplitPlan):
    kind = "fa4_window"


@register
class Fa4WindowBackend(Backend):
    name = "fa4_window"
    fallback = "varlen"
    dtypes = (torch.bfloat16, torch.float16)

    def available(self, device, needs_grad) -> Availability:
        reason = flex.fa4_missing(device)
        return AVAILABLE if reason is None else Availability(False, reason)

    def build(self, row, seq_len, doc_ids, *, device, block_size) -> Plan:
        segments = (None, None) if doc_ids is None else document_segments(doc_ids, self.name)

        def part(sub_row):
            if doc_ids is None and min(sub_row) >= seq_len:
                return CausalPlan(sub_row, seq_len)
            return Fa4WindowPlan(sub_row, seq_len, fa4_window_size(sub_row[0], seq_len), *segments)

        return split_plan(row, seq_len, [min(w, seq_len) for w in row], part, device, Fa4GroupsPlan)
