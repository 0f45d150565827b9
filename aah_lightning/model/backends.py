"""Attention execution: one plan per layer, derived from the window table, cached until the table changes.

Backends (identical semantics, all derived from ``masks.window_mask_mod``):

* ``flex``  - FlexAttention with a per-head BlockMask, compiled. Skips empty tiles. On CPU forward only (torch has
  no CPU backward for it), so it serves validation and probes there.
* ``sdpa``  - ``scaled_dot_product_attention`` with the dense boolean mask of the mask_mod (or ``is_causal`` when every
  head of the layer sees the whole sequence). The reference; CPU training of short sequences.
* ``banded`` - heads grouped by window; causal SDPA for full-window heads, chunked band attention (work ~ T * W) for
  the others (model/banded.py). CPU training.
* ``auto``  - the fastest correct choice for the device and grad mode (see ``resolve_backend``).

On CPU the compiled flex kernel splits ``B * H * q-tiles`` into one contiguous range per thread, so a layer whose
windows grow with the head index leaves one thread idle most of the time. The CPU flex plan therefore runs the heads
in a balanced order (``balanced_order``): q, k, v and the BlockMask are permuted, the output is permuted back.

A layer whose heads all have ``W >= T`` (and no document mask) runs plain causal SDPA under every backend: that is
the same mask, and the fused causal kernels are the fastest way to compute it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from aah_lightning.model import banded, masks

# On CPU, compiled flex pays off for inference only once tiles can be skipped at a useful scale; below this length
# the dense SDPA mask is faster than the ~10 s compile.
CPU_FLEX_MIN_SEQ_LEN = 1024
# CPU training: banded from this length on (measured in tools/bench.py; below it both are a few ms and the dense mask
# saves the extra kernel launches).
CPU_BANDED_MIN_SEQ_LEN = 256

_compiled_flex = None


def compiled_flex_attention():
    """``torch.compile(flex_attention)``, built once per process (windows are tensors: new values never recompile)."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (device / grad mode)."""


def resolve_backend(requested: str, device: torch.device, needs_grad: bool, seq_len: int) -> str:
    """Map a configured backend to the one that runs now.

    ``auto``: flex on CUDA; on CPU, compiled flex for inference from ``CPU_FLEX_MIN_SEQ_LEN``, banded for training from
    ``CPU_BANDED_MIN_SEQ_LEN``, dense-mask SDPA otherwise.
    """
    if requested == "auto":
        if device.type == "cuda":
            return "flex"
        if not needs_grad and seq_len >= CPU_FLEX_MIN_SEQ_LEN:
            return "flex"
        if needs_grad and seq_len >= CPU_BANDED_MIN_SEQ_LEN:
            return "banded"
        return "sdpa"
    if requested == "flex" and needs_grad and device.type != "cuda":
        raise BackendUnavailable(
            f"model.backend=flex cannot train on {device.type}: FlexAttention has no backward pass there "
            f"(torch {torch.__version__}). Use model.backend=auto (SDPA for training, flex for inference) or sdpa, "
            f"or train on a CUDA GPU"
        )
    return requested


@dataclass(frozen=True)
class LayerPlan:
    """How one layer attends: ``kind`` in {causal, dense, flex, banded}; ``mask`` is None, a bool tensor, a BlockMask
    or a ``banded.BandedPlan``. ``order``/``inverse`` (flex on CPU): the heads run in ``order`` (the BlockMask is
    built for that order) and ``inverse`` restores the layer's order on the output."""

    kind: str
    mask: object = None
    order: Tensor | None = None
    inverse: Tensor | None = None


def attend(q: Tensor, k: Tensor, v: Tensor, plan: LayerPlan) -> Tensor:
    """q, k, v: ``[B, H, T, D]`` -> ``[B, H, T, D]``."""
    if plan.kind == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if plan.kind == "dense":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask)
    if plan.kind == "banded":
        return banded.banded_attention(q, k, v, plan.mask)
    if plan.kind == "flex":
        if plan.order is None:
            return compiled_flex_attention()(q, k, v, block_mask=plan.mask)
        # CPU: always contiguous inputs (index_select), so permuted and identity orders share one compiled graph.
        q, k, v = (x.index_select(1, plan.order) for x in (q, k, v))
        return compiled_flex_attention()(q, k, v, block_mask=plan.mask).index_select(1, plan.inverse)
    raise ValueError(f"unknown attention plan {plan.kind!r}")


