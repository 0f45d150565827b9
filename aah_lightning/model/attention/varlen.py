"""``varlen``: heads grouped by window, one sliding-window flash call per group through torch's own varlen attention
(``torch.nn.attention.varlen.varlen_attn``, bundled with torch: no extra package). CUDA only, bf16 / fp16; elsewhere
it falls back to ``split`` (one log line).

Full-window heads run fused causal SDPA (as in ``split``); each other group is one ``varlen_attn`` call with
``window_size=(W - 1, 0)``: FlashAttention's windows are inclusive (query i sees keys ``i - left .. i + right``), so
our W keys ``0 <= q - kv < W`` are ``left = W - 1``, ``right = 0``. The batch is laid out as varlen sequences
(``[B * T, heads, D]``, one sequence per row); with documents each document is its own sequence, so a group with
full windows runs through varlen too (``window_size=(-1, 0)``: causal). That needs every document to be one
contiguous run of positions in its row (what packing produces), checked when the plan is built. Under grouped-query
attention the groups' plans receive one key/value head per query head (``SplitPlan`` and the layer expand them).

FlashAttention has no sink of positions: with ``model.aah.sink`` each windowed group runs one custom op
(``aah::varlen_sink_forward`` / ``_backward``) around torch's FlashAttention ops, which merges the sink keys into the
kernel's result through its log-sum-exp (``sinks.py``); ``kernel_forward`` and ``kernel_backward`` are those two calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aah_lightning.model.attention import sinks
from aah_lightning.model.attention.registry import AVAILABLE, Availability, Backend, Plan, register
from aah_lightning.model.attention.sdpa import CausalPlan
from aah_lightning.model.attention.split import SplitPlan, split_plan

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch older than the varlen API
    varlen_attn = None


def flash_window(window: int, seq_len: int) -> tuple[int, int]:
    """FlashAttention's inclusive ``window_size`` for our window of W keys: ``(W - 1, 0)``; ``(-1, 0)`` (causal) when
    the window covers the sequence."""
    return (-1, 0) if window >= seq_len else (int(window) - 1, 0)


def document_segments(doc_ids: Tensor, backend: str = "varlen") -> tuple[Tensor, int]:
    """Cumulative sequence starts (int32 ``[n + 1]``) of the flattened ``[B * T]`` tokens, one sequence per
    document run in each row, and the longest run. Reads ``doc_ids`` on the host (plan building, per batch)."""
    batch, seq_len = doc_ids.shape
    flat = doc_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::seq_len] = True  # every row starts a sequence
    runs = starts.view(batch, seq_len).sum(1)
    distinct = torch.tensor([row.unique().numel() for row in doc_ids], device=runs.device)
    if not torch.equal(runs, distinct):
        raise ValueError(
            f"model.gpt.backend={backend} needs every document to be one contiguous run of positions in its row"
        )
    bounds = torch.cat([starts.nonzero().flatten(), torch.tensor([flat.numel()], device=flat.device)])
    return bounds.to(torch.int32), int(bounds.diff().max())


def kernel_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int, window_size):
    """torch's FlashAttention varlen forward: ``(out, lse [heads, tokens])``."""
    causal = tuple(window_size) == (-1, 0)
    out, lse, _ = torch.ops.torch_attn._varlen_attn(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, causal, None, list(window_size)
    )
    return out, lse


def kernel_backward(dout, q, k, v, out, lse, cu_seqlens: Tensor, max_len: int, window_size):
    """torch's FlashAttention varlen backward from the ``out`` and ``lse`` handed in: ``(dq, dk, dv)``."""
    causal = tuple(window_size) == (-1, 0)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
    return torch.ops.torch_attn._varlen_attn_backward(
        dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_len, max_len, causal, rng, None, list(window_size)
    )


@torch.library.custom_op("aah::varlen_sink_forward", mutates_args=())
def varlen_sink_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int, window: int, sink: int
) -> tuple[Tensor, Tensor]:
    out, lse = kernel_forward(q, k, v, cu_seqlens, max_len, (window - 1, 0))
    out, lse = sinks.merge_sink(q, k, v, out, lse, cu_seqlens, window, sink)
    return out.contiguous(), lse.contiguous()


