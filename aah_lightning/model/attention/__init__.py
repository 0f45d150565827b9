"""Attention execution: one backend per module, registered by name, one plan per layer.

Every backend computes the same attention, defined by ``masks.window_mask_mod`` (``0 <= q - kv < W[h]``, documents
optional); they differ in speed and where they run. ``registry.py`` holds the interface (``Backend``, ``Plan``, the ``LayerPlan`` protocol), the
``auto`` rule and the fallbacks, and the plan contract ``GPT.forward`` relies on; ``planner.py`` builds and caches a
plan per layer; ``recording.py`` wraps plans to record q, k, v (the probe). Importing this package imports
every module in it, which registers its backends: adding a kernel is adding one file.
"""

import importlib
import pkgutil

from aah_lightning.model.attention.planner import AttentionPlanner
from aah_lightning.model.attention.recording import Recording
from aah_lightning.model.attention.registry import (
    AUTO_RULES,
    Availability,
    Backend,
    BackendUnavailable,
    HeadGroups,
    LayerPlan,
    Plan,
    backend_names,
    expand_kv,
    get_backend,
    register,
    resolve_backend,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "AUTO_RULES",
    "AttentionPlanner",
    "Availability",
    "Backend",
    "BackendUnavailable",
    "HeadGroups",
    "LayerPlan",
    "Plan",
    "Recording",
    "backend_names",
    "expand_kv",
    "get_backend",
    "register",
    "resolve_backend",
]
