"""LightningDataModule: corpus -> token stream -> ``seq_len + 1`` blocks -> train / val / test loaders.

Map-style corpora are token folders (``data/token_folder.py``), read by memory-mapping: ``stdlib`` and ``files`` are
tokenized once into a folder under the cache folder (``data/prepare.py``), ``tokens`` names a prepared one. Blocks are
slices of the stream; the held-out blocks are its tail (validation last, test before it). Streamed corpora (``hub``)
go through ``data/streaming.py``.

``recall`` generates the associative-recall task (``data/recall.py``) block by block; with ``recall_fraction`` a
share of a text corpus's blocks are recall blocks instead (``MixedBlocks``). Recall blocks carry a ``loss_mask``
(training and the loss count only the predictable targets) and ``recall_distance`` (the module's recall accuracy).

Every rank reads its own disjoint shard: map-style corpora through ``EndlessSampler`` (rank-strided seeded
permutations), streamed ones through ``split_dataset_by_node``. The training position is part of every checkpoint
(``state_dict``), so a resumed run continues with exactly the batches the interrupted one would have seen next.
"""

from __future__ import annotations

import os
import shutil
from typing import Literal, Optional, get_args

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from aah_lightning.data import corpora, prepare
from aah_lightning.data.packing import TokenBlocks
from aah_lightning.data.prompts import prompt_loader
from aah_lightning.data.recall import GAPS, TASKS, RecallBlocks
from aah_lightning.data.streaming import StreamedBlocks, held_out_head
from aah_lightning.data.synthetic import synthetic_documents
from aah_lightning.data.token_folder import TokenStream, open_folder, read_meta
from aah_lightning.data.tokenizers import load_tokenizer
from aah_lightning.errors import ConfigError, require
from aah_lightning.lit.data_position import DataPosition

Source = Literal["stdlib", "files", "tokens", "hub", "synthetic", "recall"]
SOURCES = get_args(Source)


