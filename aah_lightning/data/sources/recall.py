"""``recall``: the associative-recall (or copy) task, generated block by block (``data/recall.py``); and the recall
mix (``RecallMix``), a source that puts recall blocks into the splits of a text source (``data.recall.fraction``),
which ``get_source`` returns in place of the text source."""

from __future__ import annotations

import torch

from aah_lightning.data.recall import RecallBlocks, relay_ids
from aah_lightning.data.sources.base import DataSource, Splits, register_source, source_class


@register_source
class RecallSource(DataSource):
    name = "recall"
    has_tokens = False
    test_setting = "data.test_blocks"

    # Its settings (data.recall) are checked by DataConfig.validate, whatever the source: a text source may mix them.

    @property
    def ids(self) -> int:
        """Token ids the task uses: its keys and values (and the relay task's filler and classes)."""
        rc = self.settings.recall
        return relay_ids(rc.keys, rc.values) if rc.task == "relay" else rc.keys + rc.values

    def vocabulary(self, tokenizer) -> tuple[int, int]:
        return self.ids + 1, self.ids  # keys, values, and an end-of-document id after them

    def blocks(self, count: int, split: str, offset: int = 0) -> RecallBlocks:
        hp, rc = self.settings, self.settings.recall
        return RecallBlocks(
            hp.seq_len,
            count,
            rc.keys,
            rc.values,
            rc.gaps,
            hp.seed,
            split,
            offset=offset,
            task=rc.task,
            copy_distance=rc.copy_distance or hp.seq_len * 5 // 8,
            relay_gap=rc.relay_gap,
        )

    def splits(self, tokenizer, rank: int, world: int, endless: bool) -> Splits:
        hp = self.settings
        return Splits(
            train=self.blocks(hp.recall.blocks, "train"),
            val=self.blocks(max(world, hp.val_blocks), "val"),
            test=self.blocks(max(world, hp.test_blocks) if hp.test_blocks > 0 else 0, "test"),
        )


class MixedBlocks(torch.utils.data.Dataset):
    """Text blocks with recall blocks among them: ``recall`` blocks after the ``text`` blocks, every item with a
    ``loss_mask`` and ``recall_distance`` (all targets and no answers for text), so that batches can mix both. The
    sampler's seeded permutation spreads them out."""

    def __init__(self, text, recall: RecallBlocks):
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


def with_recall(text: Splits, recall: RecallSource, fraction: float, offset: int) -> Splits:
    """The splits of a text source with the same share ``fraction`` of recall blocks in every split, their ids from
    ``offset`` up (above the tokenizer's)."""

    def mixed(blocks, split: str) -> MixedBlocks:
        share = int(round(len(blocks) * fraction / (1 - fraction)))
        return MixedBlocks(blocks, recall.blocks(share, split, offset))

    return Splits(train=mixed(text.train, "train"), val=mixed(text.val, "val"), test=mixed(text.test, "test"))


class RecallMix(DataSource):
    """The recall mix: the source ``data.source`` names (a ``mixable`` one) with the share ``data.recall.fraction``
    of recall blocks in each of its splits, the task's keys and values above the tokenizer's ids. ``get_source``
    returns it when the fraction is above 0, so the data module handles it as any other source."""

    def __init__(self, settings):
        super().__init__(settings)
        self.text = source_class(settings.source)(settings)
        self.recall = RecallSource(settings)
        # What the data module asks of a source is the text source's answer (map-style, with a tokenizer).
        self.has_tokens, self.streamed = self.text.has_tokens, self.text.streamed
        self.test_setting = self.text.test_setting

    def check(self) -> None:
        self.text.check()

    def check_tokenizer(self, tokenizer) -> None:
        self.text.check_tokenizer(tokenizer)

    def vocabulary(self, tokenizer) -> tuple[int, int]:
        vocab, eos = self.text.vocabulary(tokenizer)
        return vocab + self.recall.ids, eos

    def prepare(self, tokenizer) -> None:
        self.text.prepare(tokenizer)

    def splits(self, tokenizer, rank: int, world: int, endless: bool) -> Splits:
        text = self.text.splits(tokenizer, rank, world, endless)
        return with_recall(text, self.recall, self.settings.recall.fraction, tokenizer.vocab_size)
