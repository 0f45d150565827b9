"""Streamed corpora (``data.source: hub``): held-out blocks from the head of the stream, resumable training blocks.

Validation and test are the first blocks of the stream, read by every rank; training leaves their documents out
wherever the rank split puts them (by content: ``skip`` before a split would skip per shard, not the stream's head).
Blocks are packed by ``pack_stream``, the packer of every iterable source.
"""

from __future__ import annotations

import hashlib
import json
from itertools import islice

from torch.utils.data import IterableDataset, get_worker_info

from aah_lightning.data.packing import pack_stream
from aah_lightning.errors import ConfigError


def text_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def held_out_head(dataset, tokenizer, seq_len: int, n_val: int, n_test: int) -> tuple[list, list, frozenset]:
    """The first ``n_val`` blocks of the stream (validation), the ``n_test`` after them (test), and the keys of every
    document they were read from (training leaves those out)."""
    read = []

    def documents():
        for row in dataset:
            read.append(row["text"])
            yield tokenizer.encode_with_bytes(row["text"])

    blocks = list(islice(pack_stream(documents(), tokenizer.eos_id, seq_len), n_val + n_test))
    for i, block in enumerate(blocks[n_val:]):
        block["index"] = i
    return blocks[:n_val], blocks[n_val:], frozenset(text_key(t) for t in read)


class StreamedBlocks(IterableDataset):
    """Packed blocks from one rank's shard of a streamed dataset, without the held-out documents.

    ``endless``: pass after pass (step-based runs), else one pass per iteration (one Lightning epoch).

    Resumable: every block carries, as the JSON string ``resume``, the stream position after it: the datasets
    position before the document the next block starts in, how many of its tokens were already emitted, its
    document id, the pass and the block count. Restarting from that position re-reads that one document and
    continues token for token. The data module takes ``resume`` off each batch before the model sees it.
    """

    def __init__(self, dataset, tokenizer, seq_len: int, exclude: frozenset, endless: bool, initial: dict):
        self.dataset, self.tokenizer, self.seq_len = dataset, tokenizer, seq_len
        self.exclude, self.endless = exclude, endless
        self.initial = initial  # the datasets position before the first document of a pass
        self.start: dict | None = None  # {worker id: position} where the next iteration begins, after a restore

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        pos = (self.start or {}).get(str(worker)) or {"pass": 0, "hf": self.initial, "offset": 0, "doc": 0, "block": 0}
        epoch, doc, count, skip, hf = pos["pass"], pos["doc"], pos["block"], pos["offset"], pos["hf"]
        while True:
            self.dataset.load_state_dict(hf)
            before = {}  # document id -> the datasets position before it
            last = [hf]  # the datasets position after the last row read
            next_doc = [doc]

            def documents(before=before, last=last, next_doc=next_doc):  # this pass's records
                for row in self.dataset:
                    position, last[0] = last[0], self.dataset.state_dict()
                    text = row["text"]
                    if text and text_key(text) not in self.exclude:
                        before[next_doc[0]] = position
                        next_doc[0] += 1
                        yield self.tokenizer.encode_with_bytes(text)

            packed = pack_stream(documents(), self.tokenizer.eos_id, self.seq_len, doc, skip, positions=True)
            emitted = False
            for item, (head, offset) in packed:
                emitted = True
                for d in [d for d in before if d < head]:
                    del before[d]
                state = {
                    "worker": worker,
                    "pass": epoch,
                    "hf": before.get(head, last[0]),
                    "offset": offset,
                    "doc": head,
                    "block": count + 1,
                }
                yield {**item, "index": count, "resume": json.dumps(state)}
                count += 1
            if not emitted and skip == 0:  # a whole pass without a block: the next would not have one either
                raise ConfigError(
                    "data.source='hub': this rank's shard of the stream holds no training block once the held-out "
                    "documents are left out: use a larger dataset, a smaller data.seq_len or fewer "
                    "data.val_blocks / data.test_blocks"
                )
            # End of a pass: the partial block left over is dropped, as the packer always does.
            epoch, hf, skip, doc = epoch + 1, self.initial, 0, next_doc[0]
            if not self.endless:
                return
