"""The statistics of a suite: mean ± std over seeds, each run's difference to the same seed's baseline run, and
95 % confidence intervals of paired differences (Student's t over seeds: a comparison is called better or worse
only when its interval excludes zero)."""

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


# Two-sided 95 % quantiles of Student's t by degrees of freedom (a table, not scipy: one quantile per comparison).
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131]
_T975 += [2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (beyond 30: a close approximation)."""
    return _T975[df - 1] if df <= len(_T975) else 1.960 + 2.4 / df


def ci95(values: list[float]) -> tuple[float, float, float]:
    """Mean and the 95 % confidence interval ``(low, high)`` of the mean of ``values`` (NaN interval below 2)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def verdict(values: list[float], higher_is_better: bool = False) -> str:
    """``better`` or ``worse`` when the 95 % interval of the mean difference excludes zero, else ``not resolved``."""
    _, low, high = ci95(values)
    if math.isnan(low):
        return "not resolved"
    if high < 0 or low > 0:
        return "better" if (low > 0) == higher_is_better else "worse"
    return "not resolved"


def interval(values: list[float], digits: int = 3) -> str:
    """``+0.012 [−0.004, +0.028]``: the mean difference and its 95 % interval."""
    mean, low, high = ci95(values)
    if math.isnan(mean):
        return "–"
    if math.isnan(low):
        return f"{mean:+.{digits}f}"
    return f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"
