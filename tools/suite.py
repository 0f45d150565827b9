"""Run the paper's rows x seeds, read every run's TensorBoard events, and write the comparison.

    python tools/suite.py --rows configs/cpu --seeds 0 1 2 --out runs/suite_cpu [--jobs 2 --threads 1]

A rows folder holds ``base.yaml`` (the shared model, data and trainer settings) and one overlay per row
(``<row>.yaml``). Each run is ``aah fit --config base.yaml --config <row>.yaml --seed_everything <seed>
--model.aah.seed <seed>``, logged to ``<out>/<row>/seed<seed>/``: a seed changes the initialisation and every
policy's own randomness (random windows, the probe's query sample, random grouping, the paper allocator's networks,
the shuffles); the data order and split stay fixed (``data.seed``), so all runs see the same batches. Finished runs
are skipped when the suite is started again, and a run stopped part-way resumes exactly from its last checkpoint
(``--ckpt_path last``), so an interrupted suite loses at most the steps since each run's last checkpoint. Outputs in
``<out>``: ``results.csv`` (one line per run), ``results.md`` (mean +- std over seeds per row, difference to the
baseline row), ``val_loss_vs_acr.png`` and ``val_loss_curves.png`` (validation loss against step per row), and
``positions.md`` (the last validation's loss by position bucket per row).

``--eval-seq-lens 2048 4096`` also validates each finished run's last checkpoint at those sequence lengths (``aah
validate --data.seq_len L``: RoPE at any length, heads that saw the whole trained context keep the whole context),
logged to ``<run>/eval/seq<L>/``; their losses join the records and ``positions.md``. Rows named
``<family>_acr<target>`` (configs/frontier) are a quality-compute frontier: ``frontier.md`` and ``frontier.png``
compare the families at each target ACR (docs/frontier.md).
"""

from __future__ import annotations

import argparse
import csv
import glob
import itertools
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from aah_lightning.reporting import BASELINE, mean_std, paired_diffs, read_scalars

# Scalars read from each run: column -> (tag, how to reduce the logged series)
COLUMNS = {
    "val_loss": ("val/loss", "last"),
    "val_ppl": ("val/ppl", "last"),
    # How much the last validation interval still gained: near 0 once the curve has flattened.
    "val_loss_last_gain": ("val/loss", "last_gain"),
    "acr": ("aah/acr", "last"),
    # What the run paid on average over its steps: the adaptive rows start at full context, random windows are
    # redrawn. aah/acr is logged whenever the table changes, so each value holds until the next one.
    "acr_mean": ("aah/acr", "step_mean"),
    "causal_coverage": ("aah/causal_coverage", "last"),
    "block_density": ("aah/block_density", "last"),
    "attention_mass_coverage": ("aah/attention_mass_coverage", "last"),
    "tokens_per_sec": ("perf/tokens_per_sec", "median"),
}
POSITION_TAG = "val/loss_by_position/"
# A frontier row: <family>_acr<target ACR>, e.g. fixed_acr0.25 (configs/frontier).
FRONTIER_ROW = re.compile(r"^(?P<family>.+)_acr(?P<target>[0-9]*\.?[0-9]+)$")


def row_files(rows_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(rows_dir, "*.yaml")))
    return [f for f in files if os.path.basename(f) != "base.yaml"]


def row_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def run_dir(out: str, row: str, seed: int) -> str:
    return os.path.join(out, row, f"seed{seed}")


def checkpoint_dir(rd: str) -> str:
    return os.path.join(rd, "checkpoints")


