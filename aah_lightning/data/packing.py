"""Pack documents into fixed ``seq_len + 1`` blocks with an end-of-document separator, keeping document ids.

A block of ``T + 1`` tokens gives inputs ``block[:-1]`` and targets ``block[1:]``. Document ids (a running index per
document; the separator belongs to the document it ends) let the attention mask keep queries inside their document.
Map-style corpora are a ``TokenStream`` (in memory or a memory-mapped token folder) cut into ``TokenBlocks``; streamed
ones go through ``pack_stream``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from aah_lightning.data.token_folder import TokenStream


class TokenBlocks(Dataset):
    """Blocks ``first, first + 1, ...`` (``count`` of them) of ``seq_len + 1`` tokens of a ``TokenStream``.

    Block ``i`` is the slice ``[(first + i) * (seq_len + 1), (first + i + 1) * (seq_len + 1))``, read when asked for, so
    a memory-mapped stream stays on disk. Item: tokens, doc_ids (int64), its index and, when the stream knows its
    text, ``bytes``: the UTF-8 bytes of text its predicted tokens (all but the first) encode.
    """

    def __init__(self, stream: TokenStream, seq_len: int, first: int, count: int):
        self.stream, self.block, self.first, self.count = stream, seq_len + 1, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.count:
            raise IndexError(i)
        start = (self.first + i) * self.block
        item = self.stream.read(start, start + self.block)
        item["tokens"], item["doc_ids"] = torch.from_numpy(item["tokens"]), torch.from_numpy(item["doc_ids"])
        return {**item, "index": i}

    def as_array(self) -> np.ndarray:
        """The blocks as one ``[count, seq_len + 1]`` view of the stream (no copy)."""
        start = self.first * self.block
        return self.stream.tokens[start : start + self.count * self.block].reshape(self.count, self.block)


def pack_stream(
    docs: Iterable[tuple[np.ndarray, np.ndarray | None]],
    eos_id: int,
    seq_len: int,
    first_doc: int = 0,
    skip: int = 0,
    positions: bool = False,
) -> Iterator:
    """Streaming packer: yields ``seq_len + 1`` blocks as documents arrive (for iterable sources).

    ``docs``: (tokens, per-token UTF-8 byte counts or None) per document, without the end-of-document id, which is
    added here. Documents are numbered from ``first_doc``; ``skip``: tokens of the first document that an earlier
    pass already emitted (a resumed stream). With ``positions``, every block comes as ``(block, (doc, offset))``:
    the document the next block starts in and how many of its tokens are already emitted, so that a stream restarted
    there with ``first_doc=doc, skip=offset`` continues token for token. The partial block left at the end is dropped.
    """
    block = seq_len + 1
    buf_t = buf_d = buf_b = np.zeros(0, np.int64)
    heads = deque()  # [doc id, stream position of its first buffered token, its tokens emitted before that]
    read = emitted = count = 0
    doc = first_doc
    for tokens, nbytes in docs:
        t = np.append(np.asarray(tokens, np.int64), eos_id)[skip:]
        buf_t = np.concatenate([buf_t, t])
        buf_d = np.concatenate([buf_d, np.full(len(t), doc, np.int64)])
        if nbytes is not None:
            buf_b = np.concatenate([buf_b, np.append(np.asarray(nbytes, np.int64), 0)[skip:]])
        heads.append([doc, read, skip])
        read, doc, skip = read + len(t), doc + 1, 0
        while len(buf_t) >= block:
            item = {
                "tokens": torch.from_numpy(buf_t[:block].copy()),
                "doc_ids": torch.from_numpy(buf_d[:block].copy()),
                "index": count,
            }
            if nbytes is not None:
                item["bytes"] = int(buf_b[1:block].sum())
                buf_b = buf_b[block:]
            buf_t, buf_d = buf_t[block:], buf_d[block:]
            count, emitted = count + 1, emitted + block
            if not positions:
                yield item
                continue
            while len(heads) > 1 and heads[1][1] <= emitted:
                heads.popleft()
            if emitted == read:
                yield item, (doc, 0)
            else:
                head, start, before = heads[0]
                yield item, (head, before + emitted - start)


class EndlessSampler(Sampler[int]):
    """One global order of the blocks, the same for every number of ranks, cut into rank shards; resumable by position.

    The global stream is the concatenation of seeded permutations: epoch ``e`` is ``randperm(n)`` drawn from
    ``seed + e``, of which the first ``per_epoch`` entries are used (default all ``n``; epoch-based runs use whole
    global batches only). Global position ``q`` is entry ``q mod per_epoch`` of epoch ``q // per_epoch`` and belongs
    to rank ``q mod world_size``: rank ``r`` takes positions ``start + r, start + r + world_size, ...``. With a
    per-rank batch ``B`` every micro-batch round of all ranks is a contiguous run of ``B * world_size`` positions, so an
    optimizer step of global batch ``G`` consumes positions ``[step * G, (step + 1) * G)`` whatever the world size;
    only which rank and micro-batch holds a block depends on it. ``start``: the number of global positions consumed
    before this sampler's first item (a multiple of ``world_size``); ``length``: the items this rank yields.

    ``epochs``: Lightning's training epoch is one permutation (epoch-based runs): ``set_epoch(e)`` moves ``start`` to
    epoch ``e``'s first position unless it already lies in it (a run resumed inside epoch ``e``).
    """

    def __init__(
        self,
        n: int,
        seed: int,
        length: int,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
        per_epoch: int | None = None,
        epochs: bool = False,
    ):
        per_epoch = n if per_epoch is None else per_epoch
        if not 0 < per_epoch <= n or per_epoch < world_size:
            raise ValueError(
                f"{n} training blocks ({per_epoch} of them per epoch) cannot be shared by {world_size} ranks"
            )
        self.n, self.seed, self.length, self.per_epoch, self.epochs = n, seed, length, per_epoch, epochs
        self.rank, self.world_size, self.start = rank, world_size, start

    def __len__(self) -> int:
        return self.length

    def permutation(self, epoch: int) -> torch.Tensor:
        """The blocks of epoch ``epoch`` in their global order (its first ``per_epoch`` entries)."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=g)[: self.per_epoch]

    def set_epoch(self, epoch: int) -> None:
        if self.epochs and self.start // self.per_epoch != epoch:
            self.start = epoch * self.per_epoch

    def __iter__(self) -> Iterator[int]:
        q, left = self.start + self.rank, self.length
        while left > 0:
            epoch, offset = divmod(q, self.per_epoch)
            chunk = self.permutation(epoch)[offset :: self.world_size][:left].tolist()
            yield from chunk
            left -= len(chunk)
            q += len(chunk) * self.world_size
