"""The window policies by name: ``@register("name")`` makes a class selectable as ``model.aah.policy: name``.

Built-in policies live in the modules of ``BUILTIN_MODULES``, imported the first time a name is looked up. A policy
outside this package is one importable module: ``model.aah.policy: my_module:name`` imports ``my_module`` (whose
``@register("name")`` runs on import) and uses ``name``. This module imports nothing of the policies or of their
settings, so that the settings (``config.py``) can look a policy up and the contract (``policy_base.py``) can name the
settings' type without an import circle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from aah_lightning.plugins import find_plugin

BUILTIN_MODULES = (
    "aah_lightning.windows.policies",  # full, fixed, static, random
    "aah_lightning.windows.controller.adaptive",  # adaptive: the AAH controller
    "aah_lightning.windows.shuffle",  # shuffle: the controller's table permuted per layer
    "aah_lightning.windows.span",  # learned_span: a learned soft span per head, then hard windows
)

POLICIES: dict[str, type] = {}  # name -> a WindowPolicy subclass

P = TypeVar("P", bound=type)


def register(name: str) -> Callable[[P], P]:
    """Class decorator: make the policy selectable as ``model.aah.policy: name``."""

    def add(cls: P) -> P:
        if name in POLICIES and POLICIES[name] is not cls:
            raise ValueError(f"two window policies are registered as {name!r}: {POLICIES[name]} and {cls}")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return add


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def available_policies() -> dict[str, type]:
    """Every registered policy by name (the built-in ones and any imported plugin)."""
    _load_builtins()
    return dict(POLICIES)


def policy_class(name: str) -> type:
    """The class ``model.aah.policy`` names: a registered name, or ``module:name`` of a policy in another module."""
    if name not in POLICIES:
        _load_builtins()
    return find_plugin(POLICIES, name, "model.aah.policy", "policy", names=lambda: sorted(POLICIES))
