"""Progress of a long stage: ``stage``, and the bar of a run it joins.

A stage that can take minutes (the controller's decision at a control step, reading or writing a whole model,
reading, writing or verifying a corpus) runs inside ``with stage(description, total, unit) as s:`` and calls
``s.advance()`` as it goes; code several calls down reaches the innermost stage with ``current()``. Nothing is shown
for the first ``AFTER_S`` seconds, so that a stage that ends sooner stays silent (tests, small models). After that:

* while a run's progress bar is on the screen (``lit/throughput.ProgressBar`` lends its rich ``Progress`` with
  ``lend_bar`` while training runs), the stage is one more task of that bar: a terminal holds one live
  display, and a line written under it would only appear once the stage is over;
* otherwise a tqdm line on stderr: the count (and the rate) where the stage knows its total, else the time elapsed,
  refreshed every half second by a thread of the stage, also while the stage is inside one long call.

Only the process of global rank 0 shows anything (every rank of a distributed run decides the same windows).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any, Optional

# Seconds a stage runs before it is shown.
AFTER_S = 3.0
REFRESH_S = 0.5

_bars: list[Any] = []  # the rich Progress of a run's bar, while it is on the screen (lend_bar)
_stages: list[Stage] = []  # the stages running now, innermost last


def _first_process() -> bool:
    # Lightning's rank of this process, where Lightning runs it (a command that never imported Lightning is one process).
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    return rank_zero is None or getattr(rank_zero.rank_zero_only, "rank", 0) == 0


class _Line:
    """A stage as a tqdm line on stderr."""

    def __init__(self, stage: Stage):
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=stage.total, desc=stage.description, unit=stage.unit, unit_scale=stage.unit == "B",
            initial=stage.done, file=sys.stderr, dynamic_ncols=True, leave=True, mininterval=REFRESH_S,
        )  # fmt: skip
        self.bar.start_t = stage.started  # the stage's time, not the line's: it appears AFTER_S seconds in

    def show(self, done: int, total: Optional[int]) -> None:
        self.bar.total = total
        # Without a total, tqdm's "0it [00:05, ?it/s]" says nothing: the time elapsed instead.
        self.bar.bar_format = None if total is not None else "{desc}: {elapsed}"
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _finite(total: Optional[int]) -> float:
    return float("inf") if total is None else total


class _Task:
    """A stage as a task of the run's rich progress bar."""

    def __init__(self, stage: Stage, bar):
        self.bar = bar
        # Lightning's bar takes an unknown total as infinite (a bar that pulses), not as None.
        self.task = bar.add_task(stage.description, total=_finite(stage.total), completed=stage.done)

    def show(self, done: int, total: Optional[int]) -> None:
        self.bar.update(self.task, completed=done, total=_finite(total))
        self.bar.refresh()

    def close(self) -> None:
        with contextlib.suppress(KeyError):
            self.bar.remove_task(self.task)
        self.bar.refresh()


class Stage:
    """One long stage (``stage`` makes it); ``advance`` counts what is done, ``set_total`` says how much there is."""

    def __init__(self, description: str, total: Optional[int] = None, unit: str = "it", after: Optional[float] = None):
        self.description, self.total, self.unit = description, total, unit
        self.after = AFTER_S if after is None else after
        self.done, self.started = 0, time.time()
        self.shown: _Line | _Task | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def set_total(self, total: Optional[int]) -> None:
        with self._lock:
            self.total = total
            if self.shown is not None:
                self.shown.show(self.done, self.total)

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            if self.shown is not None:
                self.shown.show(self.done, self.total)

    def _show(self) -> None:
        with self._lock:
            self.shown = _Task(self, _bars[-1]) if _bars else _Line(self)
            self.shown.show(self.done, self.total)

    def _run(self) -> None:
        if self.shown is None:
            if self._stop.wait(self.after):  # done before it was worth showing
                return
            self._show()
        while not self._stop.wait(REFRESH_S):  # the time elapsed moves on inside one long call too
            with self._lock:
                self.shown.show(self.done, self.total)

    def start(self) -> Stage:
        if _first_process():
            if self.after <= 0:
                self._show()
            self._thread = threading.Thread(target=self._run, name="aah-progress", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.shown is not None:
            with self._lock:
                self.shown.show(self.done, self.total)
                self.shown.close()


class _Silent(Stage):
    """What ``current()`` gives outside any stage: counts nothing, shows nothing."""

    def advance(self, n: int = 1) -> None:
        pass

    def set_total(self, total: Optional[int]) -> None:
        pass


@contextlib.contextmanager
def stage(description: str, total: Optional[int] = None, unit: str = "it", after: Optional[float] = None):
    """Run the body as a stage named ``description`` (of ``total`` ``unit``s, if known; ``B``: bytes, shown as kB,
    MB, ...), shown once it has taken ``after`` seconds (default ``AFTER_S``; ``math.inf``: never)."""
    s = Stage(description, total, unit, after).start()
    _stages.append(s)
    try:
        yield s
    finally:
        _stages.remove(s)
        s.stop()


def current() -> Stage:
    """The innermost stage running now (one that shows nothing where there is none)."""
    return _stages[-1] if _stages else _Silent("")


def lend_bar(bar) -> None:
    """From now on stages show as tasks of ``bar`` (a rich ``Progress`` on the screen), until ``return_bar``."""
    _bars.append(bar)


def return_bar(bar) -> None:
    with contextlib.suppress(ValueError):
        _bars.remove(bar)
