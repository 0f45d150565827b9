"""Attention with a learned soft span (the ``learned_span`` window policy, ``windows/span.py``).

Head ``h`` with span ``z_h`` (a float, in tokens) and ramp width ``R`` weighs the key ``d`` positions back by

    m_h(d) = clamp((z_h + R - d) / R, 0, 1)

after the softmax, and renormalises: ``p = a m / sum(a m)``, with ``a`` the causal softmax. That is the softmax of
``scores + log m``, which is how it is computed here (``log 0 = -inf``: keys past ``z_h + R`` are masked, so the
head's hard window is ``ceil(z_h + R)``). ``m`` is 1 up to ``z_h`` and falls linearly to 0 over the next ``R``
positions, so the loss has a gradient in ``z_h`` wherever the head puts weight inside its ramp: the span grows where
attending further lowers the loss (adaptive span, Sukhbaatar et al. 2019; written here for aah's plans).

``SoftSpanPlan`` is one layer's plan (the plan contract of ``registry.py``): it computes the ramped attention densely
in the inputs' dtype, at least fp32 (a float64 input stays float64: tests compare it with a float64 reference), and
answers the cost questions (``tile_counts``, ``pairs``) with the plan of its hard windows, the windows whose cost a
block-sparse kernel pays and the run's ledger counts.
"""

from __future__ import annotations

import torch
from torch import Tensor


def span_ramp(distance: Tensor, span: Tensor, width: int) -> Tensor:
    """``m(d) = clamp((span + width - d) / width, 0, 1)``, broadcast over ``distance`` and ``span``."""
    return ((span + width - distance) / width).clamp(0.0, 1.0)


def soft_span_attention(q: Tensor, k: Tensor, v: Tensor, span: Tensor, width: int, docs: Tensor | None) -> Tensor:
    """Causal attention of ``q`` ``[B, H, T, D]`` over ``k``, ``v`` ``[B, Hkv, T, D]`` with each head's ramp (``span``
    ``[H]``, differentiable) applied after the softmax; ``docs`` ``[B, T]`` keeps each query in its document."""
    B, H, T, D = q.shape
    dtype = torch.promote_types(q.dtype, torch.float32)
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1).to(dtype), v.repeat_interleave(rep, dim=1).to(dtype)
    scores = q.to(dtype) @ k.transpose(-1, -2) * D**-0.5
    pos = torch.arange(T, device=q.device)
    distance = (pos.view(T, 1) - pos.view(1, T)).to(dtype)  # query minus key
    m = span_ramp(distance, span.to(dtype).view(H, 1, 1), width)  # [H, T, T]
    allowed = (distance >= 0) & (m > 0)
    if docs is not None:
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
    # where m = 0 the key is masked; the clamp keeps log's gradient finite there (torch.where passes it zero)
    bias = torch.where(allowed, torch.log(m.clamp_min(torch.finfo(dtype).tiny)), float("-inf"))
    weights = torch.softmax(scores + bias, dim=-1)
    return (weights @ v).to(q.dtype)


class SoftSpanPlan:
    """One layer's ramped attention (``span`` ``[H]`` of that layer, a view of the learned parameter); ``hard``: the
    plan of the hard windows ``ceil(span + width)``, which answers what the layer costs."""

    eager = True  # the span changes every step: never a compiled graph
    head_groups = None

    def __init__(self, span: Tensor, width: int, docs: Tensor | None, hard):
        self.span, self.width, self.docs, self.hard = span, width, docs, hard

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return soft_span_attention(q, k, v, self.span, self.width, self.docs)

    def __getattr__(self, name: str):  # tile_counts, pairs, computed_pairs: those of the hard windows
        if name == "hard":  # not set yet (a copy in the making): no recursion
            raise AttributeError(name)
        return getattr(self.hard, name)
