"""``recall``: the associative-recall (or copy) task, generated block by block (``data/recall.py``); and the recall
mix, recall blocks composed into the splits of a text source (``data.recall.fraction``)."""

from __future__ import annotations

import torch

from aah_lightning.data.recall import GAPS, TASKS, RecallBlocks
from aah_lightning.data.sources.base import DataSource, Splits, register_source
from aah_lightning.errors import require


@register_source
class RecallSource(DataSource):
    name = "recall"
    has_tokens = False
    test_setting = "data.test_blocks"

    def check(self) -> None:
        """The recall settings; checked for source=recall and for a text source with recall blocks mixed in."""
        hp, rc = self.settings, self.settings.recall
        require(rc.gaps in GAPS, "data.recall.gaps", rc.gaps, f"one of {', '.join(GAPS)}")
        require(isinstance(rc.values, int) and rc.values >= 2, "data.recall.values", rc.values, ">= 2")
        require(isinstance(rc.blocks, int) and rc.blocks >= 1, "data.recall.blocks", rc.blocks, ">= 1")
        require(rc.task in TASKS, "data.recall.task", rc.task, f"one of {', '.join(TASKS)}")
        require(
            rc.copy_distance is None or (isinstance(rc.copy_distance, int) and 0 < rc.copy_distance < hp.seq_len),
            "data.recall.copy_distance",
            rc.copy_distance,
            f"None (5/8 of data.seq_len) or an integer in [1, data.seq_len={hp.seq_len})",
        )
        slots = -(-(hp.seq_len + 1) // 3)
        require(
            isinstance(rc.keys, int) and rc.keys >= 2,
            "data.recall.keys",
            rc.keys,
            f">= 2 (a sequence of data.seq_len={hp.seq_len} has {slots} slots; fewer keys than slots make keys come "
            f"back early)",
        )

    @property
    def ids(self) -> int:
        """Token ids the task uses: its keys and values."""
        return self.settings.recall.keys + self.settings.recall.values

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
