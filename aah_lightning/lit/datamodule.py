"""LightningDataModule: corpus -> tokens -> packed ``seq_len + 1`` blocks -> train / val loaders.

Every rank reads its own disjoint shard: map-style corpora through ``EndlessSampler`` (rank-strided seeded
permutations), streamed ones through ``split_dataset_by_node``. The training position is part of every checkpoint
(``state_dict``), so a resumed run continues with exactly the batches the interrupted one would have seen next.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
import zlib
from collections import deque
from typing import Literal, Optional, get_args

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from aah_lightning.data import corpora
from aah_lightning.data.packing import EndlessSampler, PackedBlocks, concatenate, pack_stream
from aah_lightning.data.prompts import prompt_loader
from aah_lightning.data.synthetic import synthetic_documents
from aah_lightning.data.tokenizers import load_tokenizer
from aah_lightning.errors import ConfigError, require
from aah_lightning.lit.distributed import gather

# Lightning warns on every mid-epoch resume unless the loader has its own state_dict. This data module positions its
# loaders from the checkpoint itself (``state_dict`` / ``_map_position``), so the warning would be wrong here.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")

Source = Literal["stdlib", "files", "hub", "synthetic"]
SOURCES = get_args(Source)


def _text_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class _StreamedBlocks(IterableDataset):
    """Packed blocks from one rank's shard of a streamed dataset, without the held-out validation documents.

    ``endless``: pass after pass (step-based runs), else one pass per iteration (one Lightning epoch).

    Resumable: every block carries, as the JSON string ``resume``, the stream position after it: the datasets
    position before the oldest document that still has tokens in the packing buffer, how many of its tokens were
    already emitted, its document id, the pass and the block count. Restarting from that position re-reads that one
    document and continues token for token. The data module takes ``resume`` off each batch before the model sees it.
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
        block, eos = self.seq_len + 1, self.tokenizer.eos_id
        epoch, doc, count, skip, hf = pos["pass"], pos["doc"], pos["block"], pos["offset"], pos["hf"]
        while True:
            self.dataset.load_state_dict(hf)
            buf_t = buf_d = np.zeros(0, np.int64)
            docs = deque()  # [position before the document, its id, tokens in the buffer, tokens already emitted]
            before = hf
            for row in self.dataset:
                after = self.dataset.state_dict()
                text = row["text"]
                if not text or _text_key(text) in self.exclude:
                    before = after
                    continue
                toks = np.append(np.asarray(self.tokenizer.encode(text), np.int64), eos)[skip:]
                docs.append([before, doc, len(toks), skip])
                buf_t = np.concatenate([buf_t, toks])
                buf_d = np.concatenate([buf_d, np.full(len(toks), doc, np.int64)])
                doc, skip, before = doc + 1, 0, after
                while len(buf_t) >= block:
                    item = {"tokens": torch.from_numpy(buf_t[:block]), "doc_ids": torch.from_numpy(buf_d[:block])}
                    buf_t, buf_d = buf_t[block:], buf_d[block:]
                    used = block
                    while used:  # drop the emitted tokens from the document records
                        take = min(used, docs[0][2])
                        docs[0][2] -= take
                        docs[0][3] += take
                        used -= take
                        if docs[0][2] == 0:
                            docs.popleft()
                    count += 1
                    head = docs[0] if docs else [after, doc, 0, 0]
                    state = {"worker": worker, "pass": epoch, "hf": head[0], "offset": head[3], "doc": head[1],
                             "block": count}
                    yield {**item, "index": count - 1, "resume": json.dumps(state)}
            # End of a pass: the partial block left over is dropped, as the packer always does.
            epoch, hf, skip = epoch + 1, self.initial, 0
            if not self.endless:
                return


