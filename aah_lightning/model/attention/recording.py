"""``Recording``: a plan that records its layer's q, k, v and then runs the layer's own plan (the AAH probe)."""

from __future__ import annotations

from torch import Tensor

from aah_lightning.model.attention.registry import HeadGroups, expand_kv


class Recording:
    """Appends ``(q, k, v)`` (after RoPE, detached) to its own ``records`` list, then returns ``inner(q, k, v)``.

    Every record holds one key/value head per query head, ``[B, H, T, D]`` each: under grouped-query attention the
    layer's fewer key/value heads are expanded (``expand_kv``), so what reads the records (the probe) sees each query
    head with the keys it attends to, whatever ``n_kv_head`` is.

    It runs inside a compiled block too (torch.compile replays the list append after the graph; one list per layer,
    empty when the forward starts, so every layer matches the same graph), and under FSDP2 through the blocks' hooks
    like any forward."""

    eager = False  # it runs wherever its layer's block runs, compiled or not
    head_groups: HeadGroups | None = None  # it records every head: the layer computes them in their own order

    def __init__(self, inner):
        self.inner = inner
        self.records: list[tuple[Tensor, Tensor, Tensor]] = []

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        heads = q.shape[1]
        self.records.append((q.detach(), expand_kv(k.detach(), heads), expand_kv(v.detach(), heads)))
        return self.inner(q, k, v)
