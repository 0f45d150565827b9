"""The exact tests of experiments/stats.py, against hand-computed values and scipy's, and protocol.md built from
constructed records."""

import math
import os
import random

import pytest
from scipy import stats as scipy_stats

from aah_lightning.experiments import protocol, stats


def test_hand_computed_values():
    # Fisher: [[5, 0], [0, 5]]: only the observed and the mirror table are as extreme, each 1 / C(10, 5).
    assert math.isclose(stats.fisher_exact(5, 0, 0, 5), 2 / math.comb(10, 5))
    assert stats.fisher_exact(3, 2, 3, 2) == pytest.approx(1.0)
    # Sign test: 5 of 5 positive, two-sided: 2 / 32; zeros do not count.
    assert math.isclose(stats.sign_test([1, 2, 3, 4, 5]), 0.0625)
    assert math.isclose(stats.sign_test([1, 2, 3, 4, 5, 0, 0]), 0.0625)
    assert stats.sign_test([0, 0]) == 1.0
    # Permutation: all 5 positive and distinct: only the observed and its mirror reach |sum| = 15 of 32 flips.
    assert math.isclose(stats.paired_permutation_test([1, 2, 3, 4, 5]), 2 / 32)
    # Clopper-Pearson at the edges: 0 of n has the upper bound 1 - (alpha/2)^(1/n); n of n the mirror.
    low, high = stats.clopper_pearson(0, 10)
    assert low == 0.0 and math.isclose(high, 1 - 0.025 ** (1 / 10), rel_tol=1e-9)
    low, high = stats.clopper_pearson(10, 10)
    assert high == 1.0 and math.isclose(low, 0.025 ** (1 / 10), rel_tol=1e-9)
    # Holm: sorted p times (m - rank), monotone, capped, in the input's order; NaN stays out of the family.
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    out = stats.holm([0.2, math.nan, 0.6])
    assert out[0] == pytest.approx(0.4) and math.isnan(out[1]) and out[2] == pytest.approx(0.6)


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (7, 10), (10, 10), (9, 20), (1, 5)])
def test_clopper_pearson_equals_scipy(k, n):
    want = scipy_stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    got = stats.clopper_pearson(k, n)
    assert got == pytest.approx((want.low, want.high), abs=1e-9)


def test_fisher_sign_and_permutation_equal_scipy():
    rng = random.Random(0)
    for _ in range(30):
        n1, n2 = rng.randint(1, 20), rng.randint(1, 20)
        a, c = rng.randint(0, n1), rng.randint(0, n2)
        want = scipy_stats.fisher_exact([[a, n1 - a], [c, n2 - c]]).pvalue
        assert stats.fisher_exact(a, n1 - a, c, n2 - c) == pytest.approx(want, rel=1e-9)
    for _ in range(10):
        diffs = [rng.choice([-1, 1]) * rng.random() for _ in range(rng.randint(3, 12))]
        pos = sum(d > 0 for d in diffs)
        assert stats.sign_test(diffs) == pytest.approx(scipy_stats.binomtest(pos, len(diffs)).pvalue, rel=1e-9)
        want = scipy_stats.permutation_test(
            (diffs,), lambda x: sum(x), permutation_type="samples", n_resamples=math.inf
        ).pvalue
        assert stats.paired_permutation_test(diffs) == pytest.approx(want, rel=1e-9)


def records(row: str, recalls: list[float], far: float = 1.0) -> list[dict]:
    return [
        {"row": row, "seed": s, "recall_acc": r, "recall 1-32": r, "recall 225-256": far if r >= 0.9 else 0.1}
        for s, r in enumerate(recalls)
    ]


