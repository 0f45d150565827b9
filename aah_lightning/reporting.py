"""Helpers shared by the command-line tools in tools/: reading TensorBoard event files, timing, Markdown tables and
the paired statistics of a suite of runs."""

from __future__ import annotations

import glob
import math
import os
import statistics

import torch

BASELINE = "baseline"  # the suite row every other row is compared with, seed by seed


# -- TensorBoard event files -----------------------------------------------------------------------------------------
def event_files(log_dir: str) -> list[str]:
    """Every events file under ``log_dir``, oldest writer first."""
    paths = glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)
    return sorted(paths, key=events_file_time)


def events_file_time(path: str) -> tuple[float, str]:
    """events.out.tfevents.<unix time>.<host>...: when the writer opened it (ties broken by name)."""
    name = os.path.basename(path)
    try:
        return float(name.split(".")[3]), name
    except (IndexError, ValueError):
        return os.path.getmtime(path), name


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a run. A resumed run has one events file per attempt and re-logs the steps between
    its checkpoint and the interruption: the newest file's value of a step wins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, dict[int, float]] = {}
    for path in event_files(log_dir):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            series.setdefault(tag, {}).update((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(values.items()) for tag, values in series.items()}


# -- statistics of a suite -------------------------------------------------------------------------------------------
def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation of the values that are not NaN (NaN, NaN if none is)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired_diffs(recs: list[dict], base: dict[int, float]) -> list[float]:
    """Each run's val loss minus the same seed's baseline run: the initialisation noise partly cancels."""
    return [x["val_loss"] - base[x["seed"]] for x in recs if x["seed"] in base]


# -- timing and tables -----------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host clock measures it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def md_table(title: str | None, header: list[str], rows: list[list]) -> str:
    """A Markdown table (under a ``### title`` heading when one is given)."""
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
