"""Data sources, one module each, registered by name (``data.source``); the contract is in ``base.py``."""

from aah_lightning.data.sources.base import (
    DataSource,
    Splits,
    TokenStreamSource,
    is_stream,
    is_text,
    mixable_names,
    register_source,
    source_class,
    source_names,
    split_stream,
)
from aah_lightning.errors import require

# isort: off
# The built-in sources register in this order (the order error messages list them in).
from aah_lightning.data.sources import text, tokens, hub, synthetic, recall  # noqa: F401

# isort: on
from aah_lightning.data.sources.recall import RecallMix  # noqa: E402


def get_source(name: str, recall_fraction: float = 0.0) -> type[DataSource]:
    """The class ``data.source`` names (``source_class``). With ``recall_fraction`` (``data.recall.fraction``) above
    0: the recall mix (``sources/recall.py``: ``RecallMix``), a source that wraps the named one and puts that share of
    recall blocks in each of its splits; only a ``mixable`` source can be wrapped. It lives here, beside every
    source, so that the contract's module imports none of them."""
    cls = source_class(name)
    mixable = mixable_names()
    require(
        0.0 <= recall_fraction < 1.0 and (recall_fraction == 0 or cls.mixable),
        "data.recall.fraction",
        recall_fraction,
        f"in [0, 1), and above 0 only with data.source {', '.join(mixable[:-1])} or {mixable[-1]}",
    )
    return cls if recall_fraction == 0 else RecallMix


__all__ = [
    "DataSource",
    "Splits",
    "TokenStreamSource",
    "get_source",
    "is_stream",
    "is_text",
    "register_source",
    "source_names",
    "split_stream",
]
