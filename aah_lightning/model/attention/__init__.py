"""Attention execution: one backend per module, registered by name, one plan per layer.

Every backend computes the same attention, defined by ``masks.window_mask_mod`` (``0 <= q - kv < W[h]``, documents
optional); they differ in speed and where they run. ``registry.py`` holds the interface (``Backend``, ``Plan``), the
``auto`` rule and the fallbacks; ``planner.py`` builds and caches a plan per layer. Importing this package imports
every backend module, which registers it.
"""

from aah_lightning.model.attention import banded, flex, sdpa, split, varlen  # noqa: F401  (registers the backends)
from aah_lightning.model.attention.planner import AttentionPlanner
from aah_lightning.model.attention.registry import (
    AUTO_RULES,
    Availability,
    Backend,
    BackendUnavailable,
    Plan,
    backend_names,
    get_backend,
    register,
    resolve_backend,
)

__all__ = [
    "AUTO_RULES",
    "AttentionPlanner",
    "Availability",
    "Backend",
    "BackendUnavailable",
    "Plan",
    "backend_names",
    "get_backend",
    "register",
    "resolve_backend",
]
