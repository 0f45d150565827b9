"""The allocators ``model.aah.controller.allocation.allocator`` may name.

An entry is either a plain function ``(LayerInputs) -> list[list[int]]`` (stateless, like ``reach``) or a class with
a ``for_policy(settings, n_layer, candidates, seed)`` constructor and ``state_dict`` / ``load_state_dict`` (its state is
checkpointed with the policy, like ``paper``'s fixed random networks); ``make_allocator`` builds either.
"""

from __future__ import annotations

from collections.abc import Callable

from aah_lightning.windows.controller.allocators import LayerInputs, reach_allocator
from aah_lightning.windows.controller.paper_allocator import PaperAllocator

Allocator = Callable[[LayerInputs], list[list[int]]]

ALLOCATORS: dict[str, Allocator | type] = {"reach": reach_allocator, "paper": PaperAllocator}


def make_allocator(settings, n_layer: int, candidates: list[int], seed: int) -> Allocator:
    """The allocator ``settings.allocator`` names, built for a policy of ``n_layer`` layers (seeded by ``seed``)."""
    entry = ALLOCATORS[settings.allocator]
    return entry.for_policy(settings, n_layer, candidates, seed) if isinstance(entry, type) else entry
