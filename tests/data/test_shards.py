"""Each rank reads a disjoint shard, and together the shards cover the data: map-style corpora (EndlessSampler via the
data module) and streamed ones (split_dataset_by_node), with the validation documents never trained on."""

from __future__ import annotations

from types import SimpleNamespace

import datasets
import pytest

from aah_lightning.data import corpora
from aah_lightning.data.tokenizers import ByteTokenizer
from aah_lightning.lit.datamodule import TextDataModule


def _attach(dm, rank, world, max_steps=-1):
    """The few trainer fields the data module reads to place itself."""
    dm.trainer = SimpleNamespace(
        global_rank=rank,
        world_size=world,
        max_steps=max_steps,
        global_step=0,
        accumulate_grad_batches=1,
        current_epoch=0,
    )
    return dm


@pytest.mark.parametrize("world", [2, 3])
def test_map_style_shards_are_disjoint_and_cover_an_epoch(world):
    seen, val = [], []
    for rank in range(world):
        dm = _attach(
            TextDataModule(source="synthetic", seq_len=16, batch_size=1, synthetic={"documents": 50}), rank, world
        )
        dm.setup("fit")
        seen.append([i for batch in dm.train_dataloader() for i in batch["index"].tolist()])
        val.append([tuple(b.tolist()) for batch in dm.val_dataloader() for b in batch["tokens"]])
    n = len(dm.train_set)
    for a in range(world):
        for b in range(a + 1, world):
            assert not set(seen[a]) & set(seen[b]) and not set(val[a]) & set(val[b])
    union = {i for s in seen for i in s}
    assert union <= set(range(n)) and len(union) == n - n % world  # only the remainder that cannot be split is left out
    assert sum(len(v) for v in val) == len(dm.val_set) and all(val)  # every rank validates on something


def _fake_hub(monkeypatch, n_docs, n_shards):
    texts = [f"document {i:03d} " + "x" * (i % 23) for i in range(n_docs)]
    table = datasets.Dataset.from_dict({"text": texts})
    monkeypatch.setattr(corpora, "hub_corpus", lambda *a, **k: table.to_iterable_dataset(num_shards=n_shards))
    return texts


def _documents(blocks, eos):
    """The complete documents of a rank's block stream (the one cut off at the end of the pass is left out)."""
    tokens = [t for b in blocks for t in b["tokens"].tolist()]
    docs, current = [], []
    for t in tokens:
        if t == eos:
            docs.append(bytes(current).decode())
            current = []
        else:
            current.append(t)
    return docs


@pytest.mark.parametrize("world,n_shards", [(2, 4), (3, 6), (3, 4)])  # whole shards per rank, or every world-th doc
def test_streamed_shards_are_disjoint_cover_the_stream_and_leave_held_out_blocks_out(monkeypatch, world, n_shards):
    texts = _fake_hub(monkeypatch, 90, n_shards)
    eos = ByteTokenizer.eos_id
    shards, held_out = [], None
    for rank in range(world):
        dm = _attach(
            TextDataModule(
                source="hub", hub={"name": "local/fake"}, seq_len=16, batch_size=2, val_blocks=4, test_blocks=2
            ),
            rank,
            world,
        )
        dm.setup("fit")
        blocks = [{"tokens": b["tokens"]} for b in dm.train_set]  # one pass (epoch-based run)
        shards.append(_documents(blocks, eos))
        val_docs = set(_documents(dm.val_set + dm.test_set, eos))
        held_out = val_docs if held_out is None else held_out
        assert val_docs == held_out  # every rank holds the same validation documents
    everything = [d for s in shards for d in s]
    assert len(everything) == len(set(everything))  # disjoint
    assert not set(everything) & held_out  # validation documents are never trained on
    # Together they cover the stream: all but the validation head and at most one document cut off per rank.
    missing = set(texts) - set(everything) - held_out
    assert len(missing) <= world + 1, missing  # + the held-out document cut by the last held-out block