class TextDataModule(L.LightningDataModule):
    def __init__(
        self,
        source: Source = "stdlib",
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
        prompts: Optional[str] = None,
    ):
        """
        Args:
            source: stdlib (embedded default corpus, no network), files, hub (streamed) or synthetic.
            seq_len: tokens per training sequence (blocks hold seq_len + 1).
            batch_size: sequences per batch and rank.
            tokenizer: 'byte' (default), or a Hugging Face tokenizer name, tokenizer.json path or folder.
            paths: files or glob patterns for source=files (.txt, .jsonl/.json, .parquet).
            text_field: the text column of json/parquet files and hub datasets.
            hub_name: hub dataset name for source=hub.
            hub_config: the hub dataset's configuration (subset), if it has several.
            hub_split: the hub dataset's split to read.
            val_fraction: share of the token stream held out for validation (map-style sources).
            val_blocks: number of held-out blocks for source=hub.
            max_documents: use only the first N documents (after the seeded shuffle); None = all.
            synthetic_documents: number of synthetic documents (source=synthetic).
            synthetic_vocab: symbols of the synthetic language.
            synthetic_distance: long-range copy distance; default seq_len // 2.
            num_workers: DataLoader workers.
            seed: seeds the document order, the split and the training order.
            cache_dir: Hugging Face datasets cache for source=files.
            prompts: aah predict's prompts: a text file (one prompt per line) or JSONL with a 'prompt' field.
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
        self._restored: dict | None = None  # the data state of the checkpoint being resumed
        self._stream_position: dict = {}  # {worker id: position after the last block trained on} (streams)

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
        if self.train_set is not None or stage == "predict":  # predict reads only the prompts
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
        world = self._rank_world()[1]  # every rank validates on at least one block of its own
        n_val = min(max(world, int(round(n_blocks * hp.val_fraction))), n_blocks - 1)
        cut = (n_blocks - n_val) * block
        self.train_set = PackedBlocks(tokens[:cut], doc_ids[:cut], hp.seq_len)
        self.val_set = PackedBlocks(tokens[cut:], doc_ids[cut:], hp.seq_len)

    def _setup_stream(self) -> None:
        hp = self.hparams
        ds = corpora.hub_corpus(hp.hub_name, hp.hub_config, hp.hub_split, hp.text_field)
        if hp.text_field != "text":
            ds = ds.rename_column(hp.text_field, "text")
        # Validation: the first documents of the stream, read by every rank. Training leaves them out wherever the
        # split below puts them (by content: ``skip`` before a split would skip per shard, not the stream's head).
        initial = ds.state_dict()  # taken before any reading: afterwards it reports where reading stopped
        val, held_out = [], []
        docs = (self.tokenizer.encode(t) for t in _Recording((row["text"] for row in ds), held_out))
        for item in pack_stream(docs, self._eos, hp.seq_len):
            val.append(item)
            if len(val) >= hp.val_blocks:
                break
        self.val_set = val
        rank, world = self._rank_world()
        if world > 1:
            from datasets.distributed import split_dataset_by_node

            # Whole shards per rank when n_shards % world == 0, else every rank reads all and keeps every world-th.
            ds = split_dataset_by_node(ds, rank=rank, world_size=world)
            initial = ds.state_dict()  # a new dataset, not read yet
        endless = self.trainer is None or self.trainer.max_steps > 0
        exclude = frozenset(_text_key(t) for t in held_out)
        self.train_set = _StreamedBlocks(ds, self.tokenizer, hp.seq_len, exclude, endless, initial)
        if self._restored is not None:
            self._apply_restored_stream(rank, world)

    # -- loaders ---------------------------------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def _map_position(self) -> tuple[int, int]:
        """(items this rank has consumed, items its loader must hold) for a map-style corpus.

        Positions follow from the restored loop state at optimizer-step boundaries (where checkpoints are written):
        ``global_step * batch_size * accumulate_grad_batches``. The loader's length is what Lightning expects of it:
        on a resume it restores its batch count and stops after ``len - count`` batches, so the loader keeps the
        length of the uninterrupted run while its sampler starts at the position.
        """
        hp, trainer = self.hparams, self.trainer
        if trainer is None:
            return 0, len(self.train_set)
        _, world = self._rank_world()
        acc = trainer.accumulate_grad_batches
        if trainer.max_steps > 0:  # step-based: one Lightning epoch spans the whole run
            per_step = hp.batch_size * acc
            return trainer.global_step * per_step, trainer.max_steps * per_step
        # Epoch-based: one pass of the shard per epoch (the last partial batch dropped); a step ends early at the
        # epoch's end, as Lightning steps on the last batch.
        per_rank = len(self.train_set) // world
        batches = per_rank // hp.batch_size
        steps_per_epoch = math.ceil(batches / acc)
        epoch = trainer.current_epoch
        done = min(batches, max(0, trainer.global_step - epoch * steps_per_epoch) * acc)
        return epoch * per_rank + done * hp.batch_size, batches * hp.batch_size

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        if isinstance(self.train_set, IterableDataset):
            return DataLoader(self.train_set, batch_size=hp.batch_size, num_workers=hp.num_workers)
        rank, world = self._rank_world()
        consumed, length = self._map_position()
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

    def predict_dataloader(self) -> DataLoader:
        hp = self.hparams
        return prompt_loader(hp.prompts, self.tokenizer, hp.seq_len, hp.batch_size, *self._rank_world())

    # -- the data position in checkpoints ---------------------------------------------------------------------------
    def _layout(self) -> dict:
        """What the position means: a resume is exact only if these match."""
        hp, trainer = self.hparams, self.trainer
        return {
            "source": hp.source,
            "seed": hp.seed,
            "batch_size": hp.batch_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches if trainer else 1,
            "world_size": self._rank_world()[1],
            "num_workers": hp.num_workers if hp.source == "hub" else 0,
        }

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        # Streamed training batches carry their positions; keep the last one per worker, drop them from the batch.
        if isinstance(batch, dict) and "resume" in batch:
            for text in batch.pop("resume"):
                position = json.loads(text)
                self._stream_position[str(position.pop("worker"))] = position
            if isinstance(self.train_set, _StreamedBlocks):
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
        if isinstance(self.train_set, _StreamedBlocks):
            state["streams"] = gather(dict(self._stream_position))
        return state

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self._restored = state
        changed = {k: (v, self._layout()[k]) for k, v in state["layout"].items() if self._layout().get(k) != v}
        if changed:
            rank_zero_warn(
                "resuming with another data layout ("
                + ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items())
                + "): training continues, but not with the batches the interrupted run would have seen"
            )
        if isinstance(self.train_set, _StreamedBlocks):
            self._apply_restored_stream(*self._rank_world())

    def _apply_restored_stream(self, rank: int, world: int) -> None:
        streams = (self._restored or {}).get("streams")
        if streams is None:
            return
        if len(streams) != world:
            rank_zero_warn(
                f"the checkpoint holds stream positions of {len(streams)} ranks, this run has {world}: every rank "
                f"restarts its shard from the beginning"
            )
            return
        self._stream_position = dict(streams[rank])
        self.train_set.start = dict(streams[rank])


class _Recording:
    """Wraps an iterator and keeps the items taken from it."""

    def __init__(self, it, out: list):
        self.it, self.out = it, out

    def __iter__(self):
        for x in self.it:
            self.out.append(x)
            yield x
