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

import json
import math
import os
import shutil
from typing import Literal, Optional, get_args

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from aah_lightning.data import corpora, prepare
from aah_lightning.data.packing import EndlessSampler, TokenBlocks
from aah_lightning.data.prompts import prompt_loader
from aah_lightning.data.recall import GAPS, TASKS, RecallBlocks
from aah_lightning.data.streaming import StreamedBlocks, held_out_head
from aah_lightning.data.synthetic import synthetic_documents
from aah_lightning.data.token_folder import TokenStream, open_folder, read_meta
from aah_lightning.data.tokenizers import load_tokenizer
from aah_lightning.errors import ConfigError, require
from aah_lightning.lit.distributed import gather

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
    """A DataLoader the data module positions itself (``TextDataModule._map_position`` and the stream positions in
    its ``state_dict``). Having a state of its own (nothing to add) tells Lightning a mid-epoch resume is exact."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def global_batch(layout: dict) -> int:
    """Blocks per optimizer step over all ranks, of a data layout (``TextDataModule._layout``, or a checkpoint's)."""
    return layout["batch_size"] * layout["world_size"] * layout["accumulate_grad_batches"]


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
        self._restored: dict | None = None  # the data state of the checkpoint being resumed
        self._counts_restated = False  # Lightning's batch count restated for the restored layout (once)
        self._stream_position: dict = {}  # {worker id: position after the last block trained on} (streams)

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
        if self._restored is not None:
            self._apply_restored_stream(rank, world)

    # -- the global batch ------------------------------------------------------------------------------------------
    def resolve_accumulation(self, trainer) -> None:
        """With ``data.global_batch_size``: set ``trainer.accumulate_grad_batches`` to global / (batch x world size).

        Called before training starts (the CLI's preflight, and ``setup('fit')``); Lightning's loops read
        ``trainer.accumulate_grad_batches`` at every batch, so setting it here is enough. Idempotent."""
        hp = self.hparams
        total = hp.global_batch_size
        if total is None:
            return
        batch, world = hp.batch_size, trainer.world_size
        round_ = batch * world  # blocks of one micro-batch on every rank
        if total % round_:
            near = sorted({max(round_, total // round_ * round_), (total // round_ + 1) * round_})
            raise ConfigError(
                f"data.global_batch_size={total} is not allowed with data.batch_size={batch} on {world} process(es): "
                f"a multiple of {round_} (data.batch_size x processes), e.g. {' or '.join(map(str, near))}"
            )
        acc, given = total // round_, trainer.accumulate_grad_batches
        if given not in (1, acc):
            raise ConfigError(
                f"trainer.accumulate_grad_batches={given} is not allowed with data.global_batch_size={total}: it "
                f"follows from it ({total} / (data.batch_size={batch} x {world} processes) = {acc}); leave "
                f"trainer.accumulate_grad_batches at 1, or unset data.global_batch_size"
            )
        trainer.accumulate_grad_batches = acc

    def _global_batch(self) -> int:
        """Blocks per optimizer step over all ranks."""
        return global_batch(self._layout())

    # -- loaders ---------------------------------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def steps_per_epoch(self) -> int:
        """Optimizer steps of one training epoch of an epoch-based run (map-style data).

        An epoch is one seeded permutation of the training blocks in whole global batches: ``n // global_batch``
        steps; the last ``n mod global_batch`` blocks of each permutation are left out of that epoch. With
        ``trainer.limit_train_batches``, Lightning's cut of the epoch (it steps on the last batch)."""
        trainer = self.trainer
        total = self._global_batch()
        steps = len(self.train_set) // total
        if steps == 0:
            raise ConfigError(
                f"the {len(self.train_set)} training blocks are fewer than one global batch of {total} "
                f"(data.batch_size x processes x trainer.accumulate_grad_batches): an epoch-based run "
                f"(trainer.max_steps=-1) needs at least one; use more data or a smaller batch"
            )
        acc = trainer.accumulate_grad_batches
        batches, limit = steps * acc, getattr(trainer, "limit_train_batches", 1.0)
        if isinstance(limit, int):
            batches = min(batches, limit)
        elif limit != 1.0:
            batches = int(batches * limit)
        return math.ceil(batches / acc)

    def planned_steps(self) -> int | None:
        """The run's optimizer steps (for the learning-rate schedule), known before the train loader is built, so
        that Lightning does not build it before a resumed run's loop state is restored. None: ask Lightning."""
        trainer = self.trainer
        if trainer is None or isinstance(self.train_set, IterableDataset) or self.train_set is None:
            return None
        if trainer.max_steps > 0:
            return trainer.max_steps
        if trainer.max_epochs is None or trainer.max_epochs < 0:
            return None
        return self.steps_per_epoch() * max(trainer.max_epochs, 1)

    def _map_position(self) -> tuple[int, int, int | None]:
        """(global positions consumed, items this rank's loader must hold, positions per epoch or None) for a
        map-style corpus.

        The position is in global terms: ``global_step x global batch`` blocks of the global order
        (``EndlessSampler``), whatever the world size; it follows from the restored loop state at optimizer-step
        boundaries (where checkpoints are written). The loader's length is what Lightning expects of it: on a resume
        it restores its batch count and stops after ``len - count`` batches, so the loader keeps the length of the
        uninterrupted run while its sampler starts at the position.
        """
        hp, trainer = self.hparams, self.trainer
        if trainer is None:
            return 0, len(self.train_set), None
        acc, total = trainer.accumulate_grad_batches, self._global_batch()
        if trainer.max_steps > 0:  # step-based: one Lightning epoch spans the whole run
            return trainer.global_step * total, trainer.max_steps * hp.batch_size * acc, None
        # Epoch-based: epoch e is permutation e in whole global batches (steps_per_epoch).
        whole = len(self.train_set) // total  # steps of an epoch without limit_train_batches
        steps, epoch = self.steps_per_epoch(), trainer.current_epoch
        done = min(steps, max(0, trainer.global_step - epoch * steps))
        return epoch * whole * total + done * total, whole * hp.batch_size * acc, whole * total

    def _continue_batch_count(self) -> None:
        """On a resume with another accumulation (the same global batch on another world size), restate Lightning's
        restored count of this epoch's micro-batches in the new accumulation: it decides where optimizer steps fall
        and when the loader is exhausted."""
        saved = (self._restored or {}).get("layout")
        loop = getattr(getattr(self.trainer, "fit_loop", None), "epoch_loop", None)
        if saved is None or loop is None or self._counts_restated:
            return
        self._counts_restated = True
        old, new = saved["accumulate_grad_batches"], self.trainer.accumulate_grad_batches
        if old == new:
            return
        for progress in (loop.batch_progress.current, loop.batch_progress.total):
            steps, within = divmod(progress.ready, old)
            if within:  # a checkpoint from inside an accumulation window: no step boundary to restate
                continue
            shift = steps * (new - old)
            progress.ready += shift
            progress.started += shift
            progress.processed += shift
            progress.completed += shift

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        self._continue_batch_count()
        if isinstance(self.train_set, IterableDataset):
            return PositionedLoader(self.train_set, batch_size=hp.batch_size, num_workers=hp.num_workers)
        rank, world = self._rank_world()
        start, length, per_epoch = self._map_position()
        sampler = EndlessSampler(
            len(self.train_set),
            hp.seed,
            length=max(0, length),
            rank=rank,
            world_size=world,
            start=start,
            per_epoch=per_epoch,
            epochs=per_epoch is not None,
        )
        return PositionedLoader(
            self.train_set,
            batch_size=hp.batch_size,
            sampler=sampler,
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
        """What the position means. A map-style position is global: it continues on another world size, batch size
        and accumulation as long as their product (the global batch) is the same; a stream's needs the same
        processes and workers too (``check_resume``)."""
        hp, trainer = self.hparams, trainer or self.trainer
        layout = {
            "source": hp.source,
            "seed": hp.seed,
            "batch_size": hp.batch_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches if trainer else 1,
            "world_size": trainer.world_size if trainer else 1,
            "num_workers": hp.num_workers if hp.source == "hub" else 0,
        }
        if self.train_set is not None and not isinstance(self.train_set, IterableDataset):  # permuted: this many
            layout["train_blocks"] = len(self.train_set)
        return layout

    def check_resume(self, saved: dict, trainer=None) -> None:
        """Refuse, in one line, a resume this data cannot continue: another global batch, or a stream read by
        another number of processes or workers. Runs before the first step (the CLI's preflight, and
        ``load_state_dict``)."""
        now = self._layout(trainer)
        old, new = global_batch(saved), global_batch(now)
        if old != new:
            batch, world = now["batch_size"], now["world_size"]
            if old % (batch * world) == 0:
                fix = f"set data.global_batch_size={old} (or trainer.accumulate_grad_batches={old // (batch * world)})"
            elif old % world == 0:
                fix = f"set data.batch_size to a divisor of {old // world} and data.global_batch_size={old}"
            else:
                fix = f"use a number of processes that divides {old}, and data.global_batch_size={old}"
            raise ConfigError(
                f"the checkpoint was trained with a global batch of {old} blocks (data.batch_size="
                f"{saved['batch_size']} x {saved['world_size']} processes x trainer.accumulate_grad_batches="
                f"{saved['accumulate_grad_batches']}), this run's is {new} ({batch} x {world} x "
                f"{now['accumulate_grad_batches']}): {fix} to resume it"
            )
        if now["source"] == "hub" and saved.get("source") == "hub":
            readers = (saved["world_size"], saved["num_workers"])
            if readers != (now["world_size"], now["num_workers"]):
                raise ConfigError(
                    f"the checkpoint holds stream positions of {readers[0]} process(es) with data.num_workers="
                    f"{readers[1]}, this run has {now['world_size']} with {now['num_workers']}: positions in the "
                    f"shards of a stream cannot be moved to another split without repeating or skipping documents; "
                    f"resume on {readers[0]} process(es) with data.num_workers={readers[1]}, or start a new run"
                )

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        # Streamed training batches carry their positions; keep the last one per worker, drop them from the batch.
        if isinstance(batch, dict) and "resume" in batch:
            for text in batch.pop("resume"):
                position = json.loads(text)
                self._stream_position[str(position.pop("worker"))] = position
            if isinstance(self.train_set, StreamedBlocks):
                self.train_set.start = None  # used by the first iteration after a restore only
        return batch

    def state_dict(self) -> dict:
        """The layout, and for streams every rank's position. A map-style position needs no entry: it follows from
        the layout and the restored loop state (``_map_position``)."""
        # Called on every rank when a checkpoint is written; rank 0 writes what all ranks gathered.
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return {}
        state = {"layout": self._layout()}
        if isinstance(self.train_set, StreamedBlocks):
            state["streams"] = gather(dict(self._stream_position))
        return state

    def load_state_dict(self, state: dict) -> None:
        # Only a resumed fit continues the data position; validate / test / predict of the checkpoint read none, on
        # any number of processes, batch size or accumulation.
        if not state or (self.trainer is not None and self.trainer.state.fn != "fit"):
            return
        self._restored, self._counts_restated = state, False
        self.check_resume(state["layout"])
        layout = self._layout()
        # The world size, batch size and accumulation may change with the global batch kept (checked above).
        free = ("world_size", "batch_size", "accumulate_grad_batches")
        changed = {k: (v, layout.get(k)) for k, v in state["layout"].items() if k not in free and layout.get(k) != v}
        if changed:
            rank_zero_warn(
                "resuming with another data layout ("
                + ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items())
                + "): training continues, but not with the batches the interrupted run would have seen"
            )
        if isinstance(self.train_set, StreamedBlocks):
            self._apply_restored_stream(*self._rank_world())

    def _apply_restored_stream(self, rank: int, world: int) -> None:
        streams = (self._restored or {}).get("streams")
        if streams is None:
            return
        if len(streams) != world:  # check_resume refuses this before; a stream restarted here would repeat data
            raise ConfigError(
                f"the checkpoint holds stream positions of {len(streams)} processes, this run has {world}"
            )
        self._stream_position = dict(streams[rank])
        self.train_set.start = dict(streams[rank])
