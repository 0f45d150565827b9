"""FlexAttention with a per-head BlockMask, compiled: skips empty tiles, runs the mask_mod only on partial ones.

Three registered variants, one kernel:

* ``flex``       - torch's default kernel options. CUDA training (``auto`` there); on CPU forward only (torch has no
  CPU backward for it), so it serves validation and probes.
* ``flex_tuned`` - the same with ``kernel_options`` pinned per (GPU arch, head_dim, dtype) in ``TUNED_OPTIONS``
  (defaults ``DEFAULT_TUNED_OPTIONS`` elsewhere); on CPU identical to ``flex``.
* ``flex_fa4``   - FlashAttention-4 (CuTeDSL) through flex, ``kernel_options={"BACKEND": "FLASH"}``: needs a CUDA GPU
  of compute capability 9.0 or newer and the ``flash-attn-4`` package (``pip install -e ".[fa4]"``); otherwise it
  falls back to ``flex_tuned`` with one log line. FA4 needs BlockMasks that list full tiles (ours do) and a
  ``dynamic=False`` compile (ours is); the installed torch must translate our masks into CuTeDSL, which
  ``flash_compat`` checks (torch 2.11 and 2.13, read here, do; nothing is patched).

On CPU the compiled flex kernel splits ``B * H * q-tiles`` into one contiguous range per thread, so a layer whose
windows grow with the head index leaves one thread idle most of the time. The CPU plan therefore runs the heads in a
balanced order (``cpu_head_order``) when that shortens the busiest thread's work: q, k, v and the BlockMask are
permuted, the output is permuted back. The plan assumes batch 1 and the thread count at plan time.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from aah_lightning.model import masks
from aah_lightning.model.attention import flash_compat
from aah_lightning.model.attention.registry import AVAILABLE, Availability, Backend, Plan, expand_kv, register
from aah_lightning.model.window_math import TileCounts, window_tiles

_compiled_flex = None


def compiled_flex_attention():
    """``torch.compile(flex_attention)``, built once per process (windows are tensors: new values never recompile)."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


# kernel_options of ``flex_tuned`` per (compute capability, head_dim, dtype), pinned from tools/gpu_tune.py runs.
# Two options are wrong for our masks, whatever they gain:
# * ROWS_GUARANTEED_SAFE drops the kernel's guard for a row whose running maximum is still -inf. Every row sees its
#   diagonal, but the kernel visits a q tile's partial tiles in ascending order, and the window edge's tile can hold
#   no visible key for some of its rows: exp(-inf - (-inf)) makes them NaN (measured on an H200, docs/benchmarks.md).
# * BLOCKS_ARE_CONTIGUOUS assumes a row's visited tiles are adjacent; ours are not (edge and diagonal tiles, with
#   full tiles between).
DEFAULT_TUNED_OPTIONS: dict = {}
TUNED_OPTIONS: dict[tuple[tuple[int, int], int, torch.dtype], dict] = {
    # H200 (sm90), D=64, bf16: max-autotune's backward winner for the paper mix at T=4096 (torch 2.11); the forward
    # winner was the default (128 x 128 tiles, 3 stages, 4 warps). docs/benchmarks.md, GPU section.
    ((9, 0), 64, torch.bfloat16): {
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 4,
        "bwd_num_warps": 4,
    },
}
FA4_OPTIONS: dict = {"BACKEND": "FLASH"}


def tuned_options(arch: tuple[int, int] | None, head_dim: int, dtype: torch.dtype) -> dict:
    """The pinned options for (arch, head_dim, dtype), else the defaults; none on CPU (``arch`` None)."""
    if arch is None:
        return {}
    return TUNED_OPTIONS.get((arch, head_dim, dtype), DEFAULT_TUNED_OPTIONS)


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


def cpu_head_order(windows_row: Tensor, seq_len: int, block_size: int, threads: int, sink: int = 0) -> list[int] | None:
    """The balanced head order for the CPU flex kernel, or None when it would not shorten the busiest thread's work
    by at least 5 % for ``threads`` threads at batch 1 (the permutation costs four copies of q, k, v, out)."""
    if threads < 2:
        return None
    partial, full = window_tiles(windows_row, seq_len, block_size, sink)
    per_item = (partial | full).sum(-1)  # [H, n_q]: tiles each (head, q-tile) item visits
    order = balanced_order(per_item.sum(-1).tolist(), threads)
    if cpu_makespan(per_item[order], threads) > 0.95 * cpu_makespan(per_item, threads):
        return None
    return order


