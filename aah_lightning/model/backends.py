"""Attention execution: one plan per layer, derived from the window table, cached until the table changes.

Backends (identical semantics, all derived from ``masks.window_mask_mod``):

* ``flex``  - FlexAttention with a per-head BlockMask, compiled. Skips empty tiles. On CPU forward only (torch has
  no CPU backward for it), so it serves validation and probes there.
* ``sdpa``  - ``scaled_dot_product_attention`` with the dense boolean mask of the mask_mod (or ``is_causal`` when every
  head of the layer sees the whole sequence). CPU training and the reference.
* ``auto``  - the fastest correct choice for the device and grad mode (see ``resolve_backend``).

A layer whose heads all have ``W >= T`` (and no document mask) runs plain causal SDPA under every backend: that is
the same mask, and the fused causal kernels are the fastest way to compute it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from aah_lightning.model import masks

# On CPU, compiled flex pays off for inference only once tiles can be skipped at a useful scale; below this length
# the dense SDPA mask is faster than the ~10 s compile.
CPU_FLEX_MIN_SEQ_LEN = 1024

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
    """Map a configured backend to the one that runs now."""
    if requested == "auto":
        if device.type == "cuda":
            return "flex"
        if not needs_grad and seq_len >= CPU_FLEX_MIN_SEQ_LEN:
            return "flex"
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
    """How one layer attends: ``kind`` in {causal, dense, flex}; ``mask`` is None, a bool tensor or a BlockMask."""

    kind: str
    mask: object = None


def attend(q: Tensor, k: Tensor, v: Tensor, plan: LayerPlan) -> Tensor:
    """q, k, v: ``[B, H, T, D]`` -> ``[B, H, T, D]``."""
    if plan.kind == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if plan.kind == "dense":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask)
    if plan.kind == "flex":
        return compiled_flex_attention()(q, k, v, block_mask=plan.mask)
    raise ValueError(f"unknown attention plan {plan.kind!r}")


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
            if doc_ids is None:
                return LayerPlan("flex", masks.window_block_mask(row_t, seq_len, self.block_size))
            return LayerPlan("flex", masks.document_block_mask(row_t, doc_ids, self.block_size))
        if backend == "sdpa":
            mask_mod = masks.window_mask_mod(row_t, doc_ids)
            batch = 1 if doc_ids is None else doc_ids.shape[0]
            return LayerPlan("dense", masks.dense_mask(mask_mod, batch, len(row), seq_len, device))
        raise ValueError(f"unknown backend {backend!r}")
