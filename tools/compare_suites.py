"""Do a suite's conclusions hold with more training? Put two suites' paired differences side by side.

    python tools/compare_suites.py runs/suite_cpu runs/suite_cpu_2000 [--names "1,000 steps" "2,000 steps"]

Reads each suite's ``results.csv`` (written by tools/suite.py) and prints a Markdown table: per row, the paired
difference of its val loss to the same seed's baseline in each suite (mean ± std over the seeds both suites ran),
how that difference moved, and each suite's validation loss and last-interval gain. Rows or seeds one suite lacks
are left out of the comparison and listed underneath (the table: ``aah_lightning/experiments/tables.py``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from aah_lightning.experiments import records
from aah_lightning.experiments.tables import compare_table


def read_results(out: str) -> dict[tuple[str, int], dict[str, float]]:
    path = os.path.join(out, "results.csv")
    if not os.path.exists(path):
        sys.exit(f"{path} does not exist: pass the --out folder of a finished tools/suite.py run")
    return records.read_results(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("first", help="--out folder of the first suite (e.g. the shorter schedule)")
    p.add_argument("second", help="--out folder of the second suite")
    p.add_argument("--names", nargs=2, default=None, help="column labels for the two suites (default: folder names)")
    args = p.parse_args(argv)
    names = tuple(args.names or (os.path.basename(os.path.normpath(d)) for d in (args.first, args.second)))
    print("command:", " ".join(shlex.quote(x) for x in ["python", *sys.argv]))
    print(compare_table(read_results(args.first), read_results(args.second), names))


if __name__ == "__main__":
    main()
