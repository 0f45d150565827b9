"""Attention with a learned soft span (the ``learned_span`` window policy, ``windows/span.py``).

Head ``h`` with span ``z_h`` (a float, in tokens) and ramp width ``R`` weighs the key ``d`` positions back by

    m_h(d) = clamp((z_h + R - d) / R, 0, 1)

after the softmax, and renormalises: ``p = a m / sum(a m)``, with ``a`` the causal softmax. That is the softmax of
``scores + log m``, which is how it is computed here (``log 0 = -inf``: keys past ``z_h + R`` are masked, so the
head's hard window is ``ceil(z_h + R)``). ``m`` is 1 up to ``z_h`` and falls linearly to 0 over the next ``R``
positions, so the loss has a gradient in ``z_h`` wherever the head puts weight inside its ramp: the span grows where
attending further lowers the loss (adaptive span, Sukhbaatar et al. 2019; written here for aah's plans).

The ramp is computed block-sparsely: only the keys of each head's hard window ``min(T, ceil(z_h + R))`` are scored,
through the banded backend's parts (``banded.py``: a causal prefix and overlapping chunks), with ``log m`` as an
additive bias inside the band. So a run pays for its learning phase what its ledger counts, the hard windows (with
the banded backend's chunk overhead), not the whole ``T x T`` score matrix, and the ramp fits where dense scores
would not (long T). It runs in the inputs' dtype, at least fp32 (a float64 input stays float64: tests compare it with
a float64 reference of the dense definition above).

``SoftSpanPlan`` is one layer's plan (the plan contract of ``registry.py``): it runs the ramped attention over its
hard plan's windows and answers the cost questions (``tile_counts``, ``pairs``) with that plan of its hard windows,
the windows whose cost a block-sparse kernel pays and the run's ledger counts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aah_lightning.model.attention import banded


def span_ramp(distance: Tensor, span: Tensor, width: int) -> Tensor:
    """``m(d) = clamp((span + width - d) / width, 0, 1)``, broadcast over ``distance`` and ``span``."""
    return ((span + width - distance) / width).clamp(0.0, 1.0)


def soft_span_attention(
    q: Tensor, k: Tensor, v: Tensor, span: Tensor, width: int, docs: Tensor | None, row=None, plan=None
) -> Tensor:
    """Causal attention of ``q`` ``[B, H, T, D]`` over ``k``, ``v`` ``[B, Hkv, T, D]`` with each head's ramp (``span``
    ``[H]``, differentiable) applied after the softmax; ``docs`` ``[B, T]`` keeps each query in its document. ``row``:
    the heads' hard windows (ints; default ``min(T, ceil(span + width))``, the keys the ramp reaches): only their keys
    are scored. ``plan``: a banded plan of exactly those windows (and ``docs``, no sink columns), if one is built
    already; else one is built here."""
    T = q.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    if row is None:
        row = (span.detach() + width).ceil().clamp(1, T).int().tolist()
    if plan is None:
        plan = banded.build_plan(row, T, docs, q.device)
    z = span.to(dtype)
    tiny = torch.finfo(dtype).tiny

    def log_ramp(heads: Tensor, distance: Tensor) -> Tensor:
        m = span_ramp(distance.to(dtype), z[heads.to(z.device)].view(-1, *(1,) * distance.dim()), width)
        # where m = 0 the key is masked; the clamp keeps log's gradient finite there (torch.where passes it zero)
        return torch.where(m > 0, torch.log(m.clamp_min(tiny)), float("-inf"))

    y = banded.banded_attention(q.to(dtype), k.to(dtype), v.to(dtype), plan, bias=log_ramp)
    return y.to(q.dtype)


class SoftSpanPlan:
    """One layer's ramped attention (``span`` ``[H]`` of that layer, a view of the learned parameter); ``hard``: the
    plan of the hard windows ``ceil(span + width)``, which answers what the layer costs."""

    eager = True  # the span changes every step: never a compiled graph
    head_groups = None

    def __init__(self, span: Tensor, width: int, docs: Tensor | None, hard):
        self.span, self.width, self.docs, self.hard = span, width, docs, hard

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        hard = self.hard
        # the planner's banded plan of the same windows is the ramp's plan: no second one per forward
        reuse = isinstance(hard, banded.BandedPlan) and hard.sink == 0 and (hard.batch is None) == (self.docs is None)
        return soft_span_attention(q, k, v, self.span, self.width, self.docs, hard.row, plan=hard if reuse else None)

    def computed_pairs(self, block_size: int) -> int:  # what the banded ramp computes, whatever the hard plan's kernel
        return sum(banded.biased_band_pairs(w, self.seq_len) for w in self.row)

    def __getattr__(self, name: str):  # tile_counts, pairs, computed_pairs: those of the hard windows
        if name == "hard":  # not set yet (a copy in the making): no recursion
            raise AttributeError(name)
        return getattr(self.hard, name)