def balanced_order(work: list[float]) -> list[int]:
    """A head order whose running sum of work stays closest to the straight line from 0 to the total.

    Any contiguous split of the order into equal head ranges (how the CPU flex kernel hands heads to threads) then
    gets nearly equal work, whatever the thread count. Greedy: at each position take the head that brings the running
    sum closest to its target; ties go to the lower head index, so equal work keeps the given order.
    """
    total, n = float(sum(work)), len(work)
    left, order, running = list(range(n)), [], 0.0
    for i in range(n):
        target = total * (i + 1) / n
        best = min(left, key=lambda h: (abs(running + work[h] - target), h))
        left.remove(best)
        order.append(best)
        running += work[best]
    return order


class AttentionPlanner:
    """Per-layer attention plans from the window table, cached and never stale.

    The cache is keyed by the table's storage and autograd version counter (every in-place write to the buffer -
    the policies' ``copy_``, ``load_state_dict`` - bumps it), so a changed table is noticed without reading its
    values. Only then is the table read back (one small host copy, at control steps) and compared row by row: only
    layers whose row changed get new masks. Entries are keyed by row contents, so identical rows share one mask.
    """

    def __init__(self, block_size: int = 128):
        self.block_size = block_size
        self._table_key = None
        self._rows: list[tuple[int, ...]] = []
        self._cache: dict = {}
        self.builds = 0  # number of masks built (tests use it to prove reuse)

    def rows(self, windows: Tensor) -> list[tuple[int, ...]]:
        key = (windows.data_ptr(), windows._version, windows.device, tuple(windows.shape))
        if key != self._table_key:
            self._rows = [tuple(r) for r in windows.tolist()]
            self._table_key = key
            live = set(self._rows)
            self._cache = {k: v for k, v in self._cache.items() if k[1] in live}
        return self._rows

    def plans(
        self, windows: Tensor, seq_len: int, backend: str, doc_ids: Tensor | None = None
    ) -> list[LayerPlan]:
        device = windows.device
        plans = []
        for row in self.rows(windows):
            if doc_ids is None and min(row) >= seq_len:
                plans.append(LayerPlan("causal"))
            elif doc_ids is not None:  # depends on the batch: built every call, never cached
                plans.append(self._build(backend, row, seq_len, device, doc_ids))
            else:
                key = (backend, row, seq_len, device)
                if key not in self._cache:
                    self._cache[key] = self._build(backend, row, seq_len, device, None)
                plans.append(self._cache[key])
        return plans

    def _build(self, backend, row, seq_len, device, doc_ids) -> LayerPlan:
        self.builds += 1
        # A private copy of the row: a cached mask must not change when the live table is written.
        row_t = torch.tensor(row, dtype=torch.int32, device=device)
        if backend == "flex":
            if doc_ids is None and device.type == "cpu":
                partial, full = masks.window_tiles(row_t, seq_len, self.block_size)
                work = (partial | full).sum((-2, -1)).tolist()
                order = torch.tensor(balanced_order(work), device=device)
                block_mask = masks.window_block_mask(row_t[order], seq_len, self.block_size)
                return LayerPlan("flex", block_mask, order, torch.argsort(order))
            if doc_ids is None:
                return LayerPlan("flex", masks.window_block_mask(row_t, seq_len, self.block_size))
            return LayerPlan("flex", masks.document_block_mask(row_t, doc_ids, self.block_size))
        if backend == "banded":
            return LayerPlan("banded", banded.build_plan(row_t, seq_len, doc_ids))
        if backend == "sdpa":
            mask_mod = masks.window_mask_mod(row_t, doc_ids)
            batch = 1 if doc_ids is None else doc_ids.shape[0]
            return LayerPlan("dense", masks.dense_mask(mask_mod, batch, len(row), seq_len, device))
        raise ValueError(f"unknown backend {backend!r}")
