"""The statistics of a suite: mean ± std over seeds, each run's difference to the same seed's baseline run, and
95 % confidence intervals of paired differences (Student's t over seeds: a comparison is called better or worse
only when its interval excludes zero), and the exact tests for outcomes that are bimodal: Clopper-Pearson intervals
of the share of seeds that learned, Fisher's exact test of two such counts, the sign test and the paired permutation
test of per-seed differences, and Holm's correction across a table's comparisons (``protocol.py`` uses them)."""

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


# -- Exact tests, for outcomes that are bimodal (a seed learns the task or it does not) -------------------------------
# Plain Python, no scipy: a handful of comparisons per table, each a short exact sum (the tests check them against
# scipy where it is installed).


def _binom_pmf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 1.0 if k == 0 else 0.0
    if p >= 1.0:
        return 1.0 if k == n else 0.0
    return math.comb(n, k) * p**k * (1 - p) ** (n - k)


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    return min(1.0, sum(_binom_pmf(i, n, p) for i in range(0, k + 1)))


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a success probability from ``k`` successes in ``n`` trials: the
    ``p`` where the observed count sits at each tail's ``(1 - level) / 2`` (bisection on the binomial sums)."""
    if n <= 0:
        return math.nan, math.nan
    alpha = (1 - level) / 2

    def solve(f, lo=0.0, hi=1.0) -> float:  # f increasing in p, root in [lo, hi]
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
        return (lo + hi) / 2

    low = 0.0 if k == 0 else solve(lambda p: (1 - _binom_cdf(k - 1, n, p)) - alpha)  # P(X >= k | p) = alpha
    high = 1.0 if k == n else solve(lambda p: alpha - _binom_cdf(k, n, p))  # P(X <= k | p) = alpha
    return low, high


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p-value of Fisher's exact test of the 2x2 table ``[[a, b], [c, d]]`` (rows: the two arms; columns:
    learned, did not): the probability, with the margins fixed, of every table at most as likely as the observed one
    (the usual rule, with a relative tolerance for ties in floating point)."""
    row1, col1, n = a + b, a + c, a + b + c + d
    lo, hi = max(0, col1 - (n - row1)), min(row1, col1)

    def prob(x: int) -> float:
        return math.comb(col1, x) * math.comb(n - col1, row1 - x) / math.comb(n, row1)

    observed = prob(a)
    return min(1.0, sum(p for p in (prob(x) for x in range(lo, hi + 1)) if p <= observed * (1 + 1e-7)))


def sign_test(diffs: list[float]) -> float:
    """Two-sided exact sign test of paired differences (zeros dropped): ``2 * P(X <= min(#pos, #neg))``,
    X ~ Binomial(n, 1/2); 1.0 when every difference is zero."""
    pos, neg = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    n = pos + neg
    if n == 0:
        return 1.0
    return min(1.0, 2 * _binom_cdf(min(pos, neg), n, 0.5))


def paired_permutation_test(diffs: list[float], exact_up_to: int = 20, draws: int = 200_000, seed: int = 0) -> float:
    """Two-sided permutation (sign-flip) test of the mean of paired differences: the share of the ``2^n`` sign
    assignments whose mean is at least as far from 0 as the observed one. Exact up to ``exact_up_to`` pairs, beyond
    that a seeded Monte Carlo estimate (``draws`` assignments, counting the observed one)."""
    import random

    values = [d for d in diffs if not math.isnan(d)]
    n = len(values)
    if n == 0:
        return 1.0
    observed = abs(sum(values)) * (1 - 1e-12)
    if n <= exact_up_to:
        hits = 0
        for mask in range(1 << n):
            total = sum(-v if (mask >> i) & 1 else v for i, v in enumerate(values))
            hits += abs(total) >= observed
        return hits / (1 << n)
    rng = random.Random(seed)
    hits = 1 + sum(abs(sum(v if rng.random() < 0.5 else -v for v in values)) >= observed for _ in range(draws))
    return hits / (draws + 1)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment (family-wise error): the i-th smallest p times ``(m - i)``, made monotone and
    capped at 1, returned in the input's order. NaN p-values are left out of the family and stay NaN."""
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m, out, running = len(order), [math.nan] * len(pvalues), 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out
