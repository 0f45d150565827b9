"""The attention mask of one layer, in every form the backends need.

``window_mask_mod`` is the single source of truth: query ``q`` may attend to key ``kv`` iff ``kv <= q`` and
(``q - kv < W[h]`` or ``kv`` is one of the first ``sink`` positions: an attention sink), and, with document masking,
both belong to the same document (the sink is then the first ``sink`` positions of the query's own document). Every
other form here is derived from it or checked against it in the tests:

* ``dense_mask``      evaluates the mask_mod on broadcast index grids -> bool ``[B, H, T, T]`` (SDPA, reference);
* ``window_block_mask`` builds the FlexAttention ``BlockMask`` in closed form from the window row (sliding windows
  have analytic tile lists, so no ``T x T`` mask is ever materialised) and attaches the mask_mod for partial tiles;
* ``document_block_mask`` falls back to ``create_block_mask`` when per-batch document ids join the mask.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from aah_lightning.model.window_math import TileCounts, causal_tiles, window_tiles

# Document ids are padded to a multiple of this so that FlexAttention's padded tile indices never read out of range
# (pytorch#137801); it covers every allowed block size.
_DOC_PAD = 256


def document_positions(doc_ids: Tensor) -> Tensor:
    """Each token's position within its own document (``[B, T]`` int64): how many earlier tokens of its row share its
    document id (``t - start`` for documents packed as contiguous runs)."""
    B, T = doc_ids.shape
    order = torch.argsort(doc_ids, dim=-1, stable=True)
    ids = doc_ids.gather(-1, order)
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start = torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), dim=-1).values
    return torch.empty_like(idx).scatter_(-1, order, idx - start)


def window_mask_mod(windows_row: Tensor, doc_ids: Tensor | None = None, sink: int = 0):
    """The mask_mod of one layer: causal, within the head's window or among the first ``sink`` positions, optionally
    within the document.

    ``windows_row`` is the layer's row of the window table (int32 ``[H]``), captured as a tensor so that new window
    values never trigger a recompile. ``doc_ids`` is ``[B, T]`` (any integer dtype) or None. ``sink`` (an int >= 0):
    the first ``sink`` positions of the sequence (with ``doc_ids``: of the query's document) stay visible to every
    later query of every head; 0 is the plain window.
    """

    def causal_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < windows_row[h])

    def causal_window_sink(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx < windows_row[h]) | (kv_idx < sink))

    if doc_ids is None:
        return causal_window_sink if sink else causal_window

    t = doc_ids.shape[-1]
    docs = torch.nn.functional.pad(doc_ids, (0, -t % _DOC_PAD), value=-1)

    if not sink:

        def causal_window_same_document(b, h, q_idx, kv_idx):
            return causal_window(b, h, q_idx, kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

        return causal_window_same_document

    # Padded positions are never a sink (their position is ``sink``).
    ranks = torch.nn.functional.pad(document_positions(doc_ids), (0, -t % _DOC_PAD), value=sink)

    def causal_window_sink_same_document(b, h, q_idx, kv_idx):
        near = q_idx - kv_idx < windows_row[h]
        return (kv_idx <= q_idx) & (near | (ranks[b, kv_idx] < sink)) & (docs[b, q_idx] == docs[b, kv_idx])

    return causal_window_sink_same_document


def dense_mask(mask_mod, batch: int, heads: int, seq_len: int, device) -> Tensor:
    """Evaluate a mask_mod on broadcast index grids: bool ``[batch, heads, T, T]`` (True = attend)."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    q = torch.arange(seq_len, device=device).view(1, 1, seq_len, 1)
    kv = torch.arange(seq_len, device=device).view(1, 1, 1, seq_len)
    return mask_mod(b, h, q, kv).expand(batch, heads, seq_len, seq_len)


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """Tile counts and indices (selected tiles first, ascending) along the last dim, contiguous, as FlexAttention
    wants them (``tiles`` may be a transposed view)."""
    tiles = tiles.contiguous()
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, order


def window_block_mask(windows_row: Tensor, seq_len: int, block_size: int = 128, sink: int = 0) -> BlockMask:
    """BlockMask for one layer (B=1 broadcast over the batch, H = number of heads), built analytically (a ``sink``
    adds the first kv tile column(s) of every windowed head: partial, or full where every pair is visible).

    Both orientations come from the closed-form tile classes: kv tiles per q tile (forward) and q tiles per kv tile
    (the transpose, used by the backward). ``BlockMask.from_kv_blocks`` would derive the latter with a vmapped
    scatter that costs far more than everything else here (docs/benchmarks.md).
    """
    partial, full = (t.unsqueeze(0) for t in window_tiles(windows_row, seq_len, block_size, sink))
    kv_num, kv_idx = _ordered(partial)
    full_kv_num, full_kv_idx = _ordered(full)
    q_num, q_idx = _ordered(partial.transpose(-2, -1))
    full_q_num, full_q_idx = _ordered(full.transpose(-2, -1))
    return BlockMask(
        seq_lengths=(seq_len, seq_len),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx,
        BLOCK_SIZE=(block_size, block_size),
        mask_mod=window_mask_mod(windows_row, sink=sink),
    )


_compiled_create_block_mask = None


def document_block_mask(windows_row: Tensor, doc_ids: Tensor, block_size: int = 128, sink: int = 0) -> BlockMask:
    """BlockMask for one layer when document ids (per batch) join the mask: built from the mask_mod itself."""
    global _compiled_create_block_mask
    build = create_block_mask
    if doc_ids.is_cuda:  # compiled build avoids the dense [B, H, T, T] intermediate; not worth a compile on CPU
        if _compiled_create_block_mask is None:
            _compiled_create_block_mask = torch.compile(create_block_mask)
        build = _compiled_create_block_mask
    batch, seq_len = doc_ids.shape
    mask_mod = window_mask_mod(windows_row, doc_ids, sink)
    return build(mask_mod, batch, windows_row.numel(), seq_len, seq_len, device=doc_ids.device, BLOCK_SIZE=block_size)


def block_mask_tiles(block_mask: BlockMask) -> TileCounts:
    """Partial and full tiles a BlockMask lists (summed over batch and heads), and the causal tiles of as many heads.

    Reads the mask's tile counts back to the host: for diagnostics at log steps, not the hot path."""
    n_q, n_kv = block_mask.kv_indices.shape[-2:]
    partial = int(block_mask.kv_num_blocks.sum())
    full = 0 if block_mask.full_kv_num_blocks is None else int(block_mask.full_kv_num_blocks.sum())
    heads = block_mask.kv_num_blocks.shape[0] * block_mask.kv_num_blocks.shape[1]
    causal = causal_tiles(n_q, 1) if n_q == n_kv else n_q * n_kv
    return TileCounts(partial, full, heads * causal, "blockmask")