def fit_command(rows_dir: str, row_path: str, seed: int, out: str, extra: list[str]) -> list[str]:
    row, rd = row_name(row_path), run_dir(out, row_name(row_path), seed)
    return [
        sys.executable,
        "-m",
        "aah_lightning",
        "fit",
        "--config",
        os.path.join(rows_dir, "base.yaml"),
        "--config",
        row_path,
        f"--seed_everything={seed}",
        f"--model.aah.seed={seed}",
        f"--trainer.logger.init_args.save_dir={os.path.join(out, row)}",
        f"--trainer.logger.init_args.name=seed{seed}",
        "--trainer.logger.init_args.version=logs",
        f"--checkpoint.dirpath={checkpoint_dir(rd)}",
        "--trainer.enable_progress_bar=false",
        *extra,
    ]


def validate_command(
    rows_dir: str, row_path: str, seed: int, out: str, extra: list[str], seq_len: int, trained_span: bool = False
) -> list[str]:
    """``aah validate`` of the run's last checkpoint at ``seq_len`` tokens, logged to ``<run>/eval/seq<seq_len>``;
    with ``trained_span`` the heads that saw the whole trained context keep that length as a sliding window
    (``model.full_heads_beyond_trained``), logged to ``<run>/eval/seq<seq_len>_span``."""
    rd = run_dir(out, row_name(row_path), seed)
    name = f"seq{seq_len}_span" if trained_span else f"seq{seq_len}"
    return [
        sys.executable,
        "-m",
        "aah_lightning",
        "validate",
        "--config",
        os.path.join(rows_dir, "base.yaml"),
        "--config",
        row_path,
        f"--seed_everything={seed}",
        f"--model.aah.seed={seed}",
        f"--trainer.logger.init_args.save_dir={os.path.join(rd, 'eval')}",
        f"--trainer.logger.init_args.name={name}",
        "--trainer.logger.init_args.version=logs",
        f"--checkpoint.dirpath={checkpoint_dir(rd)}",
        "--trainer.enable_progress_bar=false",
        *extra,
        f"--data.seq_len={seq_len}",
        f"--ckpt_path={os.path.join(checkpoint_dir(rd), 'last.ckpt')}",
        *(["--model.full_heads_beyond_trained=trained_span"] if trained_span else []),
    ]


