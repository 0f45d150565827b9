"""Data sources, one module each, registered by name (``data.source``); the contract is in ``base.py``."""

from aah_lightning.data.sources.base import (
    DataSource,
    Splits,
    TokenStreamSource,
    get_source,
    is_stream,
    is_text,
    register_source,
    source_names,
    split_stream,
)

# isort: off
# The built-in sources register in this order (the order error messages list them in).
from aah_lightning.data.sources import text, tokens, hub, synthetic, recall  # noqa: F401
# isort: on

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
