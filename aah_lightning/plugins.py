"""Finding a plugin by the name a setting gives it.

Data sources and window policies are registered by name (``register_source``, ``register``). A setting may also
name one that lives outside the package as ``module:name``: the module is imported (which registers its plugins)
and ``name`` is then looked up. Both registries resolve names here, so both accept and refuse the same way.
"""

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from aah_lightning.errors import ConfigError

T = TypeVar("T")


def find_plugin(
    registry: Mapping[str, T],
    name: str,
    setting: str,
    kind: str,
    names: Callable[[], Iterable[str]] | None = None,
) -> T:
    """The entry of ``registry`` that ``name`` (the value of ``setting``) names, or one ``ConfigError`` line.

    ``kind`` says what is registered ("data source", "policy"); ``names`` lists the choices for the error
    (default: the registry's names in registration order)."""
    if name in registry:
        return registry[name]
    if isinstance(name, str) and ":" in name:
        module, _, short = name.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"{setting}={name!r}: cannot import module {module!r} ({e})") from None
        if short in registry:
            return registry[short]
        raise ConfigError(f"{setting}={name!r}: module {module!r} registers no {kind} named {short!r}")
    choices = ", ".join(names() if names else registry)
    raise ConfigError(
        f"{setting}={name!r} is not allowed: one of {choices} (or module:name of a {kind} registered in an "
        f"importable module)"
    )