def summarise(series: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    out = {}
    for column, (tag, how) in COLUMNS.items():
        values = [v for _, v in series.get(tag, [])]
        if not values:
            out[column] = math.nan
        elif how == "last":
            out[column] = values[-1]
        elif how == "last_gain":
            out[column] = values[-2] - values[-1] if len(values) > 1 else math.nan
        elif how == "mean":
            out[column] = statistics.fmean(values)
        elif how == "step_mean":
            out[column] = step_mean(series[tag], last_step(series))
        else:
            out[column] = statistics.median(values)
    return out


def step_mean(points: list[tuple[int, float]], end: int | None = None) -> float:
    """Mean over steps of a series logged at every change: each value holds until the next logged step, the last one
    up to step ``end`` (default: its own step), from the first logged step on."""
    end = points[-1][0] if end is None else max(end, points[-1][0])
    held = sum(v * (s2 - s1) for (s1, v), (s2, _) in itertools.pairwise(points))
    held += points[-1][1] * (end - points[-1][0] + 1)
    return held / (end - points[0][0] + 1)


def last_step(series: dict[str, list[tuple[int, float]]]) -> int:
    """The run's number of optimizer steps, in the convention of the ``aah/`` tags (the count of steps done; Lightning
    logs a step's own metrics at its 0-based index, so a run of N steps validates last at N - 1)."""
    return max(v[-1][0] + (0 if tag.startswith("aah/") else 1) for tag, v in series.items() if v)


def position_losses(series: dict[str, list[tuple[int, float]]], prefix: str = "") -> dict[str, float]:
    """The last validation's loss per position bucket: ``{"<prefix>pos <first>-<last>": loss}``."""
    return {
        f"{prefix}pos {tag[len(POSITION_TAG) :]}": values[-1][1]
        for tag, values in series.items()
        if tag.startswith(POSITION_TAG) and values
    }


def fmt(mean: float, std: float, digits: int = 4) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def write_outputs(out: str, records: list[dict], rows: list[str], curves: dict[tuple[str, int], list]) -> str:
    fields = list(dict.fromkeys(["row", "seed", "wall_s", *COLUMNS, *(k for x in records for k in x)]))
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(records)

    by_row = {r: [x for x in records if x["row"] == r] for r in rows}
    base = baseline_by_seed(by_row, "val_loss")
    lines = [
        "| row | seeds | val loss | val ppl | Δ val loss vs baseline | gain in last val interval | ACR | "
        "ACR, mean over the run | "
        "causal coverage | block density | attention-mass coverage | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        recs = by_row[r]
        if not recs:
            continue
        stats = {c: mean_std([x[c] for x in recs]) for c in COLUMNS}
        d_mean, d_std = mean_std(paired_diffs(recs, base)) if r != BASELINE else (math.nan, math.nan)
        lines.append(
            f"| {r} | {len(recs)} | {fmt(*stats['val_loss'])} | {fmt(*stats['val_ppl'], 2)} | "
            f"{'–' if math.isnan(d_mean) else f'{d_mean:+.4f} ± {d_std:.4f}'} | "
            f"{fmt(*stats['val_loss_last_gain'])} | "
            f"{fmt(*stats['acr'], 3)} | {fmt(*stats['acr_mean'], 3)} | "
            f"{fmt(*stats['causal_coverage'], 3)} | {fmt(*stats['block_density'], 3)} | "
            f"{fmt(*stats['attention_mass_coverage'], 3)} | {fmt(*stats['tokens_per_sec'], 0)} |"
        )
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table)
    plot(out, by_row, base)
    plot_curves(out, by_row, curves)
    with open(os.path.join(out, "positions.md"), "w") as f:
        f.write(position_tables(records, rows))
    if any(FRONTIER_ROW.match(r) for r in rows):
        frontier = frontier_table(by_row, base, eval_lengths(records))
        frontier += "\n" + versus_uniform_table(by_row)
        if eval_lengths(records, "span"):
            frontier += "\n" + span_table(by_row, eval_lengths(records, "span"))
        with open(os.path.join(out, "frontier.md"), "w") as f:
            f.write(frontier)
        plot_frontier(out, by_row, base, eval_lengths(records))
        table += "\n" + frontier
    return table


def pyplot():
    """matplotlib's pyplot on the file-only backend (the suite runs without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(out: str, by_row: dict[str, list[dict]], base: dict[int, float]) -> None:
    plt = pyplot()
    # Left: each row's own loss. Right: the paired difference to the same seed's baseline, where the initialisation
    # noise (often the larger part of the seed spread) cancels.
    fig, (ax, dax) = plt.subplots(1, 2, figsize=(14, 5.5))
    for i, (r, recs) in enumerate(by_row.items()):
        colour = f"C{i % 10}"  # the same colour for a row in both panels
        acr, loss = mean_std([x["acr"] for x in recs]), mean_std([x["val_loss"] for x in recs])
        if math.isnan(acr[0]) or math.isnan(loss[0]):
            continue
        ax.errorbar(acr[0], loss[0], xerr=acr[1], yerr=loss[1], fmt="o", capsize=3, color=colour)
        ax.annotate(r, (acr[0], loss[0]), textcoords="offset points", xytext=(5, 4), fontsize=8)
        diffs = paired_diffs(recs, base)
        if r != BASELINE and diffs:
            d = mean_std(diffs)
            dax.errorbar(
                acr[0], d[0], xerr=acr[1], yerr=0 if math.isnan(d[1]) else d[1], fmt="o", capsize=3, color=colour
            )
            dax.annotate(r, (acr[0], d[0]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("ACR (mean over layers and heads of min(W, T) / T)")
    ax.set_ylabel("final validation loss (nats/token), mean ± std over seeds")
    dax.axhline(0.0, color="grey", linewidth=1)
    dax.set_xlabel("ACR")
    dax.set_ylabel("val loss − same seed's baseline (nats/token), mean ± std")
    for a in (ax, dax):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "val_loss_vs_acr.png"), dpi=120)
    plt.close(fig)


def mean_curve(series: list[list[tuple[int, float]]]) -> tuple[list[int], list[float]]:
    """The mean over seeds at each step that every seed logged. A run stopped with its machine can lose the validation
    point after its last checkpoint (not yet on disk; the resume starts after it): that must not bend the mean."""
    per_step: dict[int, list[float]] = {}
    for one in series:
        for step, value in one:
            per_step.setdefault(step, []).append(value)
    steps = sorted(s for s, values in per_step.items() if len(values) == len(series))
    return steps, [statistics.fmean(per_step[s]) for s in steps]


def plot_curves(out: str, by_row: dict[str, list[dict]], curves: dict[tuple[str, int], list]) -> None:
    """Validation loss against step, mean over each row's seeds: shows whether the runs had flattened."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, (r, recs) in enumerate(by_row.items()):
        steps, means = mean_curve([curves[(r, x["seed"])] for x in recs])
        if steps:
            ax.plot(
                steps, means, marker="o", markersize=3, label=r, linestyle=["-", "--", ":"][i // 10 % 3]
            )  # the colour cycle repeats after 10 rows
    ax.set_xlabel("training step")
    ax.set_ylabel("validation loss (nats/token), mean over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "val_loss_curves.png"), dpi=120)
    plt.close(fig)


def eval_lengths(records: list[dict], kind: str = "seq") -> list[int]:
    """The --eval-seq-lens lengths the records hold a validation loss for: ``seq`` (full heads see the whole context)
    or ``span`` (full heads keep the trained span, --eval-trained-span)."""
    found = (re.fullmatch(kind + r"(\d+) val_loss", k) for x in records for k in x)
    return sorted({int(m[1]) for m in found if m})


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


def baseline_by_seed(by_row: dict[str, list[dict]], key: str) -> dict[int, float]:
    """The baseline's value of ``key`` per seed, to pair every other row's runs with."""
    return {x["seed"]: x.get(key, math.nan) for x in by_row.get(BASELINE, [])}


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
        "Δ val loss vs baseline | Δ per seed |"
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
            "–" if math.isnan(d[0]) else f"{d[0]:+.4f} ± {d[1]:.4f}",
            " / ".join(f"{v:+.3f}" for v in diffs) or "–",
        ]
        cells += loss_cells(by_row, r, "seq", lengths)
        entries.append(((-target, d[0] if not math.isnan(d[0]) else 0.0), "| " + " | ".join(cells) + " |"))
    return "\n".join([head, rule, *(line for _, line in sorted(entries))]) + "\n"


UNIFORM = "fixed"  # the family that gives every head one window: what per-head allocation has to beat


def versus_uniform_table(by_row: dict[str, list[dict]]) -> str:
    """Markdown: at each target, every other family's val loss minus the ``fixed`` row's at the same target, paired
    by seed (the decisive comparison: per-head windows against one window for all at the same compute). "all seeds"
    says whether the sign is the same for every seed."""
    lines = [
        "| target ACR | family | Δ val loss vs fixed, mean ± std | Δ per seed | all seeds agree |",
        "|---|---|---|---|---|",
    ]
    uniform = {t: r for t, f, r in frontier_rows(by_row) if f == UNIFORM}
    entries = []
    for target, family, r in frontier_rows(by_row):
        if family in (UNIFORM, BASELINE) or target not in uniform or not by_row[r]:
            continue
        ref = {x["seed"]: x["val_loss"] for x in by_row[uniform[target]]}
        diffs = paired_diffs(by_row[r], ref)
        if not diffs:
            continue
        d = mean_std(diffs)
        agree = "below" if all(v < 0 for v in diffs) else "above" if all(v > 0 for v in diffs) else "no"
        cells = [f"{target:g}", family, f"{d[0]:+.4f} ± {d[1]:.4f}", " / ".join(f"{v:+.3f}" for v in diffs), agree]
        entries.append(((-target, d[0]), "| " + " | ".join(cells) + " |"))
    return "\n".join([*lines, *(line for _, line in sorted(entries))]) + "\n"


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


def plot_frontier(out: str, by_row: dict[str, list[dict]], base: dict[int, float], lengths: list[int]) -> None:
    """Loss against the ACR each run paid, one line per family through its targets: each family's frontier. Panels:
    the loss itself, the paired difference to the baseline, and that difference at each --eval-seq-lens length."""
    plt = pyplot()
    panels = [("val_loss", None), ("val_loss", base)]
    panels += [(f"seq{n} val_loss", baseline_by_seed(by_row, f"seq{n} val_loss")) for n in lengths]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.5), squeeze=False)
    families: dict[str, list[str]] = {}
    for _target, family, r in sorted(frontier_rows(by_row)):
        families.setdefault(family, []).append(r)
    for ax, (key, reference) in zip(axes[0], panels):
        for i, (family, rows) in enumerate(families.items()):
            xs, ys, xerr, yerr = [], [], [], []
            for r in rows:
                recs = by_row[r]
                if reference is None:
                    y = mean_std([x.get(key, math.nan) for x in recs])
                elif family == BASELINE:
                    continue
                else:
                    y = mean_std([x.get(key, math.nan) - reference.get(x["seed"], math.nan) for x in recs])
                acr = mean_std([x["acr_mean"] for x in recs])
                if not math.isnan(y[0]) and not math.isnan(acr[0]):
                    xs.append(acr[0]), ys.append(y[0]), xerr.append(acr[1]), yerr.append(y[1])
            if xs:
                ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="o-", capsize=3, color=f"C{i % 10}", label=family)
        if reference is None:
            ax.set_ylabel("final val loss (nats/token), mean ± std over seeds")
        else:
            ax.axhline(0.0, color="grey", linewidth=1)
            where = "" if key == "val_loss" else f" at {key.split()[0][3:]} tokens"
            ax.set_ylabel(f"val loss{where} − same seed's baseline, mean ± std")
        ax.set_xlabel("ACR paid (mean over the run's steps)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "frontier.png"), dpi=120)
    plt.close(fig)


def interrupted_time(rd: str):
    """For a run that was stopped part-way (a suite killed, a job pre-empted) and left a last checkpoint: the
    seconds its earlier attempts spent up to that checkpoint (work after it is redone on resume). None when there is
    no checkpoint to resume from."""
    ckpt, started = os.path.join(checkpoint_dir(rd), "last.ckpt"), os.path.join(rd, "started")
    if not os.path.exists(ckpt):
        return None
    if not os.path.exists(started):
        return 0.0  # written by a suite that did not record attempt times: the earlier time is unknown
    with open(started) as f:
        t0, before = map(float, f.read().split())
    return before + max(0.0, os.path.getmtime(ckpt) - t0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", required=True, help="folder with base.yaml and one yaml per row")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", required=True)
    p.add_argument("--only", nargs="*", help="run only these rows")
    p.add_argument("--rerun", action="store_true", help="rerun runs that already finished")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per run (OMP_NUM_THREADS)")
    p.add_argument(
        "--eval-seq-lens",
        type=int,
        nargs="*",
        default=[],
        help="also validate each run's last checkpoint at these sequence lengths (e.g. 2T and 4T)",
    )
    p.add_argument(
        "--eval-trained-span",
        action="store_true",
        help="validate at each --eval-seq-lens length a second time with full heads held to the trained length",
    )
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: extra arguments for every aah fit")
    args = p.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]

    os.makedirs(args.out, exist_ok=True)
    files = [f for f in row_files(args.rows) if not args.only or row_name(f) in args.only]
    rows = [row_name(f) for f in files]
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    runs = [(path, seed) for path in files for seed in args.seeds]
    long_validations = [(n, span) for n in args.eval_seq_lens for span in [False, *([True] * args.eval_trained_span)]]
    if args.dry_run:
        for path, seed in runs:
            print(" ".join(shlex.quote(a) for a in fit_command(args.rows, path, seed, args.out, extra)))
            for n, span in long_validations:
                cmd = validate_command(args.rows, path, seed, args.out, extra, n, span)
                print(" ".join(shlex.quote(a) for a in cmd))
        return
    env = dict(os.environ)
    if args.threads:  # torch reads it at start-up: one setting for every run
        env["OMP_NUM_THREADS"] = str(args.threads)
    started = time.time()
    curves: dict[tuple[str, int], list] = {}  # (row, seed) -> the run's val/loss series, for the curve plot

    def run(path: str, seed: int) -> dict:
        rd = run_dir(args.out, row_name(path), seed)
        done = os.path.join(rd, "done")
        if args.rerun:
            shutil.rmtree(rd, ignore_errors=True)
        if not os.path.exists(done):
            before = interrupted_time(rd)  # None: no checkpoint to resume from
            resume = before is not None
            if not resume:
                shutil.rmtree(rd, ignore_errors=True)  # nothing worth keeping: start clean
                os.makedirs(rd)
                before = 0.0
            t0 = time.time()
            with open(os.path.join(rd, "started"), "w") as f:
                f.write(f"{t0} {before}\n")
            cmd = fit_command(args.rows, path, seed, args.out, extra)
            if resume:
                cmd += ["--ckpt_path", "last"]  # an exact resume: same batches, same window decisions
            with open(os.path.join(rd, "fit.log"), "a") as log:
                result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            if result.returncode != 0:
                raise RuntimeError(f"{row_name(path)} seed {seed} failed (exit {result.returncode}); see {rd}/fit.log")
            with open(done, "w") as f:
                f.write(f"{before + time.time() - t0:.1f}\n")
        with open(done) as f:
            wall = float(f.read())
        series = read_scalars(os.path.join(rd, "logs"))
        curves[(row_name(path), seed)] = series.get("val/loss", [])
        record = {"row": row_name(path), "seed": seed, "wall_s": wall, **summarise(series), **position_losses(series)}
        for n, span in long_validations:  # the finished run's last checkpoint at other lengths (each done once)
            ed = os.path.join(rd, "eval", f"seq{n}_span" if span else f"seq{n}")
            if not os.path.exists(os.path.join(ed, "done")):
                shutil.rmtree(ed, ignore_errors=True)
                os.makedirs(ed)
                with open(os.path.join(ed, "validate.log"), "w") as log:
                    cmd = validate_command(args.rows, path, seed, args.out, extra, n, span)
                    if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode:
                        raise RuntimeError(f"{row_name(path)} seed {seed}: validation at {n} tokens failed; see {ed}")
                open(os.path.join(ed, "done"), "w").close()
            long, key = read_scalars(ed), f"span{n}" if span else f"seq{n}"
            record[f"{key} val_loss"] = long["val/loss"][-1][1]
            record.update(position_losses(long, f"{key} "))
        print(
            f"{record['row']:>32} seed {seed}: val {record['val_loss']:.4f}  ACR paid {record['acr_mean']:.3f} "
            f"(last {record['acr']:.3f})  {wall:.0f} s",
            flush=True,
        )
        return record

    # Runs are independent processes; --jobs N runs N at a time (give each --threads of the machine's cores).
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run, path, seed) for path, seed in runs]
        try:
            records = [f.result() for f in futures]
        except RuntimeError as e:
            pool.shutdown(cancel_futures=True)
            sys.exit(str(e))
    print(write_outputs(args.out, records, rows, curves))
    print(
        f"suite wall time: {time.time() - started:.0f} s (this invocation); "
        f"sum of run times: {sum(r['wall_s'] for r in records):.0f} s"
    )


if __name__ == "__main__":
    main()
