"""Pack documents into fixed ``seq_len + 1`` blocks with an end-of-document separator, keeping document ids.

A block of ``T + 1`` tokens gives inputs ``block[:-1]`` and targets ``block[1:]``. Document ids (a running index per
document; the separator belongs to the document it ends) let the attention mask keep queries inside their document.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


def concatenate(docs: Iterable[np.ndarray], eos_id: int, first_doc_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One token stream (each document followed by ``eos_id``) and the matching document ids."""
    tokens, ids = [], []
    for i, doc in enumerate(docs, start=first_doc_id):
        tokens.append(np.asarray(doc, dtype=np.int32))
        tokens.append(np.array([eos_id], dtype=np.int32))
        ids.append(np.full(len(doc) + 1, i, dtype=np.int32))
    if not tokens:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    return np.concatenate(tokens), np.concatenate(ids)


class PackedBlocks(Dataset):
    """Non-overlapping ``seq_len + 1`` blocks of a token stream. Item: tokens, doc_ids (int64) and its index."""

    def __init__(self, tokens: np.ndarray, doc_ids: np.ndarray, seq_len: int):
        self.block = seq_len + 1
        n = len(tokens) // self.block
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens[: n * self.block])).view(n, self.block)
        self.doc_ids = torch.from_numpy(np.ascontiguousarray(doc_ids[: n * self.block])).view(n, self.block)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"tokens": self.tokens[i].long(), "doc_ids": self.doc_ids[i].long(), "index": i}


def pack_stream(docs: Iterator[np.ndarray], eos_id: int, seq_len: int) -> Iterator[dict]:
    """Streaming packer: yields blocks as documents arrive (for iterable sources)."""
    block = seq_len + 1
    buf_t = np.zeros(0, np.int32)
    buf_d = np.zeros(0, np.int32)
    count = 0
    for i, doc in enumerate(docs):
        t, d = concatenate([doc], eos_id, first_doc_id=i)
        buf_t, buf_d = np.concatenate([buf_t, t]), np.concatenate([buf_d, d])
        while len(buf_t) >= block:
            yield {
                "tokens": torch.from_numpy(buf_t[:block].astype(np.int64)),
                "doc_ids": torch.from_numpy(buf_d[:block].astype(np.int64)),
                "index": count,
            }
            count += 1
            buf_t, buf_d = buf_t[block:], buf_d[block:]


class EndlessSampler(Sampler[int]):
    """Seeded permutations of the dataset, epoch after epoch, sharded across ranks, resumable by position.

    The global order is fixed by ``seed``: epoch ``e`` is ``randperm(n)`` drawn from ``seed + e``. Rank ``r`` of
    ``world_size`` takes positions ``r, r + world_size, ...`` of each permutation (disjoint shards that together cover
    the data; the last ``n mod world_size`` items of an epoch are dropped so every rank sees as many). ``start`` is the
    number of items this rank has already consumed, so a resumed run continues with exactly the next items.
    """

    def __init__(self, n: int, seed: int, length: int, rank: int = 0, world_size: int = 1, start: int = 0):
        if n < world_size:
            raise ValueError(f"{n} training blocks cannot be shared by {world_size} ranks")
        self.n, self.seed, self.length = n, seed, length
        self.rank, self.world_size, self.start = rank, world_size, start
        self.per_rank = n // world_size

    def __len__(self) -> int:
        return self.length

    def shard(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.n, generator=g)
        return perm[self.rank : self.per_rank * self.world_size : self.world_size]

    def __iter__(self) -> Iterator[int]:
        epoch, offset = divmod(self.start, self.per_rank)
        left = self.length
        while left > 0:
            chunk = self.shard(epoch)[offset : offset + left].tolist()
            yield from chunk
            left -= len(chunk)
            epoch, offset = epoch + 1, 0
