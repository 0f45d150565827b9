import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from aah_lightning.model.attention.reference import parity_limit, reference_attention
from aah_lightning.model.masks import dense_mask, document_positions, window_block_mask, window_mask_mod
from helpers.spec import allowed, random_sink, random_windows


@pytest.mark.parametrize("sink", [0, 1, 4, 20])
@pytest.mark.parametrize("seq_len", [1, 7, 130, 257])
def test_dense_mask_of_the_mask_mod_matches_the_spec(seq_len, sink):
    g = torch.Generator().manual_seed(seq_len)
    w = random_windows(6, seq_len, g)
    got = dense_mask(window_mask_mod(w, sink=sink), 1, 6, seq_len, "cpu")
    assert torch.equal(got, allowed(w, seq_len, sink=sink))


@pytest.mark.parametrize("sink", [0, 2])
def test_document_mask_keeps_queries_inside_their_document(sink):
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2], [5, 5, 7, 7, 5, 5, 7, 7]])
    w = torch.tensor([8, 2, 1], dtype=torch.int32)
    got = dense_mask(window_mask_mod(w, docs, sink), 3, 3, 8, "cpu")
    assert torch.equal(got, allowed(w, 8, docs, sink))
    assert not got[0, 0, 3, 2]  # first token of document 1 cannot see document 0
    # the sink of a query is the start of its own document: position 5 of row 1 sees 1 and 2 (its document's first
    # two tokens) with window 1, never position 0 (another document)
    assert got[1, 2, 5].tolist() == [False, sink > 0, sink > 0, False, False, True, False, False]


def test_document_positions_count_the_earlier_tokens_of_the_same_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 7, 7, 5, 5, 7, 7]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 0, 1, 2, 3, 2, 3]]


def test_the_float64_reference_is_the_masked_softmax_of_the_spec():
    # Every backend is held to the package's reference, which is built from the mask_mod: here it meets a softmax over
    # the mask written from the spec, with and without documents, windows past T included.
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 6, 37, 8
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    w = random_windows(H, T, g)
    docs = torch.randint(0, 3, (B, T), generator=g).sort(-1).values
    for doc_ids, sink in ((None, 0), (docs, 0), (None, 3), (docs, random_sink(T, g) or 2)):
        scores = q.double() @ k.double().transpose(-1, -2) / D**0.5
        want = torch.softmax(scores.masked_fill(~allowed(w, T, doc_ids, sink), float("-inf")), dim=-1) @ v.double()
        got = reference_attention(q, k, v, w, doc_ids, sink)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_parity_allows_twice_sdpas_error_or_the_floor_of_the_dtype():
    assert parity_limit(1e-6, torch.float32) == 1e-4 and parity_limit(1e-3, torch.float32) == 2e-3
    assert parity_limit(1e-3, torch.bfloat16) == 2e-2 and parity_limit(0.05, torch.bfloat16) == 0.1


def reference_tiles(w, seq_len, block_size, sink=0):
    """Tile classes from the dense reference: non-empty = some real pair allowed; full = every real pair allowed, below the diagonal."""
    m = allowed(w, seq_len, sink=sink)[0]
    n = -(-seq_len // block_size)
    nonempty = torch.zeros(len(w), n, n, dtype=torch.bool)
    full = torch.zeros_like(nonempty)
    for i in range(n):
        for j in range(n):
            tile = m[:, i * block_size : (i + 1) * block_size, j * block_size : (j + 1) * block_size]
            nonempty[:, i, j] = tile.flatten(1).any(1)
            full[:, i, j] = tile.flatten(1).all(1) & (j < i)  # diagonal tiles always go through the mask_mod
    return nonempty, full


@pytest.mark.parametrize("sink", [0, 3, 16, 40])
@pytest.mark.parametrize("seq_len", [1, 7, 130, 257, 512])
@pytest.mark.parametrize("block_size", [16, 128])
def test_analytic_block_mask_matches_the_mask_mod(seq_len, block_size, sink):
    g = torch.Generator().manual_seed(seq_len + block_size)
    w = random_windows(5, seq_len, g)
    ours = window_block_mask(w, seq_len, block_size, sink)
    # Same token-level mask as torch's own builder evaluating the mask_mod ...
    theirs = create_block_mask(
        window_mask_mod(w, sink=sink), 1, 5, seq_len, seq_len, device="cpu", BLOCK_SIZE=block_size
    )
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    # ... and exactly the tiles that hold allowed pairs (torch's builder also lists padded tiles of the last row).
    nonempty, full = reference_tiles(w, seq_len, block_size, sink)
    partial_ours = ours.to_dense()[0].bool() & ~_full_dense(ours)
    assert torch.equal(_full_dense(ours), full)
    assert torch.equal(partial_ours | _full_dense(ours), nonempty)


def _full_dense(bm):
    """bool [H, n, n] of full tiles."""
    num, idx = bm.full_kv_num_blocks[0], bm.full_kv_indices[0]
    h, n = num.shape
    out = torch.zeros(h, n, idx.shape[-1], dtype=torch.bool)
    for hh in range(h):
        for r in range(n):
            out[hh, r, idx[hh, r, : int(num[hh, r])].long()] = True
    return out
