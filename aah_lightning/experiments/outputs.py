"""Every output file of a suite, from its records: results.csv, results.md, positions.md, the two plots, tables.json
(each run's final window table and each head's ACR over the run) and, when the rows are a frontier
(``<family>_acr<target>``), frontier.md and frontier.png (and, on the recall task, recall_by_distance.png and
protocol.md, the exact tests of protocol.py)."""

from __future__ import annotations

import csv
import io
import json
import os

from aah_lightning.atomic import atomic_write_text
from aah_lightning.experiments import plots
from aah_lightning.experiments.protocol import LEARNED, protocol_md
from aah_lightning.experiments.records import COLUMNS, eval_lengths
from aah_lightning.experiments.stats import baseline_by_seed
from aah_lightning.experiments.tables import FRONTIER_ROW, frontier_md, position_tables, results_table


def write_outputs(
    out: str,
    records: list[dict],
    rows: list[str],
    curves: dict[tuple[str, int], list],
    heads: dict[tuple[str, int], dict] | None = None,
    circuit=None,
    learned_at: float = LEARNED,
) -> str:
    """Writes the files into ``out`` and returns results.md's table (followed by frontier.md's, for a frontier).
    ``records``: one per run (records.summarise and more); ``rows`` in table order; ``curves``: (row, seed) -> the
    run's val/loss series; ``heads``: (row, seed) -> records.window_summary's tables; ``circuit``: the task's circuit
    check for protocol.md's chance lines (``records.task_circuit``), or None; ``learned_at``: protocol.md's recall
    line for a seed that learned."""
    fields = list(dict.fromkeys(["row", "seed", "wall_s", *COLUMNS, *(k for x in records for k in x)]))
    rows_csv = io.StringIO(newline="")
    writer = csv.DictWriter(rows_csv, fieldnames=fields, restval="")
    writer.writeheader()
    writer.writerows(records)
    atomic_write_text(os.path.join(out, "results.csv"), rows_csv.getvalue())

    if heads:
        by_run = {r: {str(seed): heads[(r, seed)] for (rr, seed) in sorted(heads) if rr == r} for r in rows}
        atomic_write_text(os.path.join(out, "tables.json"), json.dumps(by_run, indent=1))
    by_row = {r: [x for x in records if x["row"] == r] for r in rows}
    base = baseline_by_seed(by_row, "val_loss")
    table = results_table(by_row, rows, base)
    atomic_write_text(os.path.join(out, "results.md"), table)
    plots.plot_vs_acr(out, by_row, base)
    plots.plot_curves(out, by_row, curves)
    atomic_write_text(os.path.join(out, "positions.md"), position_tables(records, rows))
    if any(FRONTIER_ROW.match(r) for r in rows):
        frontier = frontier_md(by_row, base, records)
        atomic_write_text(os.path.join(out, "frontier.md"), frontier)
        plots.plot_frontier(out, by_row, base, eval_lengths(records))
        plots.plot_recall(out, by_row)
        table += "\n" + frontier
        if any("recall_acc" in x for x in records):  # bimodal outcomes: the exact tests
            protocol = protocol_md(by_row, rows, heads or {}, circuit, learned_at)
            atomic_write_text(os.path.join(out, "protocol.md"), protocol)
            table += "\n" + protocol
    return table