@varlen_sink_forward.register_fake
def _(q, k, v, cu_seqlens, max_len, window, sink):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("aah::varlen_sink_backward", mutates_args=())
def varlen_sink_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    max_len: int,
    window: int,
    sink: int,
) -> tuple[Tensor, Tensor, Tensor]:
    dout = dout.contiguous()
    band = kernel_backward(dout, q, k, v, out, lse, cu_seqlens, max_len, (window - 1, 0))  # the merged out and lse
    return tuple(g.contiguous() for g in sinks.sink_grads(dout, q, k, v, out, lse, cu_seqlens, window, sink, band))


@varlen_sink_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_len, window, sink):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, ctx.max_len, ctx.window, ctx.sink = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens, *output)


def _backward(ctx, dout, dlse):
    q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
    dq, dk, dv = varlen_sink_backward(dout, q, k, v, out, lse, cu_seqlens, ctx.max_len, ctx.window, ctx.sink)
    return dq, dk, dv, None, None, None, None


varlen_sink_forward.register_autograd(_backward, setup_context=_setup)


@dataclass(frozen=True, eq=False)
class VarlenGroupPlan(Plan):
    """One ``varlen_attn`` call for heads that share a window. ``cu_seqlens``/``max_len``: the document sequences,
    or None: one sequence per row (built per call for the batch at hand)."""

    row: tuple[int, ...]
    seq_len: int
    window_size: tuple[int, int]
    cu_seqlens: Tensor | None = None
    max_len: int | None = None
    sink: int = 0
    kind = "varlen"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B, h, T, D = q.shape
        if self.cu_seqlens is None:
            cu, longest = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device), T
        else:
            cu, longest = self.cu_seqlens, self.max_len
        tokens = [x.transpose(1, 2).reshape(B * T, h, D) for x in (q, k, v)]
        left = self.window_size[0]
        if self.sink and left >= 0:  # a windowed group with a sink
            out, _ = varlen_sink_forward(*tokens, cu, longest, left + 1, self.sink)
        else:
            out = varlen_attn(*tokens, cu, cu, longest, longest, window_size=self.window_size)
        return out.view(B, T, h, D).transpose(1, 2)


class VarlenPlan(SplitPlan):
    kind = "varlen"


def window_group_plan(row, seq_len, doc_ids, device, backend: str, group_plan, cls, sink: int = 0) -> SplitPlan:
    """Heads grouped by window, ``group_plan(sub_row, cu_seqlens, max_len)`` for each group (one sliding-window call);
    without documents a group whose window covers the sequence runs fused causal SDPA. ``cls``: the grouped plan's
    class (its ``kind``). Shared by ``varlen`` and ``fa4_window``."""
    segments = (None, None) if doc_ids is None else document_segments(doc_ids, backend)

    def part(sub_row):
        if doc_ids is None and min(sub_row) >= seq_len:
            return CausalPlan(sub_row, seq_len)
        return group_plan(sub_row, *segments)

    return split_plan(row, seq_len, [min(w, seq_len) for w in row], part, device, cls, sink)


@register
class VarlenBackend(Backend):
    name = "varlen"
    fallback = "split"
    dtypes = (torch.bfloat16, torch.float16)

    def available(self, device, needs_grad) -> Availability:
        if varlen_attn is None:
            return Availability(False, f"torch {torch.__version__} has no torch.nn.attention.varlen")
        if device.type != "cuda":
            return Availability(False, f"varlen attention (FlashAttention) runs on CUDA only, not {device.type}")
        return AVAILABLE

    def build(self, row, seq_len, doc_ids, *, device, block_size, sink=0) -> Plan:
        def group(sub_row, cu_seqlens, max_len):
            return VarlenGroupPlan(sub_row, seq_len, flash_window(sub_row[0], seq_len), cu_seqlens, max_len, sink)

        return window_group_plan(row, seq_len, doc_ids, device, self.name, group, VarlenPlan, sink)
