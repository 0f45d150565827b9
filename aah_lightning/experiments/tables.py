"""A suite's Markdown tables: results.md (one line per row), positions.md (loss by position bucket), frontier.md (the
families at each target ACR, against the baseline, against one window for all, and with full heads held to the
trained span), and two suites' paired differences side by side (tools/compare_suites.py)."""

from __future__ import annotations

import math
import re

from aah_lightning.experiments.records import COLUMNS, eval_lengths
from aah_lightning.experiments.stats import BASELINE, baseline_by_seed, interval, mean_std, paired_diffs, verdict

# A frontier row: <family>_acr<target ACR>, e.g. fixed_acr0.25 (configs/frontier).
FRONTIER_ROW = re.compile(r"^(?P<family>.+)_acr(?P<target>[0-9]*\.?[0-9]+)$")
UNIFORM = "fixed"  # the family that gives every head one window: what per-head allocation has to beat
ONE_WINDOW_POLICIES = ("full", "fixed")  # policies that give every head of a layer the same window by design


def fmt(mean: float, std: float, digits: int = 4) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


# -- results.md -------------------------------------------------------------------------------------------------------
def results_table(by_row: dict[str, list[dict]], rows: list[str], base: dict[int, float]) -> str:
    """Markdown: per row, every column as mean ± std over its seeds, and its val loss paired with the baseline's."""
    lines = [
        "| row | seeds | val loss | val ppl | Δ val loss vs baseline [95 % CI] | gain in last val interval | ACR | "
        "ACR, mean over the run | "
        "causal coverage | block density | attention-mass coverage | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        recs = by_row[r]
        if not recs:
            continue
        stats = {c: mean_std([x[c] for x in recs]) for c in COLUMNS}
        diff = interval(paired_diffs(recs, base), 4) if r != BASELINE else "–"
        lines.append(
            f"| {r} | {len(recs)} | {fmt(*stats['val_loss'])} | {fmt(*stats['val_ppl'], 2)} | {diff} | "
            f"{fmt(*stats['val_loss_last_gain'])} | "
            f"{fmt(*stats['acr'], 3)} | {fmt(*stats['acr_mean'], 3)} | "
            f"{fmt(*stats['causal_coverage'], 3)} | {fmt(*stats['block_density'], 3)} | "
            f"{fmt(*stats['attention_mass_coverage'], 3)} | {fmt(*stats['tokens_per_sec'], 0)} |"
        )
    return "\n".join(lines) + "\n"


# -- positions.md -----------------------------------------------------------------------------------------------------
def _bucket_start(column: str) -> int:
    return int(column.rsplit(" ", 1)[1].split("-")[0])


def position_tables(records: list[dict], rows: list[str]) -> str:
    """Markdown: each row's last-validation loss per position bucket (mean ± std over seeds), at the training length
    and at every --eval-seq-lens length."""
    parts = []
    prefixes = ["", *(f"seq{n} " for n in eval_lengths(records)), *(f"span{n} " for n in eval_lengths(records, "span"))]
    for prefix in prefixes:
        cols = sorted({k for x in records for k in x if k.startswith(prefix + "pos ")}, key=_bucket_start)
        if not cols:
            continue
        where = (
            "the training length" if not prefix else f"{prefix[4 if prefix.startswith('span') else 3 :].strip()} tokens"
        )
        if prefix.startswith("span"):
            where += ", full heads held to the trained span"
        parts += [
            f"Validation loss by position at {where} (nats/token, mean ± std over seeds; columns: positions)\n",
            "| row | " + " | ".join(c[len(prefix) + 4 :] for c in cols) + " |",
            "|---|" + "---|" * len(cols),
        ]
        for r in rows:
            recs = [x for x in records if x["row"] == r]
            if recs:
                parts.append(
                    f"| {r} | " + " | ".join(fmt(*mean_std([x.get(c, math.nan) for x in recs])) for c in cols) + " |"
                )
        parts.append("")
    return "\n".join(parts)


# -- frontier.md ------------------------------------------------------------------------------------------------------
def frontier_rows(by_row: dict[str, list[dict]]) -> list[tuple[float, str, str]]:
    """(target ACR, family, row) of the baseline (ACR 1) and every ``<family>_acr<target>`` row."""
    out = []
    for r in by_row:
        m = FRONTIER_ROW.match(r)
        if r == BASELINE:
            out.append((1.0, BASELINE, r))
        elif m:
            out.append((float(m["target"]), m["family"], r))
    return out


def loss_cells(by_row: dict[str, list[dict]], row: str, prefix: str, lengths: list[int]) -> list[str]:
    """Two table cells per length n: the row's ``{prefix}{n} val_loss`` (mean ± std over seeds) and its difference to
    the baseline's, paired by seed."""
    cells = []
    for n in lengths:
        key = f"{prefix}{n} val_loss"
        base = baseline_by_seed(by_row, key)
        d = mean_std([x.get(key, math.nan) - base.get(x["seed"], math.nan) for x in by_row[row]])
        diff = "–" if row == BASELINE or math.isnan(d[0]) else f"{d[0]:+.4f} ± {d[1]:.4f}"
        cells += [fmt(*mean_std([x.get(key, math.nan) for x in by_row[row]])), diff]
    return cells


def frontier_table(by_row: dict[str, list[dict]], base: dict[int, float], lengths: list[int]) -> str:
    """Markdown: per target ACR, the families side by side, best paired difference to the baseline first, with what
    each run paid (its ACR averaged over steps) against the target."""
    head = (
        "| target ACR | family | seeds | ACR paid, mean over the run | paid − target, worst seed | val loss | "
        "Δ val loss vs baseline [95 % CI] | Δ per seed |"
    )
    rule = "|---|---|---|---|---|---|---|---|"
    for n in lengths:
        head += f" val loss at {n} tokens | Δ at {n} tokens vs baseline |"
        rule += "---|---|"
    entries = []
    for target, family, r in frontier_rows(by_row):
        recs = by_row[r]
        if not recs:
            continue
        diffs = paired_diffs(recs, base) if r != BASELINE else []
        d = mean_std(diffs)
        worst = max((x["acr_mean"] - target for x in recs), key=abs)
        cells = [
            f"{target:g}",
            family,
            str(len(recs)),
            fmt(*mean_std([x["acr_mean"] for x in recs]), 3),
            f"{worst:+.3f}",
            fmt(*mean_std([x["val_loss"] for x in recs])),
            interval(diffs, 4) if diffs else "–",
            " / ".join(f"{v:+.3f}" for v in diffs) or "–",
        ]
        cells += loss_cells(by_row, r, "seq", lengths)
        entries.append(((-target, d[0] if not math.isnan(d[0]) else 0.0), "| " + " | ".join(cells) + " |"))
    return "\n".join([head, rule, *(line for _, line in sorted(entries))]) + "\n"


def heads_cell(recs: list[dict]) -> str:
    """Whether a row's heads really held different windows: the share of its steps at which some layer's heads
    differed (mean over seeds) and in how many seeds that ever happened. A row meant to give heads their own windows
    whose tables stayed one window for all is flagged, never reported as per-head."""
    shares = [x.get("nonuniform_share", math.nan) for x in recs]
    if all(math.isnan(v) for v in shares):
        return "–"
    ever = sum(v > 0 for v in shares)
    text = f"{mean_std(shares)[0]:.0%} of steps, {ever}/{len(recs)} seeds"
    if recs[0].get("policy") not in ONE_WINDOW_POLICIES and ever < len(recs):
        text += " **UNIFORM in " + ("every seed" if ever == 0 else f"{len(recs) - ever} seed(s)") + ": not per-head**"
    return text


def versus_uniform_table(by_row: dict[str, list[dict]]) -> str:
    """Markdown: at each target, every other family against the ``fixed`` row of the same target, paired by seed
    (the decisive comparison: per-head windows against one window for all at the same compute): the mean difference
    with its 95 % interval, and "better" or "worse" only where the interval excludes zero. With the recall task, the
    same for the recall accuracy (higher is better)."""
    recall = any("recall_acc" in x for recs in by_row.values() for x in recs)
    head = (
        "| target ACR | family | heads held different windows | Δ val loss vs fixed [95 % CI] | verdict | Δ per seed |"
    )
    rule = "|---|---|---|---|---|---|"
    if recall:
        head += " Δ recall accuracy vs fixed [95 % CI] | verdict |"
        rule += "---|---|"
    uniform = {t: r for t, f, r in frontier_rows(by_row) if f == UNIFORM}
    entries = []
    for target, family, r in frontier_rows(by_row):
        if family in (UNIFORM, BASELINE) or target not in uniform or not by_row[r]:
            continue
        diffs = paired_diffs(by_row[r], {x["seed"]: x["val_loss"] for x in by_row[uniform[target]]})
        if not diffs:
            continue
        cells = [
            f"{target:g}",
            family,
            heads_cell(by_row[r]),
            interval(diffs, 4),
            verdict(diffs),
            " / ".join(f"{v:+.3f}" for v in diffs),
        ]
        if recall:
            ref = {x["seed"]: x.get("recall_acc", math.nan) for x in by_row[uniform[target]]}
            acc = [x.get("recall_acc", math.nan) - ref.get(x["seed"], math.nan) for x in by_row[r]]
            cells += [interval(acc, 3), verdict(acc, higher_is_better=True)]
        entries.append(((-target, statistics_key(diffs)), "| " + " | ".join(cells) + " |"))
    return "\n".join([head, rule, *(line for _, line in sorted(entries))]) + "\n"


def statistics_key(diffs: list[float]) -> float:
    m = mean_std(diffs)[0]
    return 0.0 if math.isnan(m) else m


def _recall_start(column: str) -> int:
    return int(column.split(" ", 1)[1].split("-")[0])


def recall_table(by_row: dict[str, list[dict]], rows: list[str]) -> str:
    """Markdown: each row's recall accuracy, overall and by distance to the answer (mean ± std over seeds; a window
    of ``b`` tokens reaches the answers of bucket ``a-b``), and whether its heads held different windows."""
    cols = sorted(
        {k for recs in by_row.values() for x in recs for k in x if k.startswith("recall ")}, key=_recall_start
    )
    lines = [
        "| row | seeds | heads held different windows | recall accuracy | "
        + " | ".join(c.split(" ", 1)[1] for c in cols)
        + " |",
        "|---|---|---|---|" + "---|" * len(cols),
    ]
    for r in rows:
        recs = by_row[r]
        if not recs or "recall_acc" not in recs[0]:
            continue
        cells = [r, str(len(recs)), heads_cell(recs), fmt(*mean_std([x["recall_acc"] for x in recs]), 3)]
        cells += [fmt(*mean_std([x.get(c, math.nan) for x in recs]), 2) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def span_table(by_row: dict[str, list[dict]], lengths: list[int]) -> str:
    """Markdown: the loss at each longer length when every head that saw the whole trained context keeps the trained
    length as a sliding window (the baseline becomes a sliding window of T), next to the paired difference to the
    baseline evaluated the same way: extrapolation compared without the full heads' unseen distances."""
    head, rule = "| target ACR | family | seeds |", "|---|---|---|"
    for n in lengths:
        head += f" val loss at {n} tokens, trained span | Δ vs baseline (trained span) |"
        rule += "---|---|"
    entries = []
    for target, family, r in frontier_rows(by_row):
        recs = by_row[r]
        if not recs:
            continue
        cells = [f"{target:g}", family, str(len(recs)), *loss_cells(by_row, r, "span", lengths)]
        entries.append(((-target, family), "| " + " | ".join(cells) + " |"))
    return "\n".join([head, rule, *(line for _, line in sorted(entries))]) + "\n"


def frontier_md(by_row: dict[str, list[dict]], base: dict[int, float], records: list[dict]) -> str:
    """frontier.md: the frontier table, the versus-fixed table, the recall accuracy by distance (recall task) and,
    when the suite ran them, the trained-span one."""
    frontier = frontier_table(by_row, base, eval_lengths(records))
    frontier += "\n" + versus_uniform_table(by_row)
    if any("recall_acc" in x for x in records):
        order = [r for _, _, r in sorted(frontier_rows(by_row), key=lambda e: (-e[0], e[1]))]
        frontier += "\n" + recall_table(by_row, order)
    if eval_lengths(records, "span"):
        frontier += "\n" + span_table(by_row, eval_lengths(records, "span"))
    return frontier


# -- two suites side by side ------------------------------------------------------------------------------------------
def paired(results: dict, row: str, seeds: list[int]) -> list[float]:
    """The row's paired differences to the baseline (stats.paired_diffs), for these seeds in this order; ``results``
    as records.read_results returns them."""
    recs = [{"seed": s, "val_loss": results[(row, s)]["val_loss"]} for s in seeds]
    return paired_diffs(recs, {s: results[(BASELINE, s)]["val_loss"] for s in seeds})


def pm(values: list[float], signed: bool = True, digits: int = 3) -> str:
    m, s = mean_std(values)
    if math.isnan(m):
        return "–"
    return f"{m:{'+' if signed else ''}.{digits}f} ± {s:.{digits}f}"


def compare_table(a: dict, b: dict, names: tuple[str, str]) -> str:
    """Markdown: per row both suites ran, its paired difference to the baseline in each (over the seeds both ran), how
    it moved, and each suite's val loss and last-interval gain; rows and seeds one suite lacks are listed below."""
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