def test_protocol_calls_better_only_what_survives_holm():
    """10 of 10 learned against 0 of 10 survives Holm over the table; 6 of 10 against 3 of 10 does not."""
    by_row = {
        "fixed_acr0.25": records("fixed_acr0.25", [0.1] * 10),
        "fixed_warm_acr0.25": records("fixed_warm_acr0.25", [0.1] * 10),
        "adaptive_model_acr0.25": records("adaptive_model_acr0.25", [0.1] * 9 + [1.0]),
        "reach_mass_acr0.25": records("reach_mass_acr0.25", [1.0] * 10),
        "random_l1_acr0.25": records("random_l1_acr0.25", [1.0] * 6 + [0.1] * 4),
        "oracle_acr0.25": records("oracle_acr0.25", [1.0] * 10),
    }
    heads = {("reach_mass_acr0.25", s): {"final_table": [[16, 16, 16, 16], [256, 64, 32, 32]]} for s in range(10)}
    rows = list(by_row)
    md = protocol.protocol_md(by_row, rows, heads)
    cells = [line.split(" | ") for line in md.splitlines() if line.startswith("| ")]
    lines = {c[0].strip("| ") + " vs " + c[1]: " | ".join(c) for c in cells if len(c) > 1}
    assert lines["reach_mass_acr0.25 vs fixed_acr0.25"].endswith("better |")  # no warmup: plain fixed
    assert lines["reach_mass_acr0.25 vs oracle_acr0.25"].endswith("not resolved |")
    assert lines["oracle_acr0.25 vs fixed_acr0.25"].endswith("better |")
    assert "adaptive_model_acr0.25 vs fixed_warm_acr0.25" in lines  # 50 full-context steps: the matched control
    assert "adaptive_model_acr0.25 vs fixed_acr0.25" not in lines
    assert lines["adaptive_model_acr0.25 vs oracle_acr0.25"].endswith("worse |")
    assert "| reach_mass_acr0.25 | all | 10/10 | [0.69, 1.00] |" in md
    assert "L1 10" in md  # the long head's layer, from the final tables
    assert "| reach_mass_acr0.25 | 0: [16,16,16,16] [256,64,32,32] · 1: " in md  # the tables themselves
    # 6/10 vs 0/10: Fisher p = 0.011, which Holm over the table's 21 p-values lifts above 0.05.
    assert lines["random_l1_acr0.25 vs fixed_acr0.25"].endswith("not resolved |")
    assert "fixed_warm_acr0.25 vs fixed_acr0.25" not in lines


def test_learned_is_judged_within_the_reach_the_budget_can_buy():
    """At a budget whose oracle holds at most 128 tokens, a seed that recalls everything within 128 (and nothing
    past it) learned; one that recalls only within 64 did not. Without an oracle row every distance counts."""
    near = {"recall 1-64": 1.0, "recall 65-128": 0.95, "recall 129-192": 0.06, "recall 193-256": 0.05}
    short = {"recall 1-64": 1.0, "recall 65-128": 0.06, "recall 129-192": 0.06, "recall 193-256": 0.05}

    def recs(row, shape, n):
        return [{"row": row, "seed": s, "recall_acc": sum(shape.values()) / 4, **shape} for s in range(n)]

    by_row = {
        "fixed_acr0.125": recs("fixed_acr0.125", short, 10),
        "oracle_acr0.125": recs("oracle_acr0.125", near, 10),
        "reach_gain_acr0.125": recs("reach_gain_acr0.125", near, 10),
    }
    heads = {("oracle_acr0.125", s): {"final_table": [[16, 16, 16, 16], [128, 32, 16, 16]]} for s in range(10)}
    assert protocol.reach(by_row, heads) == {r: 128 for r in by_row}
    assert protocol.learned(by_row["oracle_acr0.125"][0], 128)
    assert not protocol.learned(by_row["oracle_acr0.125"][0], None)  # overall recall 0.515
    assert not protocol.learned(by_row["fixed_acr0.125"][0], 128)
    md = protocol.protocol_md(by_row, list(by_row), heads)
    assert "| reach_gain_acr0.125 | 128 | 10/10 |" in md
    assert "| fixed_acr0.125 | 128 | 0/10 |" in md
    lines = [line for line in md.splitlines() if line.startswith("| reach_gain_acr0.125 | fixed_acr0.125 |")]
    assert lines and lines[0].endswith("better |")
    assert protocol.reach(by_row, {}) == {r: None for r in by_row}


def test_rows_run_on_different_seeds_are_compared_by_their_counts_alone():
    """Seeds 10-19 of one row against seeds 0-9 of another: Fisher's test of the counts, no paired difference."""
    later = [dict(r, seed=r["seed"] + 10) for r in records("span_acr0.25", [1.0] * 10)]
    by_row = {"span_acr0.25": later, "fixed_acr0.25": records("fixed_acr0.25", [0.1] * 10)}
    md = protocol.protocol_md(by_row, list(by_row), {})
    line = next(x for x in md.splitlines() if x.startswith("| span_acr0.25 | fixed_acr0.25 |"))
    assert "| 10/10 vs 0/10 | – (no seed run by both) |" in line and "nan" not in line
    assert line.endswith("better |")  # Fisher alone: 1.1e-05 against one family of one test


def test_placement_chance_counts_every_placement():
    """The chance that a random placement puts the widest window in the oracle's layer, against brute force over
    every permutation of the heads (each distinct placement is equally likely under a uniform permutation)."""
    import itertools

    for table in ([[32, 32, 32, 32], [256, 64, 32, 32]], [[16, 128], [128, 16], [16, 16]], [[8, 8, 8], [8, 64, 8]]):
        flat = [w for row in table for w in row]
        width = len(table[0])
        widest = max(flat)
        good = {i for i, row in enumerate(table) if widest in row}
        perms = list(itertools.permutations(flat))
        hits = sum(any(widest in p[layer * width : (layer + 1) * width] for layer in good) for p in perms)
        assert protocol.placement_chance(table) == pytest.approx(hits / len(perms), abs=1e-12)
    assert protocol.placement_chance([[32, 32, 32, 32], [256, 64, 32, 32]]) == pytest.approx(0.5)


