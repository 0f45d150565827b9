"""Attention execution: one plan per layer, derived from the window table, cached until the table changes.

Backends (identical semantics, all derived from ``masks.window_mask_mod``):

* ``flex``  - FlexAttention with a per-head BlockMask, compiled. Skips empty tiles. On CPU forward only (torch has
  no CPU backward for it), so it serves validation and probes there.
* ``sdpa``  - ``scaled_dot_product_attention`` with the dense boolean mask of the mask_mod (or ``is_causal`` when every
  head of the layer sees the whole sequence). The reference; CPU training of short sequences.
* ``banded`` - heads grouped by window; causal SDPA for full-window heads, chunked band attention (work ~ T * W) for
  the others (model/banded.py). CPU training and inference.
* ``auto``  - the fastest correct choice for the device and grad mode (see ``resolve_backend``).

On CPU the compiled flex kernel splits ``B * H * q-tiles`` into one contiguous range per thread, so a layer whose
windows grow with the head index leaves one thread idle most of the time. The CPU flex plan therefore runs the heads
in a balanced order (``cpu_head_order``) when that shortens the busiest thread's work: q, k, v and the BlockMask are
permuted, the output is permuted back. The plan assumes batch 1 and the thread count at plan time.

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

# CPU training and inference: banded from this length on (its forward also beats compiled flex on CPU, which needs a
# compile). Below it the dense mask wins: the banded parts are too small to amortise their extra kernel calls.
# Measurements: docs/benchmarks.md, "Numbers behind choices in the code".
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

    ``auto``: flex on CUDA; on CPU banded from ``CPU_BANDED_MIN_SEQ_LEN`` (training and inference), dense-mask SDPA
    below it. ``flex`` on CPU runs inference only.
    """
    if requested == "auto":
        if device.type == "cuda":
            return "flex"
        return "banded" if seq_len >= CPU_BANDED_MIN_SEQ_LEN else "sdpa"
    if requested == "flex" and needs_grad and device.type != "cuda":
        raise BackendUnavailable(
            f"model.backend=flex cannot train on {device.type}: FlexAttention has no backward pass there "
            f"(torch {torch.__version__}). Use model.backend=auto (banded or SDPA on CPU), banded or sdpa, "
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
        if plan.order is not None:
            q, k, v = (x.index_select(1, plan.order) for x in (q, k, v))
        elif q.device.type == "cpu":  # same strides as a permuted layer: one compiled graph serves both
            q, k, v = (x.contiguous() for x in (q, k, v))
        out = compiled_flex_attention()(q, k, v, block_mask=plan.mask)
        return out if plan.order is None else out.index_select(1, plan.inverse)
    raise ValueError(f"unknown attention plan {plan.kind!r}")


def balanced_order(work: list[float], threads: int) -> list[int]:
    """A head order for a kernel that hands each of ``threads`` threads one contiguous, equal-length range of heads.

    Longest-processing-time first with equal head counts: heads in decreasing work go to the least loaded thread that
    still has room (``ceil`` / ``floor`` of H / threads heads), then the threads' heads are concatenated. Ties keep
    the lower head index first.
    """
    n = len(work)
    room = [n // threads + (t < n % threads) for t in range(threads)]
    bins: list[list[int]] = [[] for _ in range(threads)]
    load = [0.0] * threads
    for h in sorted(range(n), key=lambda h: (-work[h], h)):
        t = min((t for t in range(threads) if len(bins[t]) < room[t]), key=lambda t: (load[t], t))
        bins[t].append(h)
        load[t] += work[h]
    return [h for b in bins for h in sorted(b)]


def cpu_makespan(tiles_per_item: Tensor, threads: int) -> float:
    """Work of the busiest thread when the CPU flex kernel splits its ``(head, q-tile)`` items (``[H, n_q]`` tile
    counts, batch 1) into ``threads`` contiguous ranges of equal length, as ``at::parallel_for`` does."""
    items = tiles_per_item.reshape(-1).to(torch.float64)
    chunk = -(-items.numel() // threads)
    return max(items[t * chunk : (t + 1) * chunk].sum().item() for t in range(threads))


def cpu_head_order(windows_row: Tensor, seq_len: int, block_size: int, threads: int) -> list[int] | None:
    """The balanced head order for the CPU flex kernel, or None when it would not shorten the busiest thread's work
    by at least 5 % for ``threads`` threads at batch 1 (the permutation costs four copies of q, k, v, out)."""
    if threads < 2:
        return None
    partial, full = masks.window_tiles(windows_row, seq_len, block_size)
    per_item = (partial | full).sum(-1)  # [H, n_q]: tiles each (head, q-tile) item visits
    order = balanced_order(per_item.sum(-1).tolist(), threads)
    if cpu_makespan(per_item[order], threads) > 0.95 * cpu_makespan(per_item, threads):
        return None
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
                key = (backend, row, seq_len, device, torch.get_num_threads())  # CPU flex plans depend on threads
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
                order = cpu_head_order(row_t, seq_len, self.block_size, torch.get_num_threads())
                if order is not None:
                    order = torch.tensor(order, device=device)
                    block_mask = masks.window_block_mask(row_t[order], seq_len, self.block_size)
                    return LayerPlan("flex", block_mask, order, torch.argsort(order))
            if doc_ids is None:
                return LayerPlan("flex", masks.window_block_mask(row_t, seq_len, self.block_size))
            return LayerPlan("flex", masks.document_block_mask(row_t, doc_ids, self.block_size))
        if backend == "banded":
            return LayerPlan("banded", banded.build_plan(row, seq_len, doc_ids, device))
        if backend == "sdpa":
            mask_mod = masks.window_mask_mod(row_t, doc_ids)
            batch = 1 if doc_ids is None else doc_ids.shape[0]
            return LayerPlan("dense", masks.dense_mask(mask_mod, batch, len(row), seq_len, device))
        raise ValueError(f"unknown backend {backend!r}")
