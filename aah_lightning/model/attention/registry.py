"""The attention backend interface: what a backend is, what its plans answer, and which backend runs where.

A **backend** is one module in this package that defines a ``Backend`` subclass and registers it with
``@register``. It answers two questions:

* ``available(device, needs_grad) -> Availability``: can it run here (true/false, with the reason when not)?
* ``build(row, seq_len, doc_ids, device=..., block_size=..., sink=...) -> Plan``: the executable attention of one
  layer whose heads have the windows ``row`` (a tuple of ints) and the model's attention sink (``sink``: the first
  ``sink`` positions stay visible to every windowed head), built once per window row (or per batch with documents).
  ``sink`` is passed only when it is above 0: a backend whose ``build`` has no ``sink`` argument runs models
  without one and refuses the others with one line.

A **plan** is one layer's attention, and the one thing ``GPT.forward`` asks of attention (the plan contract):

* ``plan(q, k, v) -> out``. Each block calls its layer's plan once per forward with that layer's ``q``
  ``[B, H, T, D]`` and ``k``, ``v`` ``[B, Hkv, T, D]`` (``q`` and ``k`` already rotated by RoPE at the tokens'
  positions: ``0..T-1``, or the ``positions`` passed to ``GPT.forward``) and projects what it returns, ``[B, H, T,
  D]`` (the same shape as ``q``), back to the residual stream. ``Hkv`` divides ``H``: grouped-query attention, query
  head ``h`` reads key/value head ``h // (H / Hkv)`` (``Hkv = H`` without it). A kernel that takes fewer key/value
  heads natively is given them (SDPA's and flex's ``enable_gqa``); the others expand them (``expand_kv``). A plan may keep state (a KV cache) or record its inputs; the tensors it receives are
  the layer's own, so it must not write into them.
* ``head_groups``: None, or a ``HeadGroups`` for a plan that runs its heads in groups, each group on
  its own plan (``split``, ``varlen``). The layer then computes q, k, v with the heads in the groups' ``order`` by
  reordering the rows of its projection weights, runs each group's plan on its slice of heads (a view), and adds the
  groups' outputs up through the matching columns of the output projection: no activation is gathered or scattered.
  ``plan(q, k, v)`` must still compute the whole layer's attention, for callers that hold every head's q, k, v.
* ``eager``: True makes ``GPT.forward`` run the layer's block uncompiled, as its class
  defines it, even where ``model.gpt.compile_blocks`` compiled it - for plans whose Python state changes from call to
  call (generation's cache, the gain probe's one-head windows), which a compiled graph would guard on and recompile
  for. The block's module hooks still run (FSDP2 gathers a sharded block's weights for it).

``LayerPlan`` is this contract as a typed protocol. The backends' plans (``Plan`` subclasses, built here) compute exactly the attention of ``masks.window_mask_mod``:
query q sees key kv iff ``kv <= q`` and (``q - kv < W[h]`` or ``kv`` is among the first ``sink`` positions), and, with
documents, both are in the same document (whose first ``sink`` positions are then the sink). Diagnostics ask
them what they cost instead of testing their type: ``tile_counts(block_size)`` (partial, full and causal tiles),
``pairs()`` (in-window pairs) and ``computed_pairs(block_size)`` (the pairs its kernel computes). Callers of
``GPT.forward`` may pass plans of their own (``plans=``, one per layer), most often wrapping these: the probe's
``Recording`` (recording.py) records q, k, v and delegates; generation's plans (model/generate.py) fill its window KV
cache at prefill and attend over it at decode steps.

``auto`` is decided here and nowhere else (``AUTO_RULES``); a backend that cannot run may name a ``fallback`` that
runs instead, announced by one log line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from aah_lightning.model.window_math import TileCounts, tile_counts, window_pairs

log = logging.getLogger(__name__)


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (device / grad mode / missing package)."""


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run; false ones carry the reason, written for the user."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


AVAILABLE = Availability(True)


@dataclass(frozen=True, eq=False)
class HeadGroups:
    """A layer's heads in groups: ``order`` (LongTensor ``[H]``, a permutation of the layer's heads; None: the layer's
    own order), then consecutive groups of ``sizes[i]`` heads, each run by ``parts[i]``."""

    order: Tensor | None
    sizes: tuple[int, ...]
    parts: tuple