class MixedBlocks(torch.utils.data.Dataset):
    """Text blocks with recall blocks among them: ``recall`` blocks after the ``text`` blocks, every item with a
    ``loss_mask`` and ``recall_distance`` (all targets and no answers for text), so that batches can mix both. The
    sampler's seeded permutation spreads them out."""

    def __init__(self, text: TokenBlocks, recall: RecallBlocks):
        self.text, self.recall = text, recall

    def __len__(self) -> int:
        return len(self.text) + len(self.recall)

    def __getitem__(self, i: int) -> dict:
        if i >= len(self.text):
            return {**self.recall[i - len(self.text)], "index": i}
        item = self.text[i]
        seq_len = len(item["tokens"]) - 1
        return {
            "tokens": item["tokens"],
            "doc_ids": item["doc_ids"],
            "loss_mask": torch.ones(seq_len, dtype=torch.bool),
            "recall_distance": torch.zeros(seq_len, dtype=torch.int64),
            "index": i,
        }


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
        source: Source = "stdlib",
        seq_len: int = 256,
        batch_size: int = 16,
        global_batch_size: Optional[int] = None,
        tokenizer: str = "byte",
        paths: Optional[list[str]] = None,
        path: Optional[str] = None,
        text_field: str = "text",
        hub_name: Optional[str] = None,
        hub_config: Optional[str] = None,
        hub_split: str = "train",
        val_fraction: float = 0.02,
        test_fraction: float = 0.01,
        val_blocks: int = 64,
        test_blocks: int = 64,
        max_documents: Optional[int] = None,
        synthetic_documents: int = 2000,
        synthetic_vocab: int = 64,
        synthetic_distance: Optional[int] = None,
        recall_keys: int = 32,
        recall_values: int = 16,
        recall_gaps: Literal["mix", "uniform", "loguniform"] = "mix",
        recall_blocks: int = 1_000_000,
        recall_fraction: float = 0.0,
        recall_task: Literal["mqar", "copy"] = "mqar",
        recall_copy_distance: Optional[int] = None,
        num_workers: int = 0,
        num_proc: Optional[int] = None,
        seed: int = 1234,
        cache_dir: Optional[str] = None,
        prompts: Optional[str] = None,
    ):
        """
        Args:
            source: stdlib (embedded default corpus, no network), files, tokens (a prepared token folder), hub
                (streamed), synthetic (copies at one distance) or recall (multi-query associative recall).
            seq_len: tokens per training sequence (blocks hold seq_len + 1).
            batch_size: sequences per batch and rank.
            global_batch_size: sequences per optimizer step over all ranks; trainer.accumulate_grad_batches then
                follows as global_batch_size / (batch_size x world size), which must be a whole number. None: set
                trainer.accumulate_grad_batches yourself. Keeps the optimization the same on another number of GPUs.
            tokenizer: 'byte' (default), or a Hugging Face tokenizer name, tokenizer.json path or folder. For
                source=tokens, the tokenizer the folder was prepared with.
            paths: files or glob patterns for source=files (.txt, .jsonl/.json, .parquet).
            path: the token folder for source=tokens (written by aah-prepare).
            text_field: the text column of json/parquet files and hub datasets.
            hub_name: hub dataset name for source=hub.
            hub_config: the hub dataset's configuration (subset), if it has several.
            hub_split: the hub dataset's split to read.
            val_fraction: share of the blocks held out for validation: the tail of the seeded stream (map-style).
            test_fraction: share of the blocks held out for ``aah test``: the blocks just before validation.
            val_blocks: number of held-out validation blocks for source=hub (the head of the stream) and recall.
            test_blocks: number of held-out test blocks for source=hub (after the validation blocks) and recall.
            max_documents: use only the first N documents (after the seeded shuffle); None = all.
            synthetic_documents: number of synthetic documents (source=synthetic).
            synthetic_vocab: symbols of the synthetic language.
            synthetic_distance: long-range copy distance; default seq_len // 2.
            recall_keys: keys of the recall task (at least the slots of a sequence would need: a key is bound once
                per sequence).
            recall_values: values of the recall task (chance accuracy is 1 / recall_values).
            recall_gaps: how far a key comes back, in 3-token slots: mix (half log-uniform, half uniform over the
                sequence), uniform or loguniform.
            recall_blocks: training sequences of source=recall (generated on demand: none is stored); validation and
                test use val_blocks / test_blocks sequences of their own.
            recall_fraction: with a text source (stdlib, files, tokens): this share of the training, validation and
                test blocks are recall sequences, with ids above the tokenizer's (0 = none).
            recall_task: mqar (multi-query associative recall) or copy (every token after the first
                recall_copy_distance repeats the one that far back; data/recall.py).
            recall_copy_distance: the copy task's distance; default 5/8 of seq_len (160 at T = 256: only a window
                wider than T/2 reaches it).
            num_workers: DataLoader workers.
            num_proc: tokenizer processes when a token folder is prepared; default 1 for corpora under 64 MB of
                text, else up to 4.
            seed: seeds the document order, the split and the training order (for source=tokens the folder's
                document order was fixed when it was prepared; the seed orders training).
            cache_dir: where token folders of stdlib/files are kept (under tokens/); default $AAH_CACHE_DIR or
                ~/.cache/aah. Also the Hugging Face datasets cache for source=files, when given.
            prompts: aah predict's prompts: a text file (one prompt per line) or JSONL with a 'prompt' field.
        """
        super().__init__()
        require(source in SOURCES, "data.source", source, f"one of {', '.join(SOURCES)}")
        require(isinstance(seq_len, int) and seq_len > 0, "data.seq_len", seq_len, "a positive integer")
        require(isinstance(batch_size, int) and batch_size > 0, "data.batch_size", batch_size, "a positive integer")
        require(
            global_batch_size is None or (isinstance(global_batch_size, int) and global_batch_size > 0),
            "data.global_batch_size",
            global_batch_size,
            "a positive integer (a multiple of data.batch_size x world size), or null",
        )
        require(0.0 < val_fraction < 1.0, "data.val_fraction", val_fraction, "a number in (0, 1)")
        require(
            0.0 <= test_fraction < 1.0 - val_fraction,
            "data.test_fraction",
            test_fraction,
            f"a number in [0, 1 - data.val_fraction={1 - val_fraction:g})",
        )
        require(
            isinstance(val_blocks, int) and val_blocks >= 1,
            "data.val_blocks",
            val_blocks,
            "a positive number of held-out blocks (to train without validation, set trainer.limit_val_batches=0)",
        )
        require(isinstance(test_blocks, int) and test_blocks >= 0, "data.test_blocks", test_blocks, ">= 0")
        require(num_proc is None or num_proc >= 1, "data.num_proc", num_proc, "a positive integer, or null")
        require(recall_gaps in GAPS, "data.recall_gaps", recall_gaps, f"one of {', '.join(GAPS)}")
        require(isinstance(recall_values, int) and recall_values >= 2, "data.recall_values", recall_values, ">= 2")
        require(isinstance(recall_blocks, int) and recall_blocks >= 1, "data.recall_blocks", recall_blocks, ">= 1")
        require(
            0.0 <= recall_fraction < 1.0 and (recall_fraction == 0 or source in ("stdlib", "files", "tokens")),
            "data.recall_fraction",
            recall_fraction,
            "in [0, 1), and above 0 only with data.source stdlib, files or tokens",
        )
        require(recall_task in TASKS, "data.recall_task", recall_task, f"one of {', '.join(TASKS)}")
        require(
            recall_copy_distance is None
            or (isinstance(recall_copy_distance, int) and 0 < recall_copy_distance < seq_len),
            "data.recall_copy_distance",
            recall_copy_distance,
            f"None (5/8 of data.seq_len) or an integer in [1, data.seq_len={seq_len})",
        )
        if source == "recall" or recall_fraction > 0:
            slots = -(-(seq_len + 1) // 3)
            require(
                isinstance(recall_keys, int) and recall_keys >= 2,
                "data.recall_keys",
                recall_keys,
                f">= 2 (a sequence of data.seq_len={seq_len} has {slots} slots; fewer keys than slots make keys come "
                f"back early)",
            )
        if source == "files":
            corpora.expand_paths(paths or [])  # fail now, not after the model is built
        if source == "hub":
            require(bool(hub_name), "data.hub_name", hub_name, "a dataset name when data.source='hub'")
        if source == "tokens":
            require(bool(path), "data.path", path, "a token folder (written by aah-prepare) when data.source='tokens'")
        self.save_hyperparameters()
        self.prepare_data_per_node = True  # token folders live in each node's cache folder
        if source == "synthetic":
            self.tokenizer = None
            self._vocab, self._eos = synthetic_vocab + 1, synthetic_vocab
        elif source == "recall":
            self.tokenizer = None
            self._vocab, self._eos = recall_keys + recall_values + 1, recall_keys + recall_values
        else:
            self.tokenizer = load_tokenizer(tokenizer)
            self._vocab, self._eos = self.tokenizer.vocab_size, self.tokenizer.eos_id
            if recall_fraction > 0:  # the recall task's keys and values above the tokenizer's ids
                self._vocab += recall_keys + recall_values
        if source == "tokens":
            self._check_folder_tokenizer(read_meta(path, "data.path"))
        self.train_set = self.val_set = self.test_set = None
        self._source: dict | None = None  # the description of stdlib / files text (``_describe_source``)
        self.position = DataPosition(source, seed, batch_size, global_batch_size, num_workers)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    # -- token folders ---------------------------------------------------------------------------------------------
    def _check_folder_tokenizer(self, meta: dict) -> None:
        """A folder of another tokenizer or vocabulary would train the model on ids that mean something else."""
        tok = self.tokenizer
        theirs = (meta["tokenizer"]["name"], meta["tokenizer"]["fingerprint"], meta["vocab_size"], meta["eos_id"])
        if theirs != (tok.name, tok.fingerprint, tok.vocab_size, tok.eos_id):
            other = " (another tokenizer file)" if theirs[1] != tok.fingerprint and theirs[0] == tok.name else ""
            raise ConfigError(
                f"data.path={self.hparams.path!r} holds tokens of tokenizer {theirs[0]!r} (vocabulary {theirs[2]}, "
                f"end-of-document {theirs[3]}), but data.tokenizer={self.hparams.tokenizer!r}{other} has vocabulary "
                f"{tok.vocab_size}, end-of-document {tok.eos_id}: set data.tokenizer to the folder's tokenizer, or "
                f"prepare the folder with this one"
            )

    def _describe_source(self) -> dict:
        if self._source is None:  # once: it reads every file's size and time
            hp = self.hparams
            self._source = prepare.describe_source(hp.source, hp.paths, hp.text_field)
        return self._source

    def _cached_folder(self) -> str:
        hp = self.hparams
        key = prepare.folder_key(self._describe_source(), self.tokenizer, hp.seed, hp.max_documents)
        return os.path.join(prepare.cache_root(hp.cache_dir), key)

    def prepare_data(self) -> None:
        """Tokenize stdlib / files into the cache once (Lightning calls this on one process per node)."""
        hp = self.hparams
        if hp.source not in ("stdlib", "files"):
            return
        folder = self._cached_folder()
        if os.path.isdir(folder):
            try:
                open_folder(folder, "the cached token folder")
                return
            except ConfigError as e:  # a damaged cache entry is rebuilt, not trusted
                rank_zero_warn(f"{e}; tokenizing again")
                shutil.rmtree(folder, ignore_errors=True)
        prepare.prepared_folder(
            folder,
            self._describe_source(),
            self.tokenizer,
            hp.seed,
            hp.max_documents,
            hp.num_proc,
            hp.cache_dir,
            setting="the cached token folder",
        )

    def _token_stream(self) -> TokenStream:
        hp = self.hparams
        if hp.source == "synthetic":
            distance = hp.synthetic_distance or hp.seq_len // 2
            require(0 < distance < hp.seq_len, "data.synthetic_distance", distance, f"in [1, seq_len={hp.seq_len})")
            docs = synthetic_documents(hp.synthetic_documents, hp.seq_len, distance, hp.synthetic_vocab, seed=hp.seed)
            return TokenStream.from_documents(docs, self._eos)
        if hp.source == "tokens":
            stream, meta = open_folder(hp.path, "data.path")
            self._check_folder_tokenizer(meta)
            return stream
        folder = self._cached_folder()
        if not os.path.isdir(folder):  # not prepared by the Trainer (this module used on its own)
            self.prepare_data()
        return open_folder(folder, "the cached token folder")[0]

    # -- building the datasets -------------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if stage == "fit" and self.trainer is not None:
            self.resolve_accumulation(self.trainer)
        if self.train_set is not None or stage == "predict":  # predict reads only the prompts
            return
        hp = self.hparams
        if hp.source == "hub":
            self._setup_stream()
            return
        if hp.source == "recall":
            world = self._rank_world()[1]
            self.train_set = self._recall_blocks(hp.recall_blocks, "train")
            self.val_set = self._recall_blocks(max(world, hp.val_blocks), "val")
            self.test_set = self._recall_blocks(max(world, hp.test_blocks) if hp.test_blocks > 0 else 0, "test")
            return
        stream = self._token_stream()
        what = f"data.path={hp.path!r}" if hp.source == "tokens" else f"data.source={hp.source!r}"
        block = hp.seq_len + 1
        n_blocks = len(stream) // block
        if len(stream) == 0:
            raise ConfigError(f"{what} gave an empty corpus (no tokens): check data.paths")
        world = self._rank_world()[1]  # every rank validates (and tests) on at least one block of its own
        n_val = max(world, int(round(n_blocks * hp.val_fraction)))
        n_test = max(world, int(round(n_blocks * hp.test_fraction))) if hp.test_fraction > 0 else 0
        if n_blocks < n_val + n_test + world:
            raise ConfigError(
                f"{what} has {len(stream)} tokens, {n_blocks} blocks of data.seq_len+1={block}: too few to hold out "
                f"{n_val} validation and {n_test} test blocks and train {world} process(es): use more data or a "
                f"smaller data.seq_len"
            )
        n_train = n_blocks - n_val - n_test
        # [ train | test | validation ]: validation is the tail of the seeded document stream, as it always was.
        self.train_set = TokenBlocks(stream, hp.seq_len, 0, n_train)
        self.test_set = TokenBlocks(stream, hp.seq_len, n_train, n_test)
        self.val_set = TokenBlocks(stream, hp.seq_len, n_train + n_test, n_val)
        if hp.recall_fraction > 0:  # the same share of recall blocks in every split
            offset = self.tokenizer.vocab_size

            def share(n):
                return int(round(n * hp.recall_fraction / (1 - hp.recall_fraction)))

            self.train_set = MixedBlocks(self.train_set, self._recall_blocks(share(n_train), "train", offset))
            self.test_set = MixedBlocks(self.test_set, self._recall_blocks(share(n_test), "test", offset))
            self.val_set = MixedBlocks(self.val_set, self._recall_blocks(share(n_val), "val", offset))

    def _recall_blocks(self, count: int, split: str, offset: int = 0) -> RecallBlocks:
        hp = self.hparams
        return RecallBlocks(
            hp.seq_len,
            count,
            hp.recall_keys,
            hp.recall_values,
            hp.recall_gaps,
            hp.seed,
            split,
            offset=offset,
            task=hp.recall_task,
            copy_distance=hp.recall_copy_distance or hp.seq_len * 5 // 8,
        )

    def _setup_stream(self) -> None:
        hp = self.hparams
        ds = corpora.hub_corpus(hp.hub_name, hp.hub_config, hp.hub_split, hp.text_field)
        if hp.text_field != "text":
            ds = ds.rename_column(hp.text_field, "text")
        initial = ds.state_dict()  # taken before any reading: afterwards it reports where reading stopped
        self.val_set, self.test_set, exclude = held_out_head(
            ds, self.tokenizer, hp.seq_len, hp.val_blocks, hp.test_blocks
        )
        rank, world = self._rank_world()
        if world > 1:
            from datasets.distributed import split_dataset_by_node

            # Whole shards per rank when n_shards % world == 0, else every rank reads all and keeps every world-th.
            ds = split_dataset_by_node(ds, rank=rank, world_size=world)
            initial = ds.state_dict()  # a new dataset, not read yet
        endless = self.trainer is None or self.trainer.max_steps > 0
        self.train_set = StreamedBlocks(ds, self.tokenizer, hp.seq_len, exclude, endless, initial)
        if self.position.restored is not None:
            self._apply_restored_stream(rank, world)

    # -- the training position (lit/data_position.py) ---------------------------------------------------------------
    def resolve_accumulation(self, trainer) -> None:
        """With ``data.global_batch_size``: set ``trainer.accumulate_grad_batches`` (``DataPosition``)."""
        self.position.resolve_accumulation(trainer)

    def _train_blocks(self) -> int | None:
        """The permuted training blocks of a map-style corpus (None: a stream, or not set up)."""
        if self.train_set is None or isinstance(self.train_set, IterableDataset):
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
        hp = self.hparams
        self.position.restate_batch_count(self.trainer)
        if isinstance(self.train_set, IterableDataset):
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
        hp = self.hparams
        return DataLoader(data, batch_size=hp.batch_size, shuffle=False, num_workers=hp.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._held_out_loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        if not len(self.test_set):
            setting = "data.test_blocks" if self.hparams.source in ("hub", "recall") else "data.test_fraction"
            raise ConfigError(f"{setting}=0 holds out no test blocks: set it above 0 to run aah test")
        return self._held_out_loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        hp = self.hparams
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
        if self.position.record(batch) and isinstance(self.train_set, StreamedBlocks):
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
        if isinstance(self.train_set, StreamedBlocks):
            state["streams"] = self.position.stream_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        # Only a resumed fit continues the data position; validate / test / predict of the checkpoint read none, on
        # any number of processes, batch size or accumulation.
        if not state or (self.trainer is not None and self.trainer.state.fn != "fit"):
            return
        self.position.restore(state, self._layout())
        if isinstance(self.train_set, StreamedBlocks):
            self._apply_restored_stream(*self._rank_world())

    def _apply_restored_stream(self, rank: int, world: int) -> None:
        start = self.position.restored_stream(rank, world)
        if start is not None:
            self.train_set.start = start