def test_controller_rows_are_compared_with_fair_chance_and_the_chance_is_printed():
    """random_any (the oracle's windows anywhere) is every controller row's fair-chance control; the protocol prints
    the exact chance of a right placement beside how often the row's own draws got it."""
    oracle = [[32, 32, 32, 32], [256, 64, 32, 32]]
    any_tables = [[[32, 256, 32, 32], [64, 32, 32, 32]], [[32, 32, 64, 32], [32, 32, 256, 32]]]
    by_row = {
        "fixed_acr0.25": records("fixed_acr0.25", [0.1] * 10),
        "oracle_acr0.25": records("oracle_acr0.25", [1.0] * 10),
        "random_any_acr0.25": records("random_any_acr0.25", [0.1] * 5 + [1.0] * 5),
        "reach_gain_kept_acr0.25": records("reach_gain_kept_acr0.25", [1.0] * 10),
    }
    heads = {("oracle_acr0.25", s): {"final_table": oracle} for s in range(10)}
    heads |= {("random_any_acr0.25", s): {"final_table": any_tables[s // 5]} for s in range(10)}
    md = protocol.protocol_md(by_row, list(by_row), heads)
    assert ("reach_gain_kept_acr0.25", "random_any_acr0.25") in protocol.comparisons(by_row)
    assert ("random_any_acr0.25", "oracle_acr0.25") not in protocol.comparisons(by_row)  # a control, not a mechanism
    assert "| reach_gain_kept_acr0.25 | random_any_acr0.25 | 10/10 vs 5/10 |" in md
    assert "(L1) with probability 0.500 (counted exactly); its 10 seeds' draws did in 5." in md


def test_on_the_relay_task_the_chance_line_also_counts_room_for_the_circuit():
    """With the task's circuit (records.task_circuit of a relay folder), the chance line adds how often a random
    placement leaves room for the whole circuit (the carriers included), beside how often the draws did: for the
    lean relay table, the widest window in layer 2 is 1/3 but the circuit 64/660."""
    from aah_lightning.data.recall import RelayCircuit

    oracle = [[2, 1, 1, 1], [2, 1, 1, 1], [256, 1, 1, 1]]
    drawn = [
        [[1, 1, 2, 1], [1, 2, 1, 1], [1, 1, 256, 1]],  # room: a carrier in each lower layer, the 256 on top
        [[2, 2, 1, 1], [1, 1, 1, 1], [1, 256, 1, 1]],  # the 256 on top but nothing carries in layer 1
        [[256, 1, 1, 1], [2, 1, 1, 1], [2, 1, 1, 1]],  # the 256 at the bottom
    ]
    by_row = {
        "oracle_acr0.088": records("oracle_acr0.088", [1.0] * 3),
        "random_any_acr0.088": records("random_any_acr0.088", [1.0, 0.2, 0.2]),
    }
    heads = {("oracle_acr0.088", s): {"final_table": oracle} for s in range(3)}
    heads |= {("random_any_acr0.088", s): {"final_table": drawn[s]} for s in range(3)}
    plain = protocol.protocol_md(by_row, list(by_row), heads)
    assert "(L2) with probability 0.333 (counted exactly); its 3 seeds' draws did in 2." in plain
    assert "relay circuit" not in plain
    md = protocol.protocol_md(by_row, list(by_row), heads, RelayCircuit(2, 256))
    assert "leaves room for the relay circuit" in md
    assert "with probability 0.097 (counted over the 660 distinct placements); the draws did in 1." in md
    assert "with room for the relay circuit (" in md and "oracle_acr0.088 3/3, random_any_acr0.088 1/3." in md


def test_the_relay_folders_name_their_circuit():
    from aah_lightning.experiments.records import task_circuit

    repo = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    lean = task_circuit(os.path.join(repo, "relay_lean", "base.yaml"))
    assert (lean.gap, lean.reach) == (2, 256)
    assert task_circuit(os.path.join(repo, "recall", "base.yaml")) is None


def test_the_learned_line_is_the_reports_setting():
    """A task whose formed circuit tops out below 0.9 is read at the line fixed for it: the same seeds count as
    learned at 0.5 and not at the default."""
    by_row = {
        "oracle_acr0.088": records("oracle_acr0.088", [0.82] * 4 + [0.1] * 2),
        "span_full_acr0.088": records("span_full_acr0.088", [0.8] * 2 + [0.06] * 4),
    }
    default = protocol.protocol_md(by_row, list(by_row), {})
    assert "final recall >= 0.9 over" in default and "| 0/6 |" in default
    lower = protocol.protocol_md(by_row, list(by_row), {}, learned_at=0.5)
    assert "final recall >= 0.5 over" in lower
    assert "| span_full_acr0.088 | oracle_acr0.088 | 2/6 vs 4/6 |" in lower