@dataclass(frozen=True, eq=False)
class FlexPlan(Plan):
    """Compiled flex with ``block_mask``. ``order``/``inverse`` (CPU): the heads run in ``order`` (the BlockMask is
    built for that order) and ``inverse`` restores the layer's order. ``arch``: the GPU's compute capability (None on
    CPU); with ``options`` "tuned" the kernel options come from ``tuned_options(arch, head_dim, dtype)``, else
    ``options`` is the dict itself."""

    row: tuple[int, ...]
    seq_len: int
    block_mask: BlockMask
    order: Tensor | None = None
    inverse: Tensor | None = None
    options: dict | str | None = None
    arch: tuple[int, int] | None = None
    sink: int = 0
    kind = "flex"

    def kernel_options(self, q: Tensor) -> dict | None:
        if self.options == "tuned":
            return tuned_options(self.arch, q.shape[-1], q.dtype) or None
        return self.options

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.order is not None:  # permuted query heads no longer share key/value heads in runs: expand them
            q, k, v = q.index_select(1, self.order), *(expand_kv(x, q.shape[1], self.order) for x in (k, v))
        elif q.device.type == "cpu":  # same strides as a permuted layer: one compiled graph serves both
            q, k, v = (x.contiguous() for x in (q, k, v))
        options = self.kernel_options(q)
        gqa = k.shape[1] != q.shape[1]  # flex takes fewer key/value heads natively
        out = compiled_flex_attention()(q, k, v, block_mask=self.block_mask, kernel_options=options, enable_gqa=gqa)
        return out if self.order is None else out.index_select(1, self.inverse)

    def tile_counts(self, block_size: int) -> TileCounts:
        """Counted on the BlockMask the kernel runs with (at its own tile size)."""
        return masks.block_mask_tiles(self.block_mask)

    def computed_pairs(self, block_size: int) -> int:
        counts = self.tile_counts(block_size)
        q_block, kv_block = self.block_mask.BLOCK_SIZE
        return (counts.partial + counts.full) * q_block * kv_block // max(1, self.block_mask.kv_num_blocks.shape[0])


def device_arch(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability (the key of ``TUNED_OPTIONS``), None off CUDA."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def build_flex_plan(row, seq_len, doc_ids, device, block_size, options=None, balance=True, sink=0) -> FlexPlan:
    """The flex plan of one layer: per-batch BlockMask with documents; on CPU, with ``balance``, the heads in the
    balanced order where it helps."""
    row_t = torch.tensor(row, dtype=torch.int32, device=device)  # a private copy: the live table may change
    arch = device_arch(device)
    if doc_ids is not None:
        block_mask = masks.document_block_mask(row_t, doc_ids, block_size, sink)
        return FlexPlan(row, seq_len, block_mask, options=options, arch=arch, sink=sink)
    if device.type == "cpu" and balance:
        order = cpu_head_order(row_t, seq_len, block_size, torch.get_num_threads(), sink)
        if order is not None:
            order = torch.tensor(order, device=device)
            block_mask = masks.window_block_mask(row_t[order], seq_len, block_size, sink)
            return FlexPlan(row, seq_len, block_mask, order, torch.argsort(order), options, arch, sink)
    block_mask = masks.window_block_mask(row_t, seq_len, block_size, sink)
    return FlexPlan(row, seq_len, block_mask, options=options, arch=arch, sink=sink)


@register
class FlexBackend(Backend):
    name = "flex"
    options: dict | str | None = None

    def available(self, device, needs_grad) -> Availability:
        if needs_grad and device.type != "cuda":
            return Availability(
                False,
                f"model.gpt.backend={self.name} cannot train on {device.type}: FlexAttention has no backward pass there "
                f"(torch {torch.__version__}). Use model.gpt.backend=auto (banded or SDPA on CPU), banded or sdpa, "
                f"or train on a CUDA GPU",
            )
        return AVAILABLE

    def build(self, row, seq_len, doc_ids, *, device, block_size, sink=0) -> Plan:
        return build_flex_plan(row, seq_len, doc_ids, device, block_size, self.options, sink=sink)

    def cache_key(self, device) -> tuple:
        return (torch.get_num_threads(),) if device.type == "cpu" else ()  # the CPU head order depends on threads


@register
class TunedFlexBackend(FlexBackend):
    name = "flex_tuned"
    options = "tuned"


def fa4_missing(device: torch.device) -> str | None:
    """Why FlashAttention-4 cannot run on ``device`` (None when it can): a CUDA GPU of compute capability 9.0 or newer
    and the ``flash-attn-4`` package (``flex_fa4`` and ``fa4_window``)."""
    if device.type != "cuda":
        return f"FlashAttention-4 needs a CUDA GPU, not {device.type}"
    arch = torch.cuda.get_device_capability(device)
    if arch < (9, 0):
        return f"FlashAttention-4 needs compute capability >= 9.0, this GPU has {arch[0]}.{arch[1]}"
    try:
        importlib.import_module("flash_attn.cute")
    except Exception as err:  # not installed, or its CUDA libraries do not load
        return f'flash_attn.cute does not import ({type(err).__name__}: {err}); pip install -e ".[fa4]"'
    return None


@register
class Fa4FlexBackend(FlexBackend):
    name = "flex_fa4"
    options = FA4_OPTIONS
    fallback = "flex_tuned"
    dtypes = (torch.bfloat16, torch.float16)

    def available(self, device, needs_grad) -> Availability:
        # and the installed torch must translate our masks into CuTeDSL (flash_compat)
        reason = fa4_missing(device) or flash_compat.flash_gap()
        return AVAILABLE if reason is None else Availability(False, reason)
