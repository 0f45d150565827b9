"""LightningDataModule: corpus -> tokens -> packed ``seq_len + 1`` blocks -> train / val loaders."""

from __future__ import annotations

import zlib
from typing import Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from aah_lightning.data import corpora
from aah_lightning.data.packing import EndlessSampler, PackedBlocks, concatenate, pack_stream
from aah_lightning.data.synthetic import synthetic_documents
from aah_lightning.data.tokenizers import load_tokenizer
from aah_lightning.errors import ConfigError, require

SOURCES = ("stdlib", "files", "hub", "synthetic")


class _StreamedBlocks(IterableDataset):
    """Packed blocks from a streamed hub dataset (documents after the held-out validation prefix)."""

    def __init__(self, dataset, tokenizer, seq_len: int, skip_docs: int):
        self.dataset, self.tokenizer, self.seq_len, self.skip_docs = dataset, tokenizer, seq_len, skip_docs

    def __iter__(self):
        docs = (self.tokenizer.encode(row["text"]) for row in self.dataset.skip(self.skip_docs))
        yield from pack_stream(docs, self.tokenizer.eos_id, self.seq_len)


class TextDataModule(L.LightningDataModule):
    def __init__(
        self,
        source: str = "stdlib",
        seq_len: int = 256,
        batch_size: int = 16,
        tokenizer: str = "byte",
        paths: Optional[list[str]] = None,
        text_field: str = "text",
        hub_name: Optional[str] = None,
        hub_config: Optional[str] = None,
        hub_split: str = "train",
        val_fraction: float = 0.02,
        val_blocks: int = 64,
        max_documents: Optional[int] = None,
        synthetic_documents: int = 2000,
        synthetic_vocab: int = 64,
        synthetic_distance: Optional[int] = None,
        num_workers: int = 0,
        seed: int = 1234,
        cache_dir: Optional[str] = None,
    ):
        """
        Args:
            source: stdlib (embedded default corpus, no network), files, hub (streamed) or synthetic.
            seq_len: tokens per training sequence (blocks hold seq_len + 1).
            batch_size: sequences per batch and rank.
            tokenizer: 'byte' (default), or a Hugging Face tokenizer name, tokenizer.json path or folder.
            paths: files or glob patterns for source=files (.txt, .jsonl/.json, .parquet).
            text_field: the text column of json/parquet files and hub datasets.
            hub_name: hub dataset name for source=hub; hub_config / hub_split select it.
            val_fraction: share of the token stream held out for validation (map-style sources).
            val_blocks: number of held-out blocks for source=hub.
            max_documents: use only the first N documents (after the seeded shuffle); None = all.
            synthetic_documents: number of synthetic documents (source=synthetic).
            synthetic_vocab: symbols of the synthetic language.
            synthetic_distance: long-range copy distance; default seq_len // 2.
            num_workers: DataLoader workers.
            seed: seeds the document order, the split and the training order.
            cache_dir: Hugging Face datasets cache for source=files.
        """
        super().__init__()
        require(source in SOURCES, "data.source", source, f"one of {', '.join(SOURCES)}")
        require(isinstance(seq_len, int) and seq_len > 0, "data.seq_len", seq_len, "a positive integer")
        require(isinstance(batch_size, int) and batch_size > 0, "data.batch_size", batch_size, "a positive integer")
        require(0.0 < val_fraction < 1.0, "data.val_fraction", val_fraction, "a number in (0, 1)")
        if source == "files":
            corpora.expand_paths(paths or [])  # fail now, not after the model is built
        if source == "hub":
            require(bool(hub_name), "data.hub_name", hub_name, "a dataset name when data.source='hub'")
        self.save_hyperparameters()
        if source == "synthetic":
            self.tokenizer = None
            self._vocab, self._eos = synthetic_vocab + 1, synthetic_vocab
        else:
            self.tokenizer = load_tokenizer(tokenizer)
            self._vocab, self._eos = self.tokenizer.vocab_size, self.tokenizer.eos_id
        self.train_set = self.val_set = None

    @property
    def vocab_size(self) -> int:
        return self._vocab

    # -- building the datasets -------------------------------------------------------------------------------------
    def _documents(self) -> list[np.ndarray]:
        hp = self.hparams
        if hp.source == "synthetic":
            distance = hp.synthetic_distance or hp.seq_len // 2
            require(
                0 < distance < hp.seq_len, "data.synthetic_distance", distance, f"in [1, seq_len={hp.seq_len})"
            )
            return synthetic_documents(hp.synthetic_documents, hp.seq_len, distance, hp.synthetic_vocab, seed=hp.seed)
        ds = corpora.stdlib_corpus() if hp.source == "stdlib" else corpora.file_corpus(hp.paths, hp.text_field, hp.cache_dir)
        texts = ds["text"]
        # A seeded, content-independent document order: the split is the same on every machine and rank.
        order = sorted(range(len(texts)), key=lambda i: zlib.crc32(f"{hp.seed}:{i}".encode()))
        if hp.max_documents:
            order = order[: hp.max_documents]
        texts = [texts[i] for i in order if texts[i]]
        if hasattr(self.tokenizer, "encode_batch"):
            return self.tokenizer.encode_batch(texts)
        return [self.tokenizer.encode(t) for t in texts]

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        if hp.source == "hub":
            self._setup_stream()
            return
        docs = self._documents()
        tokens, doc_ids = concatenate(docs, self._eos)
        block = hp.seq_len + 1
        n_blocks = len(tokens) // block
        if len(tokens) == 0:
            raise ConfigError(f"data.source={hp.source!r} gave an empty corpus (no tokens): check data.paths")
        if n_blocks < 2:
            raise ConfigError(
                f"the corpus has {len(tokens)} tokens, fewer than two blocks of data.seq_len+1={block}: "
                f"use more data or a smaller data.seq_len"
            )
        n_val = min(max(1, int(round(n_blocks * hp.val_fraction))), n_blocks - 1)
        cut = (n_blocks - n_val) * block
        self.train_set = PackedBlocks(tokens[:cut], doc_ids[:cut], hp.seq_len)
        self.val_set = PackedBlocks(tokens[cut:], doc_ids[cut:], hp.seq_len)

    def _setup_stream(self) -> None:
        hp = self.hparams
        ds = corpora.hub_corpus(hp.hub_name, hp.hub_config, hp.hub_split, hp.text_field)
        if hp.text_field != "text":
            ds = ds.rename_column(hp.text_field, "text")
        val, used_docs = [], 0
        docs = (self.tokenizer.encode(row["text"]) for row in ds)
        counted = _Counting(docs)
        for item in pack_stream(counted, self._eos, hp.seq_len):
            val.append(item)
            if len(val) >= hp.val_blocks:
                break
        used_docs = counted.count
        self.val_set = val
        rank, world = self._rank_world()
        if world > 1:
            from datasets.distributed import split_dataset_by_node

            ds = split_dataset_by_node(ds.skip(used_docs), rank=rank, world_size=world)
            used_docs = 0
        self.train_set = _StreamedBlocks(ds, self.tokenizer, hp.seq_len, used_docs)

    # -- loaders ---------------------------------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        if isinstance(self.train_set, IterableDataset):
            return DataLoader(self.train_set, batch_size=hp.batch_size, num_workers=hp.num_workers)
        rank, world = self._rank_world()
        trainer = self.trainer
        per_step = hp.batch_size * (trainer.accumulate_grad_batches if trainer else 1)
        consumed = trainer.global_step * per_step if trainer else 0
        total = trainer.max_steps * per_step if trainer and trainer.max_steps > 0 else None
        if total is None:  # epoch-based training: one pass per Lightning epoch
            epoch = trainer.current_epoch if trainer else 0
            per_rank = len(self.train_set) // world
            consumed, total = epoch * per_rank, (epoch + 1) * per_rank
        # Step-based runs: the loader is as long as the whole run, whatever was already consumed. On a resume Lightning
        # restores its batch count and runs the loader from its start (which skips what was consumed), so a shorter
        # loader would end the epoch early, replay data and trip val_check_interval.
        length = total if trainer and trainer.max_steps > 0 else total - consumed
        sampler = EndlessSampler(
            len(self.train_set), hp.seed, length=max(0, length), rank=rank, world_size=world, start=consumed
        )
        return DataLoader(
            self.train_set,
            batch_size=hp.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=hp.num_workers,
            persistent_workers=hp.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        hp = self.hparams
        data = self.val_set
        rank, world = self._rank_world()
        if world > 1 and not isinstance(data, list):  # each rank validates its own contiguous-stride shard
            data = torch.utils.data.Subset(data, list(range(rank, len(data), world)))
        elif world > 1:
            data = data[rank::world]
        return DataLoader(data, batch_size=hp.batch_size, shuffle=False, num_workers=hp.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class _Counting:
    """Wraps an iterator and counts the items taken from it."""

    def __init__(self, it):
        self.it, self.count = it, 0

    def __iter__(self):
        for x in self.it:
            self.count += 1
            yield x
