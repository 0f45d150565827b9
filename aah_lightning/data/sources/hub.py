"""``hub``: a Hugging Face hub dataset, streamed; the head of the stream is held out for validation and test."""

from __future__ import annotations

from aah_lightning.data import corpora
from aah_lightning.data.sources.base import DataSource, Splits, register_source
from aah_lightning.data.streaming import StreamedBlocks, held_out_head
from aah_lightning.errors import require


@register_source
class HubSource(DataSource):
    name = "hub"
    streamed = True
    test_setting = "data.test_blocks"

    def check(self) -> None:
        name = self.settings.hub.name
        require(bool(name), "data.hub.name", name, "a dataset name when data.source='hub'")

    def splits(self, tokenizer, rank: int, world: int, endless: bool) -> Splits:
        hp, hub = self.settings, self.settings.hub
        ds = corpora.hub_corpus(hub.name, hub.config, hub.split, hub.text_field)
        if hub.text_field != "text":
            ds = ds.rename_column(hub.text_field, "text")
        initial = ds.state_dict()  # taken before any reading: afterwards it reports where reading stopped
        val, test, exclude = held_out_head(ds, tokenizer, hp.seq_len, hp.val_blocks, hp.test_blocks)
        if world > 1:
            from datasets.distributed import split_dataset_by_node

            # Whole shards per rank when n_shards % world == 0, else every rank reads all and keeps every world-th.
            ds = split_dataset_by_node(ds, rank=rank, world_size=world)
            initial = ds.state_dict()  # a new dataset, not read yet
        return Splits(StreamedBlocks(ds, tokenizer, hp.seq_len, exclude, endless, initial), val, test)
