"""LightningDataModule: a data source -> ``seq_len + 1`` blocks -> train / val / test loaders.

The ``data.*`` settings become one ``DataConfig`` (``data/config.py``) when the module is built; the source, the
training position and the checkpoint's hyperparameters all read it. ``data.source`` picks a source of
``data/sources/`` (one module each, registered by name, with the contract in ``data/sources/base.py``): it gives the
three splits, and the module names none of them. Map-style corpora are token folders (``data/token_folder.py``), read
by memory-mapping: ``stdlib`` and ``files`` are tokenized once into a folder under the cache folder
(``data/prepare.py``), ``tokens`` names a prepared one. Blocks are slices of the stream; the held-out blocks are its
tail (validation last, test before it). Streamed corpora (``hub``) go through ``data/streaming.py``.

``recall`` generates the associative-recall task (``data/recall.py``) block by block; with ``data.recall.fraction`` a
share of a text corpus's blocks are recall blocks instead (``get_source`` then returns the recall mix,
``data/sources/recall.py``). Recall blocks carry a ``loss_mask`` (training and the loss count only the predictable
targets) and ``recall_distance`` (the module's recall accuracy).

Every rank reads its own disjoint shard: map-style corpora through ``EndlessSampler`` (rank-strided seeded
permutations), streamed ones through ``split_dataset_by_node``; ``streamed`` (``is_stream``) tells them apart. The
training position (``lit/data_position.py``) is part of every checkpoint (``state_dict``), so a resumed run continues
with exactly the batches the interrupted one would have seen next.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader

from aah_lightning.data.config import (
    DataConfig,
    FilesConfig,
    HubConfig,
    RecallConfig,
    SyntheticConfig,
    TokensConfig,
    with_flat_settings,
)
from aah_lightning.data.prompts import prompt_loader
from aah_lightning.data.sources import get_source, is_stream
from aah_lightning.data.tokenizers import load_tokenizer
from aah_lightning.errors import ConfigError
from aah_lightning.lit.data_position import DataPosition


class PositionedLoader(DataLoader):
    """A DataLoader the data module positions itself (``DataPosition``: the sampler's start and the stream positions in
    its ``state_dict``). Having a state of its own (nothing to add) tells Lightning a mid-epoch resume is exact."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class TextDataModule(L.LightningDataModule):
    def __init__(
        self,
        source: str = "stdlib",
        seq_len: int = 256,
        batch_size: int = 16,
        global_batch_size: Optional[int] = None,
        tokenizer: str = "byte",
        val_fraction: float = 0.02,
        test_fraction: float = 0.01,
        val_blocks: int = 64,
        test_blocks: int = 64,
        max_documents: Optional[int] = None,
        num_workers: int = 0,
        num_proc: Optional[int] = None,
        seed: int = 1234,
        cache_dir: Optional[str] = None,
        prompts: Optional[str] = None,
        files: Optional[FilesConfig] = None,
        tokens: Optional[TokensConfig] = None,
        hub: Optional[HubConfig] = None,
        synthetic: Optional[SyntheticConfig] = None,
        recall: Optional[RecallConfig] = None,
        plugin: Optional[dict[str, Any]] = None,
        **deprecated,
    ):
        """
        Args:
            source: a registered data source: stdlib (embedded default corpus, no network), files, tokens (a
                prepared token folder), hub (streamed), synthetic (copies at one distance), recall (multi-query
                associative recall), or module:name of a source registered in an importable module
                (docs/architecture.md, "Adding a data source"; its settings in ``plugin``).
            seq_len: tokens per training sequence (blocks hold seq_len + 1).
            batch_size: sequences per batch and rank.
            global_batch_size: sequences per optimizer step over all ranks; trainer.accumulate_grad_batches then
                follows as global_batch_size / (batch_size x world size), which must be a whole number. None: set
                trainer.accumulate_grad_batches yourself. Keeps the optimization the same on another number of GPUs.
            tokenizer: 'byte' (default), or a Hugging Face tokenizer name, tokenizer.json path or folder. For
                source=tokens, the tokenizer the folder was prepared with.
            val_fraction: share of the blocks held out for validation: the tail of the seeded stream (map-style).
            test_fraction: share of the blocks held out for ``aah test``: the blocks just before validation.
            val_blocks: number of held-out validation blocks for source=hub (the head of the stream) and recall.
            test_blocks: number of held-out test blocks for source=hub (after the validation blocks) and recall.
            max_documents: use only the first N documents (after the seeded shuffle); None = all.
            num_workers: DataLoader workers.
            num_proc: tokenizer processes when a token folder is prepared; default 1 for corpora under 64 MB of
                text, else up to 4.
            seed: seeds the document order, the split and the training order (for source=tokens the folder's
                document order was fixed when it was prepared; the seed orders training).
            cache_dir: where token folders of stdlib/files are kept (under tokens/); default $AAH_CACHE_DIR or
                ~/.cache/aah. Also the Hugging Face datasets cache for source=files, when given.
            prompts: aah predict's prompts: a text file (one prompt per line) or JSONL with a 'prompt' field.
            files: settings of source=files: paths (files or glob patterns: .txt, .jsonl/.json, .parquet) and
                text_field (the text column of json/parquet files).
            tokens: settings of source=tokens: path (the token folder, written by aah-prepare).
            hub: settings of source=hub: name, config (subset), split and text_field of the hub dataset.
            synthetic: settings of source=synthetic: documents, vocab (symbols) and distance (default seq_len // 2).
            recall: settings of the recall task (source=recall, or mixed into a text source with fraction > 0):
                keys, values, gaps, blocks, fraction, task (mqar or copy) and copy_distance (data/config.py).
            plugin: settings of a source registered outside the package, a mapping it reads and checks itself.
            deprecated: the flat keys of earlier versions (data.paths, data.recall_keys, ...): each still works, with
                one deprecation line naming the key that replaces it (data/config.py, ``with_flat_settings``).
        """
        super().__init__()
        # The one DataConfig: the source, the data position and the checkpoint all read it.
        shared = DataConfig(
            source=source,
            seq_len=seq_len,
            batch_size=batch_size,
            global_batch_size=global_batch_size,
            tokenizer=tokenizer,
            val_fraction=val_fraction,
            test_fraction=test_fraction,
            val_blocks=val_blocks,
            test_blocks=test_blocks,
            max_documents=max_documents,
            num_workers=num_workers,
            num_proc=num_proc,
            seed=seed,
            cache_dir=cache_dir,
            prompts=prompts,
            files=files,
            tokens=tokens,
            hub=hub,
            synthetic=synthetic,
            recall=recall,
            plugin=plugin,
        )
        self.config = config = with_flat_settings(shared, **deprecated)
        config.validate()
        # The named source, or the recall mix over it (data.recall.fraction): the module handles every one alike.
        self.source = get_source(config.source, config.recall.fraction)(config)
        # Plain dicts, nested per source (checkpoints load with torch.load(weights_only=True)).
        self.save_hyperparameters(config.settings())
        self.prepare_data_per_node = True  # token folders live in each node's cache folder
        self.source.check()
        self.tokenizer = load_tokenizer(config.tokenizer) if self.source.has_tokens else None
        self._vocab, self._eos = self.source.vocabulary(self.tokenizer)
        if self.tokenizer is not None:
            self.source.check_tokenizer(self.tokenizer)
        self.train_set = self.val_set = self.test_set = None
        self.position = DataPosition.from_config(config, self.streamed)

    @property
    def streamed(self) -> bool:
        """Whether the training split is a stream that positions itself (``is_stream``: the source says so)."""
        return is_stream(self.source)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    # -- building the datasets (data/sources/) ---------------------------------------------------------------------
    def prepare_data(self) -> None:
        """The source's once-per-node work, e.g. tokenizing stdlib / files into the cache (Lightning calls this on
        one process per node)."""
        self.source.prepare(self.tokenizer)

    def setup(self, stage: str | None = None) -> None:
        if stage == "fit" and self.trainer is not None:
            self.resolve_accumulation(self.trainer)
        if self.train_set is not None or stage == "predict":  # predict reads only the prompts
            return
        rank, world = self._rank_world()
        endless = self.trainer is None or self.trainer.max_steps > 0
        splits = self.source.splits(self.tokenizer, rank, world, endless)
        self.train_set, self.val_set, self.test_set = splits.train, splits.val, splits.test
        if self.streamed and self.position.restored is not None:
            self._apply_restored_stream(rank, world)

    # -- the training position (lit/data_position.py) ---------------------------------------------------------------
    def resolve_accumulation(self, trainer) -> None:
        """With ``data.global_batch_size``: set ``trainer.accumulate_grad_batches`` (``DataPosition``)."""
        self.position.resolve_accumulation(trainer)

    def _train_blocks(self) -> int | None:
        """The permuted training blocks of a map-style corpus (None: a stream, or not set up)."""
        if self.train_set is None or self.streamed:
            return None
        return len(self.train_set)

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def steps_per_epoch(self) -> int:
        """Optimizer steps of one training epoch of an epoch-based run (``DataPosition.steps_per_epoch``)."""
        return self.position.steps_per_epoch(self.trainer, len(self.train_set), self._layout())

    def planned_steps(self) -> int | None:
        """The run's optimizer steps for the learning-rate schedule (``DataPosition.planned_steps``)."""
        return self.position.planned_steps(self.trainer, self._train_blocks(), self._layout())

    def train_dataloader(self) -> DataLoader:
        hp = self.config
        self.position.restate_batch_count(self.trainer)
        if self.streamed:  # the stream orders and shards itself: no sampler
            return PositionedLoader(self.train_set, batch_size=hp.batch_size, num_workers=hp.num_workers)
        return PositionedLoader(
            self.train_set,
            batch_size=hp.batch_size,
            sampler=self.position.sampler(self.trainer, len(self.train_set), self._layout()),
            drop_last=True,
            num_workers=hp.num_workers,
            persistent_workers=hp.num_workers > 0,
        )

    def _held_out_loader(self, data) -> DataLoader:
        rank, world = self._rank_world()
        if world > 1 and not isinstance(data, list):  # each rank evaluates its own contiguous-stride shard
            data = torch.utils.data.Subset(data, list(range(rank, len(data), world)))
        elif world > 1:
            data = data[rank::world]
        hp = self.config
        return DataLoader(data, batch_size=hp.batch_size, shuffle=False, num_workers=hp.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._held_out_loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        if not len(self.test_set):
            setting = self.source.test_setting
            raise ConfigError(f"{setting}=0 holds out no test blocks: set it above 0 to run aah test")
        return self._held_out_loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        hp = self.config
        return prompt_loader(hp.prompts, self.tokenizer, hp.seq_len, hp.batch_size, *self._rank_world())

    # -- the data position in checkpoints ---------------------------------------------------------------------------
    def _layout(self, trainer=None) -> dict:
        return self.position.layout(trainer or self.trainer, self._train_blocks())

    def check_resume(self, saved: dict, trainer=None) -> None:
        """Refuse, in one line, a resume this data cannot continue (``DataPosition.check_resume``). Runs before the
        first step (the CLI's preflight, and ``load_state_dict``)."""
        self.position.check_resume(saved, self._layout(trainer))

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        # Streamed training batches carry their positions; the position keeps them, the batch drops them.
        if self.position.record(batch) and self.streamed:
            self.train_set.start = None  # used by the first iteration after a restore only
        return batch

    def state_dict(self) -> dict:
        """The layout, and for streams every rank's position. A map-style position needs no entry: it follows from
        the layout and the restored loop state (``DataPosition``)."""
        # Called on every rank when a checkpoint is written; rank 0 writes what all ranks gathered.
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return {}
        state = {"layout": self._layout()}
        if self.streamed and self.train_set is not None:
            state["streams"] = self.position.stream_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        # Only a resumed fit continues the data position; validate / test / predict of the checkpoint read none, on
        # any number of processes, batch size or accumulation.
        if not state or (self.trainer is not None and self.trainer.state.fn != "fit"):
            return
        self.position.restore(state, self._layout())
        if self.streamed and self.train_set is not None:  # else setup hands the position on
            self._apply_restored_stream(*self._rank_world())

    def _apply_restored_stream(self, rank: int, world: int) -> None:
        start = self.position.restored_stream(rank, world)
        if start is not None:
            self.train_set.start = start
