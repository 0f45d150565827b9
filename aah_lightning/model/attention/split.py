"""``split``: a layer's heads split by window group, each group on the kernel that suits it.

Heads whose window covers the sequence run SDPA's fused causal kernel (flash / cuDNN on a GPU, ~1.4x faster than
flex's own causal kernel at head_dim 64); only the windowed heads go through a windowed kernel: compiled flex with
the tuned kernel options on CUDA, banded on CPU. In the model the groups cost no activation copies
(``head_groups``, the plan contract in registry.py): the attention layer computes q, k, v with the heads already in
group order by reordering its projection's weight rows, each group is a slice of them, and the output projection
adds the groups' outputs up through the matching weight columns. Called on a whole layer's q, k, v (the probe, tests),
the plan gathers the heads into groups (one ``index_select`` of q, k and v when they are not already grouped),
concatenates the groups' outputs and scatters them back. With documents every head needs the document mask, so the
windowed kernel runs all heads.

``SplitPlan`` is the generic gather / run parts / scatter plan; the ``varlen`` backend builds one too.

Compiling: the group sizes are part of the plan, so the compiled flex kernel sees a new head count whenever a
layer's number of windowed heads changes. On CUDA it is compiled with automatic dynamic shapes (``dynamic=None``):
the first change recompiles once with a symbolic head count, later ones should not (tools/gpu_tune.py counts it).
New window values within the same groups never recompile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from aah_lightning.model.attention import banded, flex
from aah_lightning.model.attention.registry import Backend, HeadGroups, Plan, expand_kv, get_backend, register
from aah_lightning.model.attention.sdpa import CausalPlan
from aah_lightning.model.window_math import TileCounts

_compiled_flex_any_heads = None


def compiled_flex_any_heads():
    """Compiled flex for a varying number of heads: automatic dynamic shapes (one recompile, then symbolic). CUDA
    only: torch's CPU flex kernel does not compile with a symbolic head count, so on CPU ``AnyHeadsFlexPlan`` uses
    the static compile (a new graph per head count)."""
    global _compiled_flex_any_heads
    if _compiled_flex_any_heads is None:
        _compiled_flex_any_heads = torch.compile(flex_attention)
    return _compiled_flex_any_heads


def group_heads(keys: list) -> tuple[list[int], list[int]]:
    """Heads gathered by ``keys[h]`` (ascending, stable): the head order and the size of each group."""
    order = sorted(range(len(keys)), key=lambda h: keys[h])
    sizes: list[int] = []
    for i, h in enumerate(order):
        if i and keys[h] == keys[order[i - 1]]:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return order, sizes


@dataclass(frozen=True, eq=False)
class SplitPlan(Plan):
    """Heads gathered into contiguous groups (``order``; None when already grouped), ``parts[i]`` runs the next
    ``sizes[i]`` heads, outputs are concatenated and put back in the layer's order (``inverse``)."""

    row: tuple[int, ...]
    seq_len: int
    order: Tensor | None
    inverse: Tensor | None
    sizes: tuple[int, ...]
    parts: tuple[Plan, ...]
    sink: int = 0
    kind = "split"

    @property
    def head_groups(self) -> HeadGroups:
        """What the attention layer runs instead of ``__call__`` (no gather, concatenation or scatter of activations)."""
        return HeadGroups(self.order, self.sizes, self.parts)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # The groups' query heads need not share key/value heads: under grouped-query attention every query head
        # gets a copy of its own (expand_kv), as the layer's weight path gives them (gpt.CausalSelfAttention).
        k, v = (expand_kv(x, q.shape[1], self.order) for x in (k, v))
        if self.order is not None:
            q = q.index_select(1, self.order)
        if len(self.parts) == 1:
            out = self.parts[0](q, k, v)
        else:
            groups = zip(*(x.split(self.sizes, dim=1) for x in (q, k, v)))  # views; one backward copy per tensor
            out = torch.cat([part(*g) for part, g in zip(self.parts, groups)], dim=1)
        return out if self.inverse is None else out.index_select(1, self.inverse)

    def tile_counts(self, block_size: int) -> TileCounts:
        counts = [p.tile_counts(block_size) for p in self.parts]
        sources = sorted({c.source for c in counts})
        return TileCounts(
            sum(c.partial for c in counts),
            sum(c.full for c in counts),
            sum(c.causal for c in counts),
            "+".join(sources),
        )

    def computed_pairs(self, block_size: int) -> int:
        return sum(p.computed_pairs(block_size) for p in self.parts)


def split_plan(
    row: tuple[int, ...], seq_len: int, keys: list, build_part, device, cls=SplitPlan, sink: int = 0
) -> SplitPlan:
    """Gather the heads of ``row`` by ``keys`` and build each group's plan with ``build_part(sub_row)``."""
    order, sizes = group_heads(keys)
    parts, start = [], 0
    for size in sizes:
        parts.append(build_part(tuple(row[h] for h in order[start : start + size])))
        start += size
    if order == sorted(order):
        return cls(row, seq_len, None, None, tuple(sizes), tuple(parts), sink)
    perm = torch.tensor(order, device=device)
    return cls(row, seq_len, perm, torch.argsort(perm), tuple(sizes), tuple(parts), sink)


@dataclass(frozen=True, eq=False)
class AnyHeadsFlexPlan(flex.FlexPlan):
    """A flex plan for a group of heads whose size changes with the windows (compiled with dynamic shapes)."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        attend = compiled_flex_any_heads() if q.is_cuda else flex.compiled_flex_attention()
        return attend(q, k, v, block_mask=self.block_mask, kernel_options=self.kernel_options(q))


def windowed_plan(row, seq_len, doc_ids, device, block_size, kernel: str, sink: int = 0) -> Plan:
    """The windowed kernel's plan for a group of heads: ``"flex"`` (tuned options) or ``"banded"``."""
    if kernel == "banded":
        return banded.build_plan(row, seq_len, doc_ids, device, sink)
    plan = flex.build_flex_plan(row, seq_len, doc_ids, device, block_size, options="tuned", balance=False, sink=sink)
    return AnyHeadsFlexPlan(plan.row, seq_len, plan.block_mask, options=plan.options, arch=plan.arch, sink=sink)


@register
class SplitBackend(Backend):
    """Full-window heads on fused causal SDPA, windowed heads on ``windowed`` (``None``: flex on CUDA, banded on
    CPU)."""

    name = "split"

    def __init__(self, windowed: str | None = None):
        self.windowed = windowed

    def kernel(self, device: torch.device) -> str:
        return self.windowed or ("flex" if device.type == "cuda" else "banded")

    def available(self, device, needs_grad):
        if self.kernel(device) == "flex":
            return get_backend("flex").available(device, needs_grad)
        return super().available(device, needs_grad)

    def build(self, row, seq_len, doc_ids, *, device, block_size, sink=0) -> Plan:
        kernel = self.kernel(device)

        def part(sub_row):
            if doc_ids is None and min(sub_row) >= seq_len:
                return CausalPlan(sub_row, seq_len)
            return windowed_plan(sub_row, seq_len, doc_ids, device, block_size, kernel, sink)

        if doc_ids is not None:  # every head needs the document mask: one group
            return split_plan(row, seq_len, [0] * len(row), part, device, sink=sink)
        return split_plan(row, seq_len, [w >= seq_len for w in row], part, device, sink=sink)
