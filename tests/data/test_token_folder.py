"""Token folders: the corpus tokenized once, memory-mapped, equal to reading it into memory; the cache; the test split;
bits per byte against a hand count; and every bad input refused in one line with nothing half-written."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from aah_lightning.data import corpora, prepare
from aah_lightning.data.packing import EndlessSampler, TokenBlocks
from aah_lightning.data.token_folder import FolderWriter, open_folder, token_dtype, verify
from aah_lightning.data.tokenizers import ByteTokenizer, HFTokenizer
from aah_lightning.errors import ConfigError
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.evaluation import BitsPerByte
from helpers.cli import REPO, subprocess_env
from helpers.token_folders import TEXTS, small_folder, texts_file


def _in_memory(texts, tokenizer, seed, max_documents=None):
    """How the corpus was read before token folders: seeded order, empty texts dropped, one array in memory."""
    order = prepare.document_order(len(texts), seed, max_documents)
    docs = [tokenizer.encode(texts[i]) for i in order if texts[i]]
    tokens = np.concatenate([np.append(d, tokenizer.eos_id) for d in docs])
    doc_ids = np.concatenate([np.full(len(d) + 1, i) for i, d in enumerate(docs)])
    return tokens, doc_ids


def _bpe(tmp_path, vocab=None) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(special_tokens=["[UNK]", "</s>"], **({"vocab_size": vocab} if vocab else {}))
    tok.train_from_iterator(["def f(x): return x + 1 # héllo wörld €"] * 50, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path / "tokenizer.json")


def test_round_trip_stdlib_equals_reading_into_memory():
    dm = TextDataModule(source="stdlib", seq_len=64, max_documents=30)
    dm.setup("fit")
    texts = corpora.stdlib_corpus()["text"]
    tokens, doc_ids = _in_memory(texts, ByteTokenizer(), 1234, 30)
    stream = dm.train_set.stream
    assert isinstance(stream.tokens, np.memmap) and stream.tokens.dtype == np.uint16
    assert np.array_equal(stream.tokens, tokens) and np.array_equal(stream.doc_ids(0, len(tokens)), doc_ids)
    n = len(tokens) // 65  # every block, in order: [train | test | validation]
    blocks = [dm.train_set[i] for i in range(len(dm.train_set))] + [dm.test_set[i] for i in range(len(dm.test_set))]
    blocks += [dm.val_set[i] for i in range(len(dm.val_set))]
    assert len(blocks) == n
    assert torch.equal(torch.stack([b["tokens"] for b in blocks]), torch.from_numpy(tokens[: n * 65].reshape(n, 65)))
    assert torch.equal(torch.stack([b["doc_ids"] for b in blocks]), torch.from_numpy(doc_ids[: n * 65].reshape(n, 65)))


def test_round_trip_hf_tokenizer_with_byte_counts(tmp_path):
    tok = _bpe(tmp_path)
    dm = TextDataModule(
        source="files",
        files={"paths": [texts_file(tmp_path, TEXTS)]},
        tokenizer=tok,
        seq_len=16,
        cache_dir=str(tmp_path / "cache"),
        seed=7,
    )
    dm.setup("fit")
    hf = HFTokenizer(tok)
    tokens, doc_ids = _in_memory(TEXTS, hf, 7)
    stream = dm.train_set.stream
    assert np.array_equal(stream.tokens, tokens) and np.array_equal(stream.doc_ids(0, len(tokens)), doc_ids)
    # The byte counts of each document's tokens add up to its UTF-8 size (the end-of-document token counts 0).
    kept = [TEXTS[i] for i in prepare.document_order(len(TEXTS), 7) if TEXTS[i]]
    starts = np.asarray(stream.starts)
    for d, text in enumerate(kept):
        assert stream.text_bytes(starts[d], starts[d + 1]) == len(text.encode())
    assert int(stream.byte_lengths[starts[1] - 1]) == 0


def test_memmap_reads_without_loading(tmp_path):
    n = 48 << 20  # 96 MB of uint16 tokens
    writer = FolderWriter(str(tmp_path / "big"), 257, 256, with_bytes=False)
    for _ in range(8):
        writer.add(np.full(n // 8 - 1, 7, np.uint16), np.array([n // 8 - 1]))
    writer.finish({"tokenizer": {"name": "byte", "fingerprint": "byte"}})

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    dm = TextDataModule(source="tokens", tokens={"path": str(tmp_path / "big")}, seq_len=255, batch_size=4)
    dm.setup("fit")
    assert isinstance(dm.train_set.stream.tokens, np.memmap) and len(dm.train_set) > 180_000
    items = [dm.train_set[i] for i in range(0, len(dm.train_set), len(dm.train_set) // 100)]  # all over the file
    assert all(item["tokens"].shape == (256,) and item["bytes"] == 255 for item in items)
    assert rss() - before < 16 << 20  # a fraction of the 96 MB file: setting up and reading load nothing whole
    batch = next(iter(dm.train_dataloader()))
    assert batch["tokens"].shape == (4, 256) and batch["bytes"].tolist() == [255] * 4


def test_token_type_follows_the_vocabulary(tmp_path):
    assert token_dtype(257) == token_dtype(1 << 16) == np.uint16 and token_dtype((1 << 16) + 1) == np.uint32
    writer = FolderWriter(str(tmp_path / "wide"), 100_000, 99_999, with_bytes=True)
    writer.add(np.array([70_000, 5, 65_536]), np.array([2, 1]), np.array([3, 1, 2]))
    writer.finish({"tokenizer": {"name": "wide", "fingerprint": "x"}})
    stream, meta = open_folder(str(tmp_path / "wide"))
    assert stream.tokens.dtype == np.uint32 and meta["files"]["tokens.bin"]["size"] == 5 * 4
    assert stream.tokens.tolist() == [70_000, 5, 99_999, 65_536, 99_999]
    assert stream.doc_ids(0, 5).tolist() == [0, 0, 0, 1, 1]
    assert stream.text_bytes(0, 5) == 6 and meta["text_bytes"] == 6


def test_second_setup_uses_the_cache_without_tokenizing(tmp_path, monkeypatch):
    paths = [texts_file(tmp_path, TEXTS)]
    first = TextDataModule(source="files", files={"paths": paths}, seq_len=16, cache_dir=str(tmp_path / "cache"))
    first.setup("fit")

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(prepare, "prepare", no_tokenizing)
    monkeypatch.setattr(corpora, "file_corpus", no_tokenizing)
    again = TextDataModule(source="files", files={"paths": paths}, seq_len=16, cache_dir=str(tmp_path / "cache"))
    again.setup("fit")
    assert np.array_equal(again.train_set.as_array(), first.train_set.as_array())
    # Another tokenizer or order is another folder.
    monkeypatch.undo()
    other = TextDataModule(
        source="files", files={"paths": paths}, seq_len=16, cache_dir=str(tmp_path / "cache"), seed=5
    )
    other.setup("fit")
    assert len(os.listdir(tmp_path / "cache" / "tokens")) == 2


def test_test_blocks_are_held_out_and_aah_test_evaluates_them(tmp_path):
    import lightning as L

    from aah_lightning.lit.module import AAHModule
    from aah_lightning.model.config import GPTConfig

    dm = TextDataModule(
        source="files",
        files={"paths": [texts_file(tmp_path, TEXTS)]},
        seq_len=16,
        batch_size=4,
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.1,
        test_fraction=0.1,
    )
    dm.setup("test")
    test = torch.cat([b["tokens"] for b in dm.test_dataloader()])
    n_train, n_test = len(dm.train_set), len(dm.test_set)
    assert n_test > 0 and dm.test_set.first == n_train and dm.val_set.first == n_train + n_test  # disjoint slices
    stream = dm.train_set.stream.tokens[: (n_train + n_test) * 17].reshape(-1, 17)
    assert torch.equal(test, torch.from_numpy(stream[n_train:].astype(np.int64)))  # exactly the test blocks
    model = AAHModule(
        gpt=GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=16, vocab_size=dm.vocab_size, backend="sdpa")
    )
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    [result] = trainer.test(model, datamodule=dm)
    # bits per byte of exactly the test blocks: their tokens' summed loss over their bytes
    with torch.no_grad():
        blocks = torch.stack([dm.test_set[i]["tokens"] for i in range(len(dm.test_set))])
        logits = model(blocks[:, :-1])
        nats = torch.nn.functional.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten(), reduction="sum")
    n_bytes = int((blocks[:, 1:] != 256).sum())
    assert result["test/loss"] == pytest.approx(float(nats) / blocks[:, 1:].numel(), rel=1e-5)
    assert result["test/bpb"] == pytest.approx(float(nats) / (math.log(2) * n_bytes), rel=1e-5)


def test_bits_per_byte_against_a_hand_count(tmp_path):
    # Documents "abc" and "é"; seed 0 orders them "é" first. Bytes: 195 169 EOD 97 98 99 EOD. Blocks of 3:
    # [195 169 EOD] predicts 169 and EOD: 1 byte of text (EOD encodes none); [97 98 99] predicts 98 99: 2 bytes.
    path = tmp_path / "two.jsonl"
    path.write_text('{"text": "abc"}\n{"text": "\\u00e9"}\n')
    assert prepare.document_order(2, 0) == [1, 0]
    ds = corpora.file_corpus([str(path)], cache_dir=str(tmp_path / "hf"))
    stream, _ = open_folder(prepare.prepare(ds, ByteTokenizer(), str(tmp_path / "tf"), {"key": "k"}, seed=0))
    assert stream.tokens.tolist() == [195, 169, 256, 97, 98, 99, 256]
    blocks = TokenBlocks(stream, seq_len=2, first=0, count=2)
    assert [blocks[0]["bytes"], blocks[1]["bytes"]] == [1, 2]
    bpb = BitsPerByte()
    bpb.update(torch.tensor(1.5), 2, torch.tensor([1]))
    bpb.update(torch.tensor(0.5), 2, torch.tensor([2]))
    assert float(bpb.compute()) == pytest.approx((1.5 * 2 + 0.5 * 2) / (math.log(2) * 3))


# -- bad input ---------------------------------------------------------------------------------------------------------
def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_output_that_is_not_a_token_folder_is_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError) as e:
        prepare.prepared_folder(str(tmp_path / "mine"), prepare.describe_source("stdlib"), ByteTokenizer(), 0)
    assert "exists and is not a token folder" in _one_line(e)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_folder_of_another_tokenizer_is_refused(tmp_path):
    folder = small_folder(tmp_path)
    with pytest.raises(ConfigError) as e:
        TextDataModule(source="tokens", tokens={"path": folder}, tokenizer=_bpe(tmp_path))
    line = _one_line(e)
    assert "tokenizer 'byte'" in line and "data.tokenizer=" in line and "vocabulary 257" in line


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "no_meta"])
def test_damaged_folder_is_refused(tmp_path, damage):
    folder = small_folder(tmp_path)
    tokens = os.path.join(folder, "tokens.bin")
    if damage == "truncated":
        os.truncate(tokens, os.path.getsize(tokens) - 2)
    elif damage == "corrupt":
        with open(tokens, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.remove(os.path.join(folder, "meta.json"))
    with pytest.raises(ConfigError) as e:
        TextDataModule(source="tokens", tokens={"path": folder}, seq_len=16).setup("fit")
    line = _one_line(e)
    expected = {"truncated": "truncated", "corrupt": "corrupt", "no_meta": "is not a token folder"}[damage]
    assert expected in line and "data.tokens.path" in line


def test_checksums_of_a_large_file_are_sampled_and_full_on_request(tmp_path, monkeypatch):
    from aah_lightning.data import token_folder

    monkeypatch.setattr(token_folder, "CHUNK", 64)
    folder = small_folder(tmp_path)
    crcs = json.load(open(os.path.join(folder, "meta.json")))["files"]["tokens.bin"]["crc32"]
    assert len(crcs) > 3 * token_folder.SAMPLED_CHUNKS
    picked = [round(i * (len(crcs) - 1) / (token_folder.SAMPLED_CHUNKS - 1)) for i in range(8)]
    unchecked = next(i for i in range(len(crcs)) if i not in picked)
    with open(os.path.join(folder, "tokens.bin"), "r+b") as f:
        f.seek(unchecked * 64)
        f.write(b"\xff\xff")
    verify(folder)  # the sampled check does not read that chunk
    with pytest.raises(ConfigError, match="corrupt"):
        verify(folder, full=True)


def test_too_few_tokens_for_two_blocks(tmp_path):
    folder = small_folder(tmp_path, texts=["tiny"])
    with pytest.raises(ConfigError) as e:
        TextDataModule(source="tokens", tokens={"path": folder}, seq_len=64).setup("fit")
    assert "too few" in _one_line(e) and "data.seq_len" in _one_line(e)


def test_killed_prepare_leaves_nothing_that_is_read_and_is_redone(tmp_path):
    jsonl = texts_file(tmp_path, TEXTS)
    out = tmp_path / "tf"
    script = f"""
