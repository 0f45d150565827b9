"""The contract of a data source, and its registry.

A source turns the data module's settings into three splits of blocks of ``seq_len + 1`` tokens. It is one class,
registered by name (``@register_source``); ``data.source`` picks it. What a source must say and do:

- ``name``: the value of ``data.source`` that picks it.
- ``has_tokens``: True when its ids are a tokenizer's (text: ``data.tokenizer`` is loaded and saved with the
  checkpoint); False when the source defines its own vocabulary (a synthetic task), through ``vocabulary``.
- ``streamed``: True when its training split is an ``IterableDataset`` that positions itself (its blocks carry
  ``resume``; ``DataPosition`` keeps the positions, and the data module hands a restored one back in the split's
  ``start``); False for map-style training blocks, which ``DataPosition`` orders and shards (their length is the
  number of training blocks). ``is_stream`` is the one place it is read.
- ``test_setting``: the setting that holds out its test blocks (named when it holds out none).
- ``mixable``: recall blocks may be mixed into its splits (``data.recall.fraction``; ``get_source`` then returns
  the recall mix over it). A mixable source has a tokenizer and map-style splits.
- ``check()``: refuse bad settings of this source in one line naming the setting; called when the data module is
  built, before any model or data.
- ``vocabulary(tokenizer)``: ``(vocab_size, eos_id)``.
- ``prepare(tokenizer)``: work done once per node before training (tokenizing into the cache); default none.
- ``splits(tokenizer, rank, world, endless)``: the ``Splits``. Every rank reads the same held-out blocks (the data
  module shards them) and gets at least one of each held-out split with items; ``endless``: a step-based run (a
  stream goes pass after pass).

An item is a dict with ``tokens`` and ``doc_ids`` (int64, ``[seq_len + 1]``) and its ``index``; a task whose loss
counts only some targets adds ``loss_mask`` (bool) and ``recall_distance`` (int64), both ``[seq_len]``.
``docs/architecture.md`` ("Adding a data source") shows a whole source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from aah_lightning.data.packing import TokenBlocks
from aah_lightning.errors import ConfigError
from aah_lightning.plugins import find_plugin

_REGISTRY: dict[str, type[DataSource]] = {}


@dataclass
class Splits:
    train: Any  # a map-style Dataset, or an IterableDataset for a streamed source
    val: Any
    test: Any


class DataSource:
    name: ClassVar[str]
    has_tokens: ClassVar[bool] = True
    streamed: ClassVar[bool] = False
    test_setting: ClassVar[str] = "data.test_fraction"
    mixable: ClassVar[bool] = False

    def __init__(self, settings):
        self.settings = settings  # the data module's hyperparameters (read only)

    def check(self) -> None:
        pass

    def check_tokenizer(self, tokenizer) -> None:
        """Refuse a tokenizer these tokens were not made with (a prepared token folder); default: any."""

    def vocabulary(self, tokenizer) -> tuple[int, int]:
        return tokenizer.vocab_size, tokenizer.eos_id

    def prepare(self, tokenizer) -> None:
        pass

    def splits(self, tokenizer, rank: int, world: int, endless: bool) -> Splits:
        raise NotImplementedError


def register_source(cls: type[DataSource]) -> type[DataSource]:
    """Class decorator: make ``cls`` the source of ``data.source=cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"data source {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def source_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def source_class(name: str) -> type[DataSource]:
    """The class ``data.source`` names: a registered name, or ``module:name`` of a source registered in another
    importable module (imported first, as ``model.aah.policy`` does for policies). ``get_source`` (the package's)
    also wraps it in the recall mix."""
    return find_plugin(_REGISTRY, name, "data.source", "data source")


def mixable_names() -> list[str]:
    return [n for n, source in _REGISTRY.items() if source.mixable]


def is_stream(source: DataSource | type[DataSource]) -> bool:
    """Whether a source's training split is a stream that positions itself (``streamed``); the one answer the data
    module and ``DataPosition`` read, for the loader, the sampler, the layout and the checkpoint's positions."""
    return bool(source.streamed)


def is_text(name: str) -> bool:
    """Whether the ids of source ``name`` are a tokenizer's (a source that cannot be found counts as text)."""
    try:
        return source_class(name).has_tokens
    except ConfigError:
        return True


def split_stream(stream, seq_len: int, val_fraction: float, test_fraction: float, world: int, what: str) -> Splits:
    """A token stream cut into ``[ train | test | validation ]`` blocks: validation is the tail of the seeded stream
    and every rank validates (and tests) on at least one block of its own."""
    block = seq_len + 1
    n_blocks = len(stream) // block
    if len(stream) == 0:
        raise ConfigError(f"{what} gave an empty corpus (no tokens): check data.files.paths")
    n_val = max(world, int(round(n_blocks * val_fraction)))
    n_test = max(world, int(round(n_blocks * test_fraction))) if test_fraction > 0 else 0
    if n_blocks < n_val + n_test + world:
        raise ConfigError(
            f"{what} has {len(stream)} tokens, {n_blocks} blocks of data.seq_len+1={block}: too few to hold out "
            f"{n_val} validation and {n_test} test blocks and train {world} process(es): use more data or a "
            f"smaller data.seq_len"
        )
    n_train = n_blocks - n_val - n_test
    return Splits(
        train=TokenBlocks(stream, seq_len, 0, n_train),
        val=TokenBlocks(stream, seq_len, n_train + n_test, n_val),
        test=TokenBlocks(stream, seq_len, n_train, n_test),
    )


class TokenStreamSource(DataSource):
    """A source whose blocks are slices of one token stream (``split_stream``); subclasses give ``stream``."""

    def describe(self) -> str:
        """How errors name this source's data."""
        return f"data.source={self.name!r}"

    def stream(self, tokenizer):
        raise NotImplementedError

    def splits(self, tokenizer, rank: int, world: int, endless: bool) -> Splits:
        hp = self.settings
        return split_stream(
            self.stream(tokenizer), hp.seq_len, hp.val_fraction, hp.test_fraction, world, self.describe()
        )