@runtime_checkable
class LayerPlan(Protocol):
    """What ``GPT.forward`` asks of one layer's attention (the plan contract above), typed: every plan a backend builds
    (``Plan``) and every plan a caller passes (the probe's ``Recording``, generation's, the gain probe's) has these."""

    eager: bool  # True: the layer's block runs uncompiled
    head_groups: HeadGroups | None  # set: the layer runs the groups itself

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class Plan:
    """One layer's attention, ready to run (the contract: this module's docstring). Subclasses set ``kind`` and
    carry ``row`` (the layer's windows, ints) and ``seq_len``, and implement ``__call__``."""

    kind: str = "plan"
    sink: int = 0  # the model's attention sink (plans that take one set it as a field)
    eager: bool = False  # True: GPT.forward runs this layer's block uncompiled
    head_groups: HeadGroups | None = None  # set: the layer runs the groups itself, moving weights, not activations
    row: tuple[int, ...]
    seq_len: int

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        raise NotImplementedError

    def tile_counts(self, block_size: int) -> TileCounts:
        """Tiles a block-sparse kernel visits for this layer; analytic at ``block_size`` unless the plan holds the
        BlockMask its kernel runs with."""
        return tile_counts(self.row, self.seq_len, block_size, self.sink)

    def pairs(self) -> int:
        """In-window causal (query, key) pairs of the layer's heads, sink pairs included, per sequence (documents not
        subtracted)."""
        return sum(window_pairs(w, self.seq_len, self.sink) for w in self.row)

    def computed_pairs(self, block_size: int) -> int:
        """(query, key) pairs the kernel computes per sequence, masked ones included; a tiled kernel computes every
        pair of each visited tile."""
        counts = self.tile_counts(block_size)
        return (counts.partial + counts.full) * block_size * block_size


def expand_kv(x: Tensor, n_head: int, order: Tensor | None = None) -> Tensor:
    """Keys or values ``[B, Hkv, T, D]`` with one key/value head per query head: ``[B, n_head, T, D]``, query head
    ``h`` reading key/value head ``h // (n_head / Hkv)``, and with ``order`` the query heads of ``order`` in its order.
    For kernels that cannot take fewer key/value heads than query heads, or whose heads run in another order: a copy
    (none when there is nothing to expand or reorder)."""
    n_kv = x.shape[1]
    if order is None:
        return x if n_kv == n_head else x.repeat_interleave(n_head // n_kv, dim=1)
    return x.index_select(1, order if n_kv == n_head else order // (n_head // n_kv))


class Backend:
    """One way to run attention. Subclasses set ``name`` and implement ``build``; ``available`` defaults to
    everywhere. ``fallback``: the backend to run instead when this one is unavailable (None: refuse)."""

    name: str = ""
    fallback: str | None = None
    dtypes: tuple[torch.dtype, ...] | None = None  # the dtypes its kernel takes (None: any)

    def available(self, device: torch.device, needs_grad: bool) -> Availability:
        return AVAILABLE

    def build(
        self,
        row: tuple[int, ...],
        seq_len: int,
        doc_ids: Tensor | None,
        *,
        device: torch.device,
        block_size: int,
        sink: int = 0,
    ) -> Plan:
        raise NotImplementedError

    def cache_key(self, device: torch.device) -> tuple:
        """What else a cached plan depends on, besides (row, T, device)."""
        return ()


_BACKENDS: dict[str, Backend] = {}


def register(cls: type[Backend]) -> type[Backend]:
    """Class decorator: make a backend selectable by its ``name`` (``model.gpt.backend``)."""
    if cls.name in _BACKENDS or cls.name == "auto":
        raise ValueError(f"attention backend name {cls.name!r} is taken")
    _BACKENDS[cls.name] = cls()
    return cls


def get_backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(backend_names())}")
    return _BACKENDS[name]


def backend_names() -> tuple[str, ...]:
    """Every registered backend, plus ``auto``."""
    return ("auto",) + tuple(_BACKENDS)


# The ``auto`` rule, per device type: the first (backend, from sequence length) whose backend is available wins.
# Each rule names the fastest measured plan for its device and lengths (the measurements: docs/benchmarks.md).
# CPU: banded from T = 256 on; below, the dense mask (too few tokens to amortise banded's extra kernel calls).
# CUDA: flex_tuned; on GPUs without pinned options it is plain flex.
AUTO_RULES: dict[str, tuple[tuple[str, int], ...]] = {
    "cuda": (("flex_tuned", 0),),
    "cpu": (("banded", 256), ("sdpa", 0)),
}

_logged: set[str] = set()


def resolve_backend(requested: str, device: torch.device, needs_grad: bool, seq_len: int) -> str:
    """The backend that runs now for a configured ``model.gpt.backend``: ``auto`` by ``AUTO_RULES``; a named backend if
    available, else its fallback (one log line), else ``BackendUnavailable`` with the reason."""
    device = torch.device(device)
    if requested == "auto":
        for name, min_seq_len in AUTO_RULES.get(device.type, AUTO_RULES["cpu"]):
            if seq_len >= min_seq_len and get_backend(name).available(device, needs_grad):
                return name
        raise BackendUnavailable(f"model.gpt.backend=auto: no attention backend runs on {device.type}")
    backend = get_backend(requested)
    while not (state := backend.available(device, needs_grad)):
        if backend.fallback is None:
            raise BackendUnavailable(state.reason)
        message = f"model.gpt.backend={backend.name} unavailable ({state.reason}); using {backend.fallback}"
        if message not in _logged:
            _logged.add(message)
            log.warning(message)
        backend = get_backend(backend.fallback)
    return backend.name