import os, signal
from aah_lightning.data import corpora, prepare, token_folder
from aah_lightning.data.tokenizers import ByteTokenizer
def killed(self, meta):
    os.kill(os.getpid(), signal.SIGKILL)  # everything written, not yet renamed into place
token_folder.FolderWriter.finish = killed
ds = corpora.file_corpus([{jsonl!r}], cache_dir={str(tmp_path / "hf")!r})
prepare.prepare(ds, ByteTokenizer(), {str(out)!r}, {{"key": "k"}}, seed=0, progress=False)
"""
    proc = subprocess.run([sys.executable, "-c", script], env=subprocess_env(), cwd=REPO, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists() and [p for p in os.listdir(tmp_path) if p.startswith("tf.partial-")]
    with pytest.raises(ConfigError, match="does not exist"):
        TextDataModule(source="tokens", tokens={"path": str(out)})
    folder = small_folder(tmp_path)  # the next prepare redoes it and clears the dead writer's leftovers
    assert open_folder(folder)[1]["documents"] == len([t for t in TEXTS if t])
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tf.partial-")]


def test_cli_refuses_a_path_that_is_not_a_token_folder(tmp_path, capsys):
    from aah_lightning.cli import main

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        main(
            [
                "fit",
                "--data.source=tokens",
                f"--data.tokens.path={tmp_path / 'empty'}",
                "--trainer.accelerator=cpu",
                "--trainer.logger=false",
                f"--checkpoint.dirpath={tmp_path}/ckpt",
            ]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("aah: error: data.tokens.path=") and "is not a token folder" in err[-1]


# -- sharding and resume on a token folder -----------------------------------------------------------------------------
def test_ranks_read_disjoint_shards_of_a_token_folder(tmp_path):
    from types import SimpleNamespace

    folder = small_folder(tmp_path, texts=TEXTS * 3)
    seen = []
    for rank in range(2):
        dm = TextDataModule(source="tokens", tokens={"path": folder}, seq_len=16, batch_size=2)
        dm.trainer = SimpleNamespace(
            global_rank=rank, world_size=2, max_steps=-1, global_step=0, accumulate_grad_batches=1, current_epoch=0
        )
        dm.setup("fit")
        seen.append([i for b in dm.train_dataloader() for i in b["index"].tolist()])
    assert not set(seen[0]) & set(seen[1])
    n = len(dm.train_set)
    assert len(set(seen[0]) | set(seen[1])) >= n - 1 - 2 * 2  # all but the odd block and the partial batches
    order = EndlessSampler(n, 1234, length=len(seen[1])).permutation(0)
    assert seen[1] == order[1 : 2 * len(seen[1]) : 2].tolist()  # the seeded permutation, strided by rank


def test_resume_from_a_token_folder_is_exact(tmp_path, tiny_args):
    from aah_lightning.cli import main
    from helpers.resume import check_resumed, interrupted_then_resumed, run_args

    folder = small_folder(tmp_path, texts=TEXTS * 4)
    extra = ["--data.source=tokens", f"--data.tokens.path={folder}", "--data.seq_len=32"]
    main(run_args(tiny_args, tmp_path / "whole", *extra))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        interrupted_then_resumed(tiny_args, tmp_path / "parts", *extra)
    check_resumed(tmp_path)
    # The loaders are positioned by the data module, so Lightning has no reason to call the resume inexact.
    assert not [w for w in caught if "ended before the epoch ended" in str(w.message)]


def test_prepare_command_is_idempotent_and_refuses_in_one_line(tmp_path, capsys):
    jsonl = texts_file(tmp_path, TEXTS)
    args = ["--source", "files", "--paths", jsonl, "--cache_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "tf")]
    prepare.main(args)
    first = capsys.readouterr().out
    assert "tokenized in" in first and "--data.source=tokens" in first
    written = os.path.getmtime(tmp_path / "tf" / "tokens.bin")
    prepare.main(args)
    assert "already prepared" in capsys.readouterr().out
    assert os.path.getmtime(tmp_path / "tf" / "tokens.bin") == written  # not written again
    prepare.main(["--verify", str(tmp_path / "tf")])
    assert "intact" in capsys.readouterr().out
    for bad in (args + ["--seed", "9"], ["--source", "files", "--paths", jsonl, "--out", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            prepare.main(bad)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("aah-prepare: error: --out=")


def test_a_hub_dataset_is_prepared_like_local_files(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(corpora, "hub_dataset", lambda *a, **k: datasets.Dataset.from_dict({"text": TEXTS}))
    prepare.main(["--source", "hub", "--hub_name", "local/fake", "--out", str(tmp_path / "hub"), "--seed", "3"])
    stream, meta = open_folder(str(tmp_path / "hub"))
    tokens, _ = _in_memory(TEXTS, ByteTokenizer(), 3)
    assert np.array_equal(stream.tokens, tokens) and meta["source"]["name"] == "local/fake"
