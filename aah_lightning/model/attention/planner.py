"""Per-layer attention plans from the window table, cached until the table changes."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from aah_lightning.model.attention.registry import BackendUnavailable, Plan, get_backend
from aah_lightning.model.attention.sdpa import CausalPlan


class AttentionPlanner:
    """Per-layer plans from the window table, cached and never stale.

    The cache is keyed by the table's storage and autograd version counter (every in-place write to the buffer -
    the policies' ``copy_``, ``load_state_dict`` - bumps it), so a changed table is noticed without reading its
    values. Only then is the table read back (one small host copy, at control steps) and compared row by row: only
    layers whose row changed get new plans. Entries are keyed by row contents, so identical rows share one plan.

    A layer whose heads all have ``W >= T`` (and no document mask) runs ``CausalPlan`` under every backend: that is
    the same mask (a sink changes nothing there), and the fused causal kernels are the fastest way to compute it.
    """

    def __init__(self, block_size: int = 128):
        self.block_size = block_size
        self._table_key = None
        self._rows: list[tuple[int, ...]] = []
        self._cache: dict = {}
        self.builds = 0  # number of plans built (tests use it to prove reuse)

    def rows(self, windows: Tensor) -> list[tuple[int, ...]]:
        key = (windows.data_ptr(), windows._version, windows.device, tuple(windows.shape))
        if key != self._table_key:
            self._rows = [tuple(r) for r in windows.tolist()]
            self._table_key = key
            live = set(self._rows)
            self._cache = {k: v for k, v in self._cache.items() if k[1] in live}
        return self._rows

    def plans(
        self, windows: Tensor, seq_len: int, backend: str, doc_ids: Tensor | None = None, sink: int = 0
    ) -> list[Plan]:
        """One plan per layer for the resolved ``backend`` (see ``registry.resolve_backend``) and attention sink."""
        device = windows.device
        impl = get_backend(backend)
        plans = []
        for row in self.rows(windows):
            if doc_ids is None and min(row) >= seq_len:
                plans.append(CausalPlan(row, seq_len))
            elif doc_ids is not None:  # depends on the batch: built every call, never cached
                plans.append(self._build(impl, row, seq_len, device, doc_ids, sink))
            else:
                key = (backend, row, seq_len, device, impl.cache_key(device), sink)
                if key not in self._cache:
                    self._cache[key] = self._build(impl, row, seq_len, device, None, sink)
                plans.append(self._cache[key])
        return plans

    def _build(self, impl, row, seq_len, device, doc_ids, sink) -> Plan:
        self.builds += 1
        extra = {}
        if sink:  # a backend written before sinks existed builds without one; it cannot run a model with a sink
            if "sink" not in inspect.signature(impl.build).parameters:
                raise BackendUnavailable(
                    f"model.gpt.backend={impl.name} takes no attention sink (its build has no sink argument): "
                    f"model.aah.sink={sink} needs a backend that does"
                )
            extra["sink"] = sink
        return impl.build(row, seq_len, doc_ids, device=torch.device(device), block_size=self.block_size, **extra)
