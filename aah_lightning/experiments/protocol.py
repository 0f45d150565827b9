"""protocol.md: the recall frontier compared with exact tests, because its outcomes are bimodal.

A seed of the recall task either forms the retrieval circuit (recall near 1) or it does not (near chance), so a mean
and a t interval describe neither mode. Per row: how many seeds learned (final recall >= ``LEARNED`` over the
distances the budget can reach, see ``reach``) with a Clopper-Pearson interval, and the recall past ``FAR`` tokens. Per comparison (a row against its budget's control,
every controller row against the oracle and against fair chance, ``random_any``): Fisher's exact test of the two counts, and the sign test and the
paired permutation test of the per-seed recall differences (seeds paired: the same seed is the same initialisation
and, for every row, the same data). A row's control is warm-up-matched: one window for all from step 0, or after the
same full-context warmup for the rows that have one (``WARMUP_MATCHED``). Every p-value of the table joins one Holm family; a comparison is called
``better`` or ``worse`` only where one of its Holm-adjusted p-values is below 0.05, in the direction of the
difference.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from aah_lightning.data import recall
from aah_lightning.experiments import stats
from aah_lightning.experiments.tables import FRONTIER_ROW, fmt

LEARNED = 0.9  # final recall accuracy at which a seed counts as having learned the task
FAR = 128  # recall past this distance needs a window wider than FAR
ALPHA = 0.05
UNIFORM = "fixed"  # one window for all heads from step 0: the control of every row that starts without full context
# Rows that train at full context first are compared with one window for all after the same warmup.
WARMUP_MATCHED = {"adaptive_layer": "fixed_warm", "adaptive_model": "fixed_warm", "gain_model": "fixed_warm"}
ORACLE = "oracle"
# Fair chance: the oracle's windows placed on heads drawn at random over the whole model (layer included); every
# controller row is compared with it, since a mechanism that must find the layer has to beat a guess that does not.
FAIR_CHANCE = "random_any"
CONTROLLERS = re.compile(r"^(adaptive|reach|gain|rewind|span)")  # rows whose windows a controller decides


def far_recall(rec: dict) -> float:
    """Mean recall of the distance buckets that start past ``FAR`` (NaN without any)."""
    values = [v for k, v in rec.items() if k.startswith("recall ") and int(k.split(" ")[1].split("-")[0]) > FAR]
    return sum(values) / len(values) if values else math.nan


def _bucket_end(key: str) -> int:
    return int(key.split(" ")[1].split("-")[1])


def recall_within(rec: dict, reach: int | None) -> float:
    """Recall over the distances up to ``reach``: the whole recall when ``reach`` is None or covers every bucket,
    else the mean of the buckets that end within it (NaN without any)."""
    buckets = {k: v for k, v in rec.items() if k.startswith("recall ")}
    if reach is None or not buckets or all(_bucket_end(k) <= reach for k in buckets):
        return rec.get("recall_acc", math.nan)
    values = [v for k, v in buckets.items() if _bucket_end(k) <= reach]
    return sum(values) / len(values) if values else math.nan


def learned(rec: dict, reach: int | None = None, at: float = LEARNED) -> bool:
    return recall_within(rec, reach) >= at


def reach(by_row: dict[str, list[dict]], heads: dict[tuple[str, int], dict]) -> dict[str, int | None]:
    """Per row, the farthest distance its budget buys a table held for the whole run: the widest window of the
    oracle's final tables at the same target ACR (None without an oracle row, meaning every distance). Where that is
    shorter than the context, no fixed table at this budget recalls past it, so "learned" is judged within it, for
    every row of the budget alike (a controller that underspends early may still reach further later)."""
    widest: dict[str, int] = {}
    for (r, _seed), h in heads.items():
        m = FRONTIER_ROW.match(r)
        if m and m["family"] == ORACLE:
            w = max(max(layer) for layer in h["final_table"])
            widest[m["target"]] = max(w, widest.get(m["target"], 0))
    out = {}
    for r in by_row:
        m = FRONTIER_ROW.match(r)
        out[r] = widest.get(m["target"]) if m else None
    return out


def long_head_layer(table: list[list[int]]) -> str:
    """The layer(s) holding the table's widest window, e.g. ``L1``; ``uniform`` when every head has the same window."""
    widest = max(max(row) for row in table)
    if all(w == widest for row in table for w in row):
        return "uniform"
    return "+".join(f"L{layer}" for layer, row in enumerate(table) if widest in row)


