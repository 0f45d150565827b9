"""Settings of the window policy (the ``model.aah`` block of a config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from aah_lightning.errors import ConfigError, require


@dataclass
class AAHConfig:
    """Which policy writes the window table, and its settings.

    policy: ``full`` (every head W = T), ``fixed`` (every head ``window``), ``static`` (explicit ``table``),
        ``random`` (seeded draw from ``candidates``).
    candidates: the window sizes a policy may choose from, ascending; default ``[T/8, T/4, T/2, T]``.
    window: the window of the ``fixed`` policy.
    table: the ``static`` policy's windows, one list of ``n_head`` ints per layer.
    seed: seed of the ``random`` policy.
    redraw_interval: ``random`` redraws every this many steps (0 = draw once at the start).
    """

    policy: str = "full"
    candidates: Optional[list[int]] = None
    window: Optional[int] = None
    table: Optional[list[list[int]]] = None
    seed: int = 0
    redraw_interval: int = 0

    def resolved_candidates(self, seq_len: int) -> list[int]:
        if self.candidates is None:
            return sorted({max(1, seq_len // 8), max(1, seq_len // 4), max(1, seq_len // 2), seq_len})
        return list(self.candidates)

    def validate(self, seq_len: int, n_layer: int, n_head: int) -> None:
        from aah_lightning.aah.policies import POLICIES

        require(self.policy in POLICIES, "model.aah.policy", self.policy, f"one of {', '.join(sorted(POLICIES))}")
        cands = self.resolved_candidates(seq_len)
        require(len(cands) > 0, "model.aah.candidates", self.candidates, "a non-empty list of window sizes")
        for c in cands:
            require(
                isinstance(c, int) and 0 < c <= seq_len,
                "model.aah.candidates",
                self.candidates,
                f"every window an integer in [1, seq_len={seq_len}] (bad entry {c!r})",
            )
        require(cands == sorted(set(cands)), "model.aah.candidates", self.candidates, "ascending, without repeats")
        if self.policy == "fixed":
            require(
                isinstance(self.window, int) and 0 < self.window <= seq_len,
                "model.aah.window",
                self.window,
                f"an integer in [1, seq_len={seq_len}] (the fixed policy's window)",
            )
        if self.policy == "static":
            table = self.table
            shape_ok = (
                isinstance(table, list)
                and len(table) == n_layer
                and all(isinstance(row, list) and len(row) == n_head for row in table)
            )
            if not shape_ok:
                got = None if table is None else [len(r) if isinstance(r, list) else r for r in table]
                raise ConfigError(
                    f"model.aah.table has row lengths {got}: the static policy needs n_layer={n_layer} rows of "
                    f"n_head={n_head} windows each"
                )
            for row in table:
                for w in row:
                    require(
                        isinstance(w, int) and 0 < w <= seq_len,
                        "model.aah.table",
                        w,
                        f"every window an integer in [1, seq_len={seq_len}]",
                    )
        require(self.redraw_interval >= 0, "model.aah.redraw_interval", self.redraw_interval, "0 (draw once) or more")
