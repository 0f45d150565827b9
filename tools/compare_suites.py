"""Do a suite's conclusions hold with more training? Put two suites' paired differences side by side.

    python tools/compare_suites.py runs/suite_cpu runs/suite_cpu_2000 [--names "1,000 steps" "2,000 steps"]

Reads each suite's ``results.csv`` (written by tools/suite.py) and prints a Markdown table: per row, the paired
difference of its val loss to the same seed's baseline in each suite (mean ± std over the seeds both suites ran),
how that difference moved, and each suite's validation loss and last-interval gain. Rows or seeds one suite lacks
are left out of the comparison and listed underneath.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shlex
import sys

from aah_lightning.reporting import BASELINE, mean_std, paired_diffs


def read_results(out: str) -> dict[tuple[str, int], dict[str, float]]:
    path = os.path.join(out, "results.csv")
    if not os.path.exists(path):
        sys.exit(f"{path} does not exist: pass the --out folder of a finished tools/suite.py run")
    with open(path) as f:
        return {
            (r["row"], int(r["seed"])): {k: float(v) for k, v in r.items() if k not in ("row", "seed")}
            for r in csv.DictReader(f)
        }


def paired(results: dict, row: str, seeds: list[int]) -> list[float]:
    """The row's paired differences to the baseline (suite.paired_diffs), for these seeds in this order."""
    recs = [{"seed": s, "val_loss": results[(row, s)]["val_loss"]} for s in seeds]
    return paired_diffs(recs, {s: results[(BASELINE, s)]["val_loss"] for s in seeds})


def pm(values: list[float], signed: bool = True, digits: int = 3) -> str:
    m, s = mean_std(values)
    if math.isnan(m):
        return "–"
    return f"{m:{'+' if signed else ''}.{digits}f} ± {s:.{digits}f}"


def compare(a: dict, b: dict, names: tuple[str, str]) -> str:
    rows = sorted({r for r, _ in a} & {r for r, _ in b})
    lines = [
        f"| row | seeds | Δ vs baseline, {names[0]} | Δ vs baseline, {names[1]} | change | Δ per seed, {names[1]} | "
        f"val loss, {names[0]} | val loss, {names[1]} | last-interval gain, {names[0]} | "
        f"last-interval gain, {names[1]} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    left_out = []
    for r in rows:
        # only seeds both suites ran, for this row and for the baseline it is paired with
        seeds = sorted(
            s for s in {s for rr, s in a if rr == r} if (r, s) in b and (BASELINE, s) in a and (BASELINE, s) in b
        )
        missing = sorted({s for rr, s in (*a, *b) if rr == r} - set(seeds))
        if missing:
            left_out.append(f"{r}: seed(s) {', '.join(map(str, missing))}")
        if not seeds:
            continue
        da, db = paired(a, r, seeds), paired(b, r, seeds)
        delta_cells = (
            ["–", "–", "–", "–"]
            if r == BASELINE
            else [pm(da), pm(db), pm([y - x for x, y in zip(da, db)]), " / ".join(f"{d:+.3f}" for d in db)]
        )
        lines.append(
            f"| {r} | {len(seeds)} | "
            + " | ".join(delta_cells)
            + " | "
            + " | ".join(
                pm([results[(r, s)][column] for s in seeds], signed=False)
                for column in ("val_loss", "val_loss_last_gain")
                for results in (a, b)
            )
            + " |"
        )
    only = sorted({r for r, _ in a} ^ {r for r, _ in b})
    notes = [f"Rows in one suite only: {', '.join(only)}."] if only else []
    if left_out:
        notes.append("Left out (not in both suites, or no baseline run of that seed): " + "; ".join(left_out) + ".")
    return "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("first", help="--out folder of the first suite (e.g. the shorter schedule)")
    p.add_argument("second", help="--out folder of the second suite")
    p.add_argument("--names", nargs=2, default=None, help="column labels for the two suites (default: folder names)")
    args = p.parse_args(argv)
    names = tuple(args.names or (os.path.basename(os.path.normpath(d)) for d in (args.first, args.second)))
    print("command:", " ".join(shlex.quote(x) for x in ["python", *sys.argv]))
    print(compare(read_results(args.first), read_results(args.second), names))


if __name__ == "__main__":
    main()