def row_summary(recs: list[dict], heads: dict[int, dict], within: int | None = None, at: float = LEARNED) -> list[str]:
    k, n = sum(learned(x, within, at) for x in recs), len(recs)
    low, high = stats.clopper_pearson(k, n)
    far = [far_recall(x) for x in recs if learned(x, within, at)]
    tables = [heads[x["seed"]]["final_table"] for x in recs if x["seed"] in heads]
    layers = Counter(long_head_layer(t) for t in tables)
    widest = Counter(max(max(r) for r in t) for t in tables)
    wall = [x.get("wall_s", math.nan) for x in recs]
    far_values = [v for v in far if not math.isnan(v)]
    return [
        "all" if within is None else str(within),
        f"{k}/{n}",
        f"[{low:.2f}, {high:.2f}]",
        fmt(*stats.mean_std([x.get("recall_acc", math.nan) for x in recs]), 3),
        fmt(*stats.mean_std(far_values), 3) if far_values else "–",
        ", ".join(f"{name} {c}" for name, c in sorted(layers.items())) or "–",
        ", ".join(f"{w}: {c}" for w, c in sorted(widest.items())) or "–",
        f"{stats.mean_std(wall)[0]:.0f}",
    ]


def comparisons(by_row: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """(row, reference) pairs: every row of a budget against its warm-up-matched control (one window for all, after
    the same full-context warmup where the row has one), every controller row also against the oracle."""
    targets: dict[str, dict[str, str]] = {}
    for r in by_row:
        m = FRONTIER_ROW.match(r)
        if m and by_row[r]:
            targets.setdefault(m["target"], {})[m["family"]] = r
    pairs = []
    for target in sorted(targets, key=float):
        fam = targets[target]
        for family, r in sorted(fam.items()):
            control = fam.get(WARMUP_MATCHED.get(family, UNIFORM))
            if control is not None and r != control and family != "fixed_warm":
                pairs.append((r, control))
            if CONTROLLERS.match(family) and ORACLE in fam:
                pairs.append((r, fam[ORACLE]))
            if CONTROLLERS.match(family) and FAIR_CHANCE in fam:
                pairs.append((r, fam[FAIR_CHANCE]))
    return pairs


def placement_chance(table: list[list[int]]) -> float:
    """The chance that the windows of ``table``, placed on heads drawn at random over the whole model (every
    distinct placement of the multiset equally likely, as a uniform permutation gives), put the widest window in a
    layer where ``table`` holds it. Exact, by counting: the widest windows land in ``n`` of the model's heads
    uniformly, so this is 1 - P(none of them lands in one of the good layers' heads)."""
    widest = max(max(row) for row in table)
    heads = sum(len(row) for row in table)
    n = sum(w == widest for row in table for w in row)
    good = sum(len(row) for row in table if widest in row)
    return 1.0 - math.comb(heads - good, n) / math.comb(heads, n)


def compare(a: list[dict], b: list[dict], within: int | None = None, at: float = LEARNED) -> dict:
    """The exact tests of row ``a`` against row ``b`` (the same budget, so the same reach): counts (Fisher) and
    seed-paired recall differences."""
    ka, kb = sum(learned(x, within, at) for x in a), sum(learned(x, within, at) for x in b)
    recall_b = {x["seed"]: x.get("recall_acc", math.nan) for x in b}
    diffs = [x["recall_acc"] - recall_b[x["seed"]] for x in a if x["seed"] in recall_b]
    return {
        "counts": (ka, len(a), kb, len(b)),
        "diff": stats.mean_std(diffs)[0] if diffs else math.nan,
        "pairs": len(diffs),
        "p": [
            stats.fisher_exact(ka, len(a) - ka, kb, len(b) - kb),
            stats.sign_test(diffs) if diffs else math.nan,
            stats.paired_permutation_test(diffs) if diffs else math.nan,
        ],
    }


def protocol_md(
    by_row: dict[str, list[dict]],
    rows: list[str],
    heads: dict[tuple[str, int], dict],
    circuit=None,
    learned_at: float = LEARNED,
) -> str:
    """protocol.md's two tables: the rows, and the comparisons with Holm-adjusted exact tests. ``circuit``: for a
    task whose circuit a table can be checked for (``possible(table) -> bool``, named by its ``name``), the chance
    lines also say how often a random placement leaves room for it. ``learned_at``: the final recall at which a seed
    counts as having learned (``LEARNED`` unless a task's circuit tops out lower; fixed before the runs)."""
    within = reach({r: by_row.get(r) or [] for r in rows}, heads)
    lines = [
        f"Seeds that learned: final recall >= {learned_at} over the distances within reach, the widest window of the "
        "oracle's table at the same budget (all: every distance; where a table held for the whole run cannot be as "
        f"wide as the context, every row of that budget is judged within the oracle's reach). Far recall: mean over the distance "
        f"buckets past {FAR} tokens, of the seeds that learned. Long head: the layer holding the final table's widest "
        "window, per seed.",
        "",
        "| row | reach | learned | 95 % CI (Clopper-Pearson) | recall (mean ± std) | far recall (learned seeds) | "
        "long head in | widest window | wall s / run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        recs = by_row.get(r) or []
        if recs and "recall_acc" in recs[0]:
            mine = {seed: h for (row, seed), h in heads.items() if row == r}
            lines.append("| " + " | ".join([r, *row_summary(recs, mine, within.get(r), learned_at)]) + " |")
    lines += chance_lines(rows, by_row, heads, circuit)
    pairs = comparisons({r: by_row.get(r) or [] for r in rows})
    results = [compare(by_row[a], by_row[b], within.get(a), learned_at) for a, b in pairs]
    flat = [p for res in results for p in res["p"]]
    adjusted = stats.holm(flat)
    lines += [
        "",
        f"Comparisons: {len(pairs)}; Holm's correction over all {sum(not math.isnan(p) for p in flat)} p-values "
        "below (Fisher's exact test of the counts, the sign test and the paired permutation test of the per-seed "
        f"recall differences). A verdict needs a Holm-adjusted p < {ALPHA}.",
        "",
        "| row | against | learned | Δ recall (paired mean) | p Fisher | p sign | p permutation | Holm: Fisher / "
        "sign / permutation | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, ((a, b), res) in enumerate(zip(pairs, results)):
        adj = adjusted[3 * i : 3 * i + 3]
        ka, na, kb, nb = res["counts"]
        resolved = any(not math.isnan(p) and p < ALPHA for p in adj)
        direction = (ka / na - kb / nb) if adj[0] < ALPHA else res["diff"]
        verdict = ("better" if direction > 0 else "worse") if resolved and direction != 0 else "not resolved"
        cells = [
            a,
            b,
            f"{ka}/{na} vs {kb}/{nb}",
            f"{res['diff']:+.3f} ({res['pairs']} seeds)" if res["pairs"] else "– (no seed run by both)",
            *(_p(p) for p in res["p"]),
            " / ".join(_p(p) for p in adj),
            verdict,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *final_tables(rows, heads)]
    return "\n".join(lines) + "\n"


def chance_lines(
    rows: list[str], by_row: dict[str, list[dict]], heads: dict[tuple[str, int], dict], circuit=None
) -> list[str]:
    """For each budget with a fair-chance row and an oracle: how often a random placement of the oracle's windows
    puts the widest one in the oracle's layer (``placement_chance``), beside how often the row's draws did; with a
    ``circuit`` (``protocol_md``), how often a random placement leaves room for it, how often the draws did, and
    how many of each row's final tables do."""
    out = []
    for r in rows:
        m = FRONTIER_ROW.match(r)
        if not (m and m["family"] == FAIR_CHANCE and by_row.get(r)):
            continue
        oracle = f"{ORACLE}_acr{m['target']}"
        tables = [h["final_table"] for (row, _), h in heads.items() if row == oracle]
        if not tables:
            continue
        layers = {layer for layer, row in enumerate(tables[0]) if max(row) == max(max(x) for x in tables[0])}
        drawn = [h["final_table"] for (row, _), h in heads.items() if row == r]
        hits = sum(any(max(t[layer]) == max(max(x) for x in t) for layer in layers) for t in drawn)
        out.append(
            f"Chance of {r}: a random placement of {oracle}'s windows puts the widest in the oracle's layer "
            f"({', '.join(f'L{layer}' for layer in sorted(layers))}) with probability "
            f"{placement_chance(tables[0]):.3f} (counted exactly); its {len(drawn)} seeds' draws did in {hits}."
        )
        if circuit is not None:
            chance, placements = recall.placement_chance(tables[0], circuit)
            room = sum(bool(circuit(t)) for t in drawn)
            out[-1] += (
                f" It leaves room for {circuit.name} with probability {chance:.3f} (counted over the {placements} "
                f"distinct placements); the draws did in {room}."
            )
    if circuit is not None:
        counts = []
        for r in rows:
            tables = [h["final_table"] for (row, _), h in heads.items() if row == r]
            if tables and by_row.get(r):
                counts.append(f"{r} {sum(bool(circuit(t)) for t in tables)}/{len(tables)}")
        if counts:
            out.append(f"Final tables with room for {circuit.name}: {', '.join(counts)}.")
    return ["", *out] if out else []


def final_tables(rows: list[str], heads: dict[tuple[str, int], dict]) -> list[str]:
    """Markdown lines: every controller row's final table per seed, beside the oracle's of the same budget."""
    chosen = [r for r in rows if CONTROLLERS.match(r) or r.startswith(ORACLE)]
    out = ["Final tables (layer 0 / layer 1 ..., per seed):", "", "| row | seed: final table |", "|---|---|"]
    for r in chosen:
        seeds = sorted(seed for row, seed in heads if row == r)
        if not seeds:
            continue
        cells = [
            f"{seed}: " + " ".join(str(layer).replace(" ", "") for layer in heads[(r, seed)]["final_table"])
            for seed in seeds
        ]
        out.append(f"| {r} | " + " · ".join(cells) + " |")
    return out


def _p(p: float) -> str:
    if math.isnan(p):
        return "–"
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}"
