import json

import numpy as np
import pytest
import torch

from aah_lightning.data.corpora import stdlib_files
from aah_lightning.data.packing import EndlessSampler, TokenBlocks, pack_stream
from aah_lightning.data.synthetic import synthetic_documents
from aah_lightning.data.token_folder import TokenStream
from aah_lightning.data.tokenizers import ByteTokenizer, HFTokenizer
from aah_lightning.lit.datamodule import TextDataModule


def test_packing_separates_documents_with_eos_and_keeps_ids():
    stream = TokenStream.from_documents([np.array([1, 2, 3]), np.array([4, 5])], eos_id=9)
    assert stream.tokens.tolist() == [1, 2, 3, 9, 4, 5, 9]
    assert stream.doc_ids(0, 7).tolist() == [0, 0, 0, 0, 1, 1, 1]
    blocks = TokenBlocks(stream, seq_len=2, first=0, count=len(stream) // 3)  # blocks of 3, remainder dropped
    assert len(blocks) == 2
    assert blocks[1]["tokens"].tolist() == [9, 4, 5] and blocks[1]["doc_ids"].tolist() == [0, 1, 1]
    assert blocks[1]["index"] == 1 and "bytes" not in blocks[1]  # no text behind these tokens


def test_stream_packer_positions_restart_token_for_token():
    docs = [(np.arange(n) + 10 * i, np.ones(n, np.int64)) for i, n in enumerate([5, 1, 9, 3, 7, 2, 6])]
    whole = list(pack_stream(docs, eos_id=99, seq_len=3, positions=True))
    flat = [t for d, _ in docs for t in [*d.tolist(), 99]]
    assert [t for b, _ in whole for t in b["tokens"].tolist()] == flat[: len(whole) * 4]
    for k in range(len(whole) - 1):  # restart after block k from the position it reports
        doc, offset = whole[k][1]
        rest = list(pack_stream(docs[doc:], 99, 3, first_doc=doc, skip=offset))
        assert [b["tokens"].tolist() for b in rest] == [b["tokens"].tolist() for b, _ in whole[k + 1 :]]
        assert [b["doc_ids"].tolist() for b in rest] == [b["doc_ids"].tolist() for b, _ in whole[k + 1 :]]
    # bytes: the predicted tokens' text, end-of-document tokens encode none
    assert [b["bytes"] for b, _ in whole] == [sum(t != 99 for t in b["tokens"][1:].tolist()) for b, _ in whole]


def test_sampler_shards_are_disjoint_cover_the_data_and_resume_exactly():
    n, world = 103, 2
    shards = [list(EndlessSampler(n, seed=3, length=n // world, rank=r, world_size=world)) for r in range(world)]
    assert not set(shards[0]) & set(shards[1])
    assert len(set(shards[0]) | set(shards[1])) == n - n % world
    whole = list(EndlessSampler(n, seed=3, length=250, rank=1, world_size=world))  # crosses several epochs
    resumed = list(EndlessSampler(n, seed=3, length=250 - 77, rank=1, world_size=world, start=77 * world))
    assert whole[77:] == resumed


def _global_order(n, seed, epochs):
    return [i for e in range(epochs) for i in torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))]


def test_one_process_keeps_the_order_of_seeded_epoch_permutations():
    # The order every checkpoint written on one process was trained with: epoch e is randperm(n) from seed + e.
    assert list(EndlessSampler(37, seed=5, length=100)) == [int(i) for i in _global_order(37, 5, 3)[:100]]


def _steps(n, world, batch, acc, first_step, steps, seed=3):
    """The blocks of each optimizer step on ``world`` ranks as the data module reads them (rank r's sampler from
    global position first_step x global batch), keyed by the global position each rank and micro-batch stands for:
    item k of micro-batch m of rank r in step s is position s G + m B W + k W + r."""
    total = batch * world * acc
    per_rank = [
        list(EndlessSampler(n, seed, length=steps * batch * acc, rank=r, world_size=world, start=first_step * total))
        for r in range(world)
    ]
    out = []
    for s in range(steps):
        step = {}
        for r in range(world):
            for m in range(acc):
                for k in range(batch):
                    position = (first_step + s) * total + m * batch * world + k * world + r
                    step[position] = per_rank[r][(s * acc + m) * batch + k]
        out.append(step)
    return out


def test_the_global_order_continues_on_another_world_size_over_an_epoch_boundary():
    # 2 ranks, then 1, then 2 again, the global batch (8) kept: every optimizer step holds the same blocks as an
    # uninterrupted 2-rank run. n = 30 is no multiple of 8, so epochs end inside steps 3 and 7.
    n = 30
    whole = _steps(n, world=2, batch=2, acc=2, first_step=0, steps=10)
    parts = (
        _steps(n, world=2, batch=2, acc=2, first_step=0, steps=3)
        + _steps(n, world=1, batch=4, acc=2, first_step=3, steps=3)
        + _steps(n, world=2, batch=4, acc=1, first_step=6, steps=4)
    )
    order = [int(i) for i in _global_order(n, 3, 3)]
    for s in range(10):  # step s: global positions [8s, 8s + 8), whichever rank holds them
        assert sorted(parts[s]) == list(range(8 * s, 8 * s + 8))
        assert sorted(parts[s].values()) == sorted(whole[s].values()), s
    trained = [b for step in parts for _, b in sorted(step.items())]
    assert trained == order[:80]  # the global order, position for position
    for e in range(2):  # epochs 0 and 1: every block exactly once
        assert sorted(trained[e * n : (e + 1) * n]) == list(range(n))


def test_epoch_based_sampler_moves_to_each_epoch_and_keeps_a_resumed_position():
    n, per_epoch = 30, 24  # whole global batches of 8 per epoch
    sampler = EndlessSampler(n, 3, length=per_epoch, start=0, per_epoch=per_epoch, epochs=True)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    order = [int(i) for i in _global_order(n, 3, 2)]
    assert first == order[:24] and second == order[30:54]  # epoch 1 is the next permutation, not epoch 0 again
    resumed = EndlessSampler(n, 3, length=per_epoch, start=per_epoch + 8, per_epoch=per_epoch, epochs=True)
    resumed.set_epoch(1)  # Lightning's call at the start of the resumed epoch keeps the position inside it
    assert list(resumed)[:16] == second[8:]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids.max() < 256 and tok.decode(ids) == "héllo"


def test_stdlib_corpus_has_sources_but_no_test_suites():
    files = stdlib_files()
    assert len(files) > 200
    assert all(f.endswith(".py") for f in files)
    assert not any("/test/" in f or "/tests/" in f or "/idle_test/" in f for f in files)
    assert any(f.endswith("/json/decoder.py") for f in files)


def test_synthetic_documents_have_the_long_range_copy():
    docs = synthetic_documents(5, length=40, distance=16, vocab=8, seed=1)
    for d in docs:
        assert len(d) == 40 and d.max() < 8
        assert np.array_equal(d[16:], d[:24])
    again = synthetic_documents(5, length=40, distance=16, vocab=8, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(docs, again))


def make_dm(**kw):
    dm = TextDataModule(**kw)
    dm.setup("fit")
    return dm


def _docs_of(blocks) -> set:
    return {d for i in range(len(blocks)) for d in blocks[i]["doc_ids"].tolist()}


def test_split_is_deterministic_and_disjoint():
    a = make_dm(source="synthetic", seq_len=32, synthetic={"documents": 200}, val_fraction=0.1, test_fraction=0.05)
    b = make_dm(source="synthetic", seq_len=32, synthetic={"documents": 200}, val_fraction=0.1, test_fraction=0.05)
    for part in ("train_set", "test_set", "val_set"):
        assert np.array_equal(getattr(a, part).as_array(), getattr(b, part).as_array())
    total = len(a.train_set) + len(a.test_set) + len(a.val_set)
    assert len(a.val_set) == round(0.1 * total) and len(a.test_set) == round(0.05 * total)
    # [train | test | validation]: validation is the tail of the stream, test the blocks before it
    assert a.val_set.first == total - len(a.val_set) and a.test_set.first == len(a.train_set)
    train, test, val = _docs_of(a.train_set), _docs_of(a.test_set), _docs_of(a.val_set)
    assert len(train & test) <= 1 and len(test & val) <= 1 and not train & val  # only documents cut by a boundary


def test_stdlib_data_module_blocks():
    dm = make_dm(source="stdlib", seq_len=128, max_documents=40)
    item = dm.train_set[0]
    assert item["tokens"].shape == (129,) and item["tokens"].max() <= 256
    assert dm.vocab_size == 257


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_local_files_through_datasets(tmp_path, kind):
    texts = [f"document number {i} " * 20 for i in range(12)]
    if kind == "txt":
        for i, t in enumerate(texts):
            (tmp_path / f"d{i}.txt").write_text(t)
        paths = [str(tmp_path / "*.txt")]
    elif kind == "jsonl":
        (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in texts))
        paths = [str(tmp_path / "d.jsonl")]
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": texts}), tmp_path / "d.parquet")
        paths = [str(tmp_path / "d.parquet")]
    field = "text" if kind == "txt" else "body"
    dm = make_dm(
        source="files",
        files={"paths": paths, "text_field": field},
        seq_len=64,
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.1,
        test_fraction=0.1,
    )
    n_tokens = sum(len(t.encode()) + 1 for t in texts)
    assert len(dm.train_set) + len(dm.test_set) + len(dm.val_set) == n_tokens // 65
    decoded = ByteTokenizer().decode(dm.train_set[0]["tokens"].tolist())
    assert "document number" in decoded


def test_hf_tokenizer_from_a_local_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["def f(x): return x + 1"] * 50, trainers.BpeTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(str(tmp_path))
    assert hf.eos_id == tok.token_to_id("</s>")
    dm = make_dm(source="stdlib", tokenizer=str(tmp_path / "tokenizer.json"), seq_len=32, max_documents=5)
    assert dm.vocab_size == tok.get_vocab_size()
    assert int(dm.train_set.as_array().max()) < dm.vocab_size
