"""``Recording``: a plan that records its layer's q, k, v and then runs the layer's own plan (the AAH probe)."""

from __future__ import annotations

from torch import Tensor


class Recording:
    """Appends ``(q, k, v)`` (after RoPE, detached) to its own ``records`` list, then returns ``inner(q, k, v)``.

    It runs inside a compiled block too (torch.compile replays the list append after the graph; one list per layer,
    empty when the forward starts, so every layer matches the same graph), and under FSDP2 through the blocks' hooks
    like any forward."""

    def __init__(self, inner):
        self.inner = inner
        self.records: list[tuple[Tensor, Tensor, Tensor]] = []

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.records.append((q.detach(), k.detach(), v.detach()))
        return self.inner(q, k, v)
