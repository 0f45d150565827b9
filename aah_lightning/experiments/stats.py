"""The statistics of a suite: mean ± std over seeds, and each run's difference to the same seed's baseline run."""

from __future__ import annotations

import math
import statistics

BASELINE = "baseline"  # the suite row every other row is compared with, seed by seed


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation of the values that are not NaN (NaN, NaN if none is)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired_diffs(recs: list[dict], base: dict[int, float]) -> list[float]:
    """Each run's val loss minus the same seed's baseline run: the initialisation noise partly cancels."""
    return [x["val_loss"] - base[x["seed"]] for x in recs if x["seed"] in base]


def baseline_by_seed(by_row: dict[str, list[dict]], key: str) -> dict[int, float]:
    """The baseline's value of ``key`` per seed, to pair every other row's runs with."""
    return {x["seed"]: x.get(key, math.nan) for x in by_row.get(BASELINE, [])}


def mean_curve(series: list[list[tuple[int, float]]]) -> tuple[list[int], list[float]]:
    """The mean over seeds at each step that every seed logged. A run stopped with its machine can lose the validation
    point after its last checkpoint (not yet on disk; the resume starts after it): that must not bend the mean."""
    per_step: dict[int, list[float]] = {}
    for one in series:
        for step, value in one:
            per_step.setdefault(step, []).append(value)
    steps = sorted(s for s, values in per_step.items() if len(values) == len(series))
    return steps, [statistics.fmean(per_step[s]) for s in steps]
