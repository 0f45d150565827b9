"""``fa4_window``: heads grouped by window, one FlashAttention-4 sliding-window call per group.

FlashAttention-4's own kernels (``flash_attn.cute.flash_attn_func`` with ``causal=True, window_size=(W - 1, 0)``) take
one window per call and run it natively: no mask_mod, no BlockMask, no torch code generation in between (unlike
``flex_fa4``, which reaches the same kernels through flex's FLASH backend). It is ``varlen``'s layout with a faster
kernel: full-window heads run fused causal SDPA, each other window group is one call on its slice of heads (the layer
reorders its weights, ``head_groups``: no activation is copied), and with documents every document is its own
sequence of a varlen call (``flash_attn_varlen_func``), which needs every document to be one contiguous run of
positions in its row. Under grouped-query attention each group receives one key/value head per query head (a
window group's query heads need not share theirs; ``SplitPlan`` and the layer expand them). FlashAttention's windows
are inclusive (query i sees keys ``i - left .. i``), so W keys are
``left = W - 1``; a group whose window covers the sequence passes no window (plain causal). FA4 has no sink of
positions: with ``model.aah.sink`` the windowed groups run in the varlen layout (rows as sequences without documents)
and the ops merge the sink keys into the kernel's result through its log-sum-exp (``sinks.py``).

Needs a CUDA GPU of compute capability 9.0 or newer, ``flash-attn-4`` (``pip install -e ".[fa4]"``) and bf16 / fp16;
otherwise it runs ``varlen`` (torch's bundled FlashAttention-2 sliding windows, the same grouping) with one log line.
flash-attn-4 registers nothing with ``torch.compile``; its forward and backward are wrapped here as two custom ops
(``aah::fa4_window_forward`` / ``_backward``, FA4's ``_flash_attn_fwd`` / ``_flash_attn_bwd`` in flash-attn-4 4.0),
which a compiled block calls as opaque nodes (blocks compile with ``fullgraph=True``: a graph break would be an error).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aah_lightning.model.attention import flex, sinks
from aah_lightning.model.attention.registry import AVAILABLE, Availability, Backend, Plan, register
from aah_lightning.model.attention.split import SplitPlan
from aah_lightning.model.attention.varlen import window_group_plan


def fa4_window_size(window: int, seq_len: int) -> tuple[int | None, int | None]:
    """FlashAttention-4's ``window_size`` for our window of W keys: ``(W - 1, 0)``; ``(None, None)`` (no window: plain
    causal) when it covers the sequence. FA4 reads a left size of -1 as a window, not as "none", unlike FA2."""
    return (None, None) if window >= seq_len else (int(window) - 1, 0)


# flash-attn-4 registers nothing with torch.compile, and blocks compile with fullgraph=True: its kernels are wrapped
# here as two custom ops (forward, backward) that compiled graphs call as opaque nodes. Both take q, k, v in FA4's
# layout, ``[B, T, h, D]`` (or ``[tokens, h, D]`` with ``cu_seqlens``); ``left`` < 0: no window (plain causal);
# ``sink`` > 0 (windowed, varlen layout only): the first ``sink`` keys of each sequence too (sinks.py).
def _window(left: int) -> dict:
    return (
        {"window_size_left": None, "window_size_right": None}
        if left < 0
        else {
            "window_size_left": left,
            "window_size_right": 0,
        }
    )


def _lengths(cu_seqlens: Tensor | None, max_len: int) -> dict:
    if cu_seqlens is None:
        return {}
    return {"cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens, "max_seqlen_q": max_len, "max_seqlen_k": max_len}


def _as_strided_like(t: Tensor, ref: Tensor) -> Tensor:
    """``t`` laid out like ``ref`` (what the ops' fake implementations promise the compiler)."""
    return t if t.stride() == ref.stride() else torch.empty_like(ref).copy_(t)


@torch.library.custom_op("aah::fa4_window_forward", mutates_args=())
def fa4_window_forward(
    q: Tensor, k: Tensor, v: Tensor, left: int, cu_seqlens: Tensor | None, max_len: int, sink: int
) -> tuple[Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse = _flash_attn_fwd(q, k, v, causal=True, return_lse=True, **_window(left), **_lengths(cu_seqlens, max_len))[
        :2
    ]
    if sink and left >= 0:
        out, lse = sinks.merge_sink(q, k, v, out, lse, cu_seqlens, left + 1, sink)
    return out.contiguous(), lse.contiguous()


@fa4_window_forward.register_fake
def _(q, k, v, left, cu_seqlens, max_len, sink):
    lse = (q.shape[1], q.shape[0]) if cu_seqlens is not None else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(q.shape), q.new_empty(lse, dtype=torch.float32)


@torch.library.custom_op("aah::fa4_window_backward", mutates_args=())
def fa4_window_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    left: int,
    cu_seqlens: Tensor | None,
    max_len: int,
    sink: int,
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    # With a sink, out and lse are the merged ones: FA4 returns the band's share of the whole softmax's gradient.
    grads = _flash_attn_bwd(q, k, v, out, dout, lse, causal=True, **_window(left), **_lengths(cu_seqlens, max_len))
    if sink and left >= 0:
        grads = sinks.sink_grads(dout, q, k, v, out, lse, cu_seqlens, left + 1, sink, tuple(grads[:3]))
    return tuple(_as_strided_like(g, x) for g, x in zip(grads[:3], (q, k, v)))


@fa4_window_backward.register_fake
def _(dout, q, k, v, out, lse, left, cu_seqlens, max_len, sink):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, ctx.left, cu_seqlens, ctx.max_len, ctx.sink = inputs
    ctx.save_for_backward(q, k, v, *output, *(() if cu_seqlens is None else (cu_seqlens,)))


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *cu = ctx.saved_tensors
    cu_seqlens = cu[0] if cu else None
    dq, dk, dv = fa4_window_backward(dout, q, k, v, out, lse, ctx.left, cu_seqlens, ctx.max_len, ctx.sink)
    return dq, dk, dv, None, None, None, None


fa4_window_forward.register_autograd(_backward, setup_context=_setup)


def fa4_attention(
    q: Tensor, k: Tensor, v: Tensor, window_size, cu_seqlens: Tensor | None, max_len: int | None, sink: int = 0
):
    """``[B, h, T, D]`` attention of heads that share ``window_size``, through FlashAttention-4; with ``cu_seqlens``,
    the ``B * T`` tokens as varlen sequences. A ``sink`` of a windowed group runs in the varlen layout (each row one
    sequence without documents), where the sink keys are found."""
    B, h, T, D = q.shape
    left = -1 if window_size[0] is None else int(window_size[0])
    sink = sink if left >= 0 else 0
    if cu_seqlens is None and not sink:
        out, _ = fa4_window_forward(*(x.transpose(1, 2) for x in (q, k, v)), left, None, T, 0)
        return out.transpose(1, 2)
    if cu_seqlens is None:
        cu_seqlens, max_len = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device), T
    tokens = [x.transpose(1, 2).reshape(B * T, h, D) for x in (q, k, v)]
    out, _ = fa4_window_forward(*tokens, left, cu_seqlens, int(max_len), sink)
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
    sink: int = 0
    kind = "fa4_window"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return fa4_attention(q, k, v, self.window_size, self.cu_seqlens, self.max_len, self.sink)


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

    def build(self, row, seq_len, doc_ids, *, device, block_size, sink=0) -> Plan:
        def group(sub_row, cu_seqlens, max_len):
            size = fa4_window_size(sub_row[0], seq_len)
            return Fa4WindowPlan(sub_row, seq_len, size, cu_seqlens, max_len, sink)

        return window_group_plan(row, seq_len, doc_ids, device, self.name, group, Fa4GroupsPlan, sink)
