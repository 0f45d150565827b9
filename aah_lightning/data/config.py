"""Settings of the data (the ``data`` block of a config): what every source shares, and one block per source.

``DataConfig`` is what the data module hands whole to its source (``data/sources/base.py``) and to the data position.
The shared settings (``source``, ``seq_len``, batch sizes, the held-out shares, the tokenizer, the seed) sit at the top
of ``data``; what only one source reads sits in that source's block: ``data.files``, ``data.tokens``, ``data.hub``,
``data.synthetic``, ``data.recall`` (also read when ``data.recall.fraction`` mixes recall blocks into a text source),
and ``data.plugin``, a free mapping for a source registered outside the package.

The flat keys of earlier versions (``data.recall_keys``, ``data.paths``, ...) still work, each with one deprecation line
naming the key that replaces it (``FLAT_DATA_SETTINGS``), all moved in one place (``with_flat_settings``, which the
data module hands them to); checkpoints that saved them are read nested (``nest_data_settings``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Optional

from aah_lightning.errors import ConfigError, move_flat_setting, require


@dataclass
class FilesConfig:
    """Settings of ``data.source: files`` (``data.files``).

    Attributes:
        paths: files or glob patterns (.txt, .jsonl/.json, .parquet).
        text_field: the text column of json/parquet files.
    """

    paths: Optional[list[str]] = None
    text_field: str = "text"


@dataclass
class TokensConfig:
    """Settings of ``data.source: tokens`` (``data.tokens``).

    Attributes:
        path: the token folder (written by aah-prepare).
    """

    path: Optional[str] = None


@dataclass
class HubConfig:
    """Settings of ``data.source: hub``, a streamed Hugging Face dataset (``data.hub``).

    Attributes:
        name: the dataset's name on the hub.
        config: its configuration (subset), if it has several.
        split: the split to read.
        text_field: the text column.
    """

    name: Optional[str] = None
    config: Optional[str] = None
    split: str = "train"
    text_field: str = "text"


@dataclass
class SyntheticConfig:
    """Settings of ``data.source: synthetic``, copies at one distance (``data.synthetic``).

    Attributes:
        documents: number of documents.
        vocab: symbols of the synthetic language.
        distance: the long-range copy distance; default seq_len // 2.
    """

    documents: int = 2000
    vocab: int = 64
    distance: Optional[int] = None


@dataclass
class RecallConfig:
    """Settings of the recall task (``data.recall``): ``data.source: recall``, or recall blocks mixed into a text source.

    Attributes:
        keys: keys of the task (at least the slots of a sequence would need: a key is bound once per sequence).
        values: values of the task (chance accuracy is 1 / values).
        gaps: how far a key comes back, in 3-token slots (in tokens for the relay task): mix (half log-uniform, half
            uniform over the sequence), uniform or loguniform.
        blocks: training sequences of source=recall (generated on demand: none is stored); validation and test use
            data.val_blocks / data.test_blocks sequences of their own.
        fraction: with a text source (stdlib, files, tokens): this share of the training, validation and test blocks
            are recall sequences, with ids above the tokenizer's (0 = none).
        task: mqar (multi-query associative recall), copy (every token after the first copy_distance repeats the
            one that far back) or relay (values bound to the key relay_gap tokens after them, each key queried once;
            with windows of 2 only a layer at depth >= relay_gap can hold the retrieval head); data/recall.py.
        copy_distance: the copy task's distance; default 5/8 of seq_len (160 at T = 256: only a window wider than
            T/2 reaches it).
        relay_gap: the relay task's distance from a bound value to its key (the value must be carried forward that
            far before a query can read it at its key).
    """

    keys: int = 32
    values: int = 16
    gaps: Literal["mix", "uniform", "loguniform"] = "mix"
    blocks: int = 1_000_000
    fraction: float = 0.0
    task: Literal["mqar", "copy", "relay"] = "mqar"
    copy_distance: Optional[int] = None
    relay_gap: int = 2

    def check(self, seq_len: int) -> None:
        """Refuse a bad recall setting in one line naming it (``seq_len``: ``data.seq_len``, already checked)."""
        from aah_lightning.data.recall import GAPS, TASKS  # numpy and torch: only when a data module is built

        require(self.gaps in GAPS, "data.recall.gaps", self.gaps, f"one of {', '.join(GAPS)}")
        require(isinstance(self.values, int) and self.values >= 2, "data.recall.values", self.values, ">= 2")
        require(isinstance(self.blocks, int) and self.blocks >= 1, "data.recall.blocks", self.blocks, ">= 1")
        require(self.task in TASKS, "data.recall.task", self.task, f"one of {', '.join(TASKS)}")
        distance = self.copy_distance
        require(
            distance is None or (isinstance(distance, int) and 0 < distance < seq_len),
            "data.recall.copy_distance",
            distance,
            f"None (5/8 of data.seq_len) or an integer in [1, data.seq_len={seq_len})",
        )
        if self.task == "relay":
            gap = self.relay_gap
            require(
                isinstance(gap, int) and 1 <= gap <= seq_len // 8,
                "data.recall.relay_gap",
                gap,
                f"an integer in [1, data.seq_len/8={seq_len // 8}]",
            )
        slots = -(-(seq_len + 1) // 3)
        require(
            isinstance(self.keys, int) and self.keys >= 2,
            "data.recall.keys",
            self.keys,
            f">= 2 (a sequence of data.seq_len={seq_len} has {slots} slots; fewer keys than slots make keys come "
            f"back early)",
        )


BLOCKS = {
    "files": FilesConfig,
    "tokens": TokensConfig,
    "hub": HubConfig,
    "synthetic": SyntheticConfig,
    "recall": RecallConfig,
}

# Each flat key of earlier versions -> the (block, key) settings it now sets.
FLAT_DATA_SETTINGS: dict[str, tuple[tuple[str, str], ...]] = {
    "paths": (("files", "paths"),),
    "text_field": (("files", "text_field"), ("hub", "text_field")),
    "path": (("tokens", "path"),),
    "hub_name": (("hub", "name"),),
    "hub_config": (("hub", "config"),),
    "hub_split": (("hub", "split"),),
    "synthetic_documents": (("synthetic", "documents"),),
    "synthetic_vocab": (("synthetic", "vocab"),),
    "synthetic_distance": (("synthetic", "distance"),),
    **{f"recall_{key}": (("recall", key),) for key in ("keys", "values", "gaps", "blocks", "fraction", "task")},
    "recall_copy_distance": (("recall", "copy_distance"),),
}


@dataclass
class DataConfig:
    """Every ``data.*`` setting; the arguments of ``TextDataModule`` (lit/datamodule.py) say what each one means."""

    source: str = "stdlib"
    seq_len: int = 256
    batch_size: int = 16
    global_batch_size: Optional[int] = None
    tokenizer: str = "byte"
    val_fraction: float = 0.02
    test_fraction: float = 0.01
    val_blocks: int = 64
    test_blocks: int = 64
    max_documents: Optional[int] = None
    num_workers: int = 0
    num_proc: Optional[int] = None
    seed: int = 1234
    cache_dir: Optional[str] = None
    prompts: Optional[str] = None
    files: FilesConfig = field(default_factory=FilesConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    recall: RecallConfig = field(default_factory=RecallConfig)
    plugin: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name, cls in BLOCKS.items():
            block = getattr(self, name)
            if block is None:
                setattr(self, name, cls())
            elif isinstance(block, Mapping):  # a plain dict: a checkpoint's hyperparameters, or Python callers
                setattr(self, name, block_from_dict(name, block))
        if self.plugin is None:
            self.plugin = {}

    @classmethod
    def from_arguments(cls, flat: Mapping[str, Any], **settings) -> DataConfig:
        """The settings, with the deprecated flat keys of ``flat`` (those not None) moved into their blocks: one
        deprecation line for each, and a ConfigError where a flat key and its nested key are both set."""
        return _moved(cls(**settings), flat, stacklevel=2)  # _moved, this method, its caller

    def validate(self) -> None:
        """The settings every source shares, and the recall block (any text source may mix it in), each refused in one
        line naming it; a source checks its own block."""
        require(isinstance(self.seq_len, int) and self.seq_len > 0, "data.seq_len", self.seq_len, "a positive integer")
        require(
            isinstance(self.batch_size, int) and self.batch_size > 0,
            "data.batch_size",
            self.batch_size,
            "a positive integer",
        )
        gbs = self.global_batch_size
        require(
            gbs is None or (isinstance(gbs, int) and gbs > 0),
            "data.global_batch_size",
            gbs,
            "a positive integer (a multiple of data.batch_size x world size), or null",
        )
        val, test = self.val_fraction, self.test_fraction
        require(0.0 < val < 1.0, "data.val_fraction", val, "a number in (0, 1)")
        require(
            0.0 <= test < 1.0 - val, "data.test_fraction", test, f"a number in [0, 1 - data.val_fraction={1 - val:g})"
        )
        require(
            isinstance(self.val_blocks, int) and self.val_blocks >= 1,
            "data.val_blocks",
            self.val_blocks,
            "a positive number of held-out blocks (to train without validation, set trainer.limit_val_batches=0)",
        )
        require(
            isinstance(self.test_blocks, int) and self.test_blocks >= 0,
            "data.test_blocks",
            self.test_blocks,
            ">= 0",
        )
        require(
            self.num_proc is None or self.num_proc >= 1,
            "data.num_proc",
            self.num_proc,
            "a positive integer, or null",
        )
        # The recall block is checked whatever the source: a text source may mix it in, and the checks are cheap.
        self.recall.check(self.seq_len)

    def settings(self) -> dict:
        """The settings as plain dicts (what a checkpoint saves: it loads with ``torch.load(weights_only=True)``)."""
        return asdict(self)


def _moved(config: DataConfig, flat: Mapping[str, Any], stacklevel: int) -> DataConfig:
    """``config`` with the flat keys of ``flat`` that are set moved into their blocks (``stacklevel``: frames above
    this one to the line the deprecation names)."""
    for key, value in flat.items():
        if value is None:
            continue
        targets = [
            (block, getattr(config, block), name, getattr(BLOCKS[block](), name))
            for block, name in FLAT_DATA_SETTINGS[key]
        ]
        move_flat_setting("data", key, value, targets, stacklevel=stacklevel + 1)
    return config


def with_flat_settings(
    config: DataConfig,
    /,
    *,
    paths: Optional[list[str]] = None,
    path: Optional[str] = None,
    text_field: Optional[str] = None,
    hub_name: Optional[str] = None,
    hub_config: Optional[str] = None,
    hub_split: Optional[str] = None,
    synthetic_documents: Optional[int] = None,
    synthetic_vocab: Optional[int] = None,
    synthetic_distance: Optional[int] = None,
    recall_keys: Optional[int] = None,
    recall_values: Optional[int] = None,
    recall_gaps: Optional[str] = None,
    recall_blocks: Optional[int] = None,
    recall_fraction: Optional[float] = None,
    recall_task: Optional[str] = None,
    recall_copy_distance: Optional[int] = None,
) -> DataConfig:
    """``config`` with the deprecated flat keys of the data module moved into their blocks, one deprecation line
    each (the line of the code that built the data module). ``TextDataModule`` hands its ``**deprecated`` here, so
    the command line and YAML still take ``data.recall_keys`` and the rest: jsonargparse reads these parameters.

    Args:
        paths: deprecated, now files.paths.
        path: deprecated, now tokens.path.
        text_field: deprecated, now files.text_field and hub.text_field.
        hub_name: deprecated, now hub.name.
        hub_config: deprecated, now hub.config.
        hub_split: deprecated, now hub.split.
        synthetic_documents: deprecated, now synthetic.documents.
        synthetic_vocab: deprecated, now synthetic.vocab.
        synthetic_distance: deprecated, now synthetic.distance.
        recall_keys: deprecated, now recall.keys.
        recall_values: deprecated, now recall.values.
        recall_gaps: deprecated, now recall.gaps.
        recall_blocks: deprecated, now recall.blocks.
        recall_fraction: deprecated, now recall.fraction.
        recall_task: deprecated, now recall.task.
        recall_copy_distance: deprecated, now recall.copy_distance.
    """
    flat = {
        "paths": paths,
        "path": path,
        "text_field": text_field,
        "hub_name": hub_name,
        "hub_config": hub_config,
        "hub_split": hub_split,
        "synthetic_documents": synthetic_documents,
        "synthetic_vocab": synthetic_vocab,
        "synthetic_distance": synthetic_distance,
        "recall_keys": recall_keys,
        "recall_values": recall_values,
        "recall_gaps": recall_gaps,
        "recall_blocks": recall_blocks,
        "recall_fraction": recall_fraction,
        "recall_task": recall_task,
        "recall_copy_distance": recall_copy_distance,
    }
    return _moved(config, flat, stacklevel=3)  # _moved, this function, TextDataModule.__init__, its caller


def block_from_dict(name: str, values: Mapping[str, Any]):
    """A source's block from a mapping, refusing a key the block does not have in one line."""
    cls = BLOCKS[name]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"data.{name}.{unknown[0]} is not a setting: data.{name} takes {', '.join(sorted(known))}")
    return cls(**values)


def nest_data_settings(saved: Mapping[str, Any]) -> dict:
    """Data settings of any layout (a checkpoint's, a config's ``data`` block) with the flat keys of earlier
    versions moved into their blocks, silently (the layout was right when it was written)."""
    data = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in saved.items()}
    for key, targets in FLAT_DATA_SETTINGS.items():
        if key not in data:
            continue
        value = data.pop(key)
        for block, name in targets if value is not None else ():
            data[block] = {**(data.get(block) or {}), name: value}
    return data
