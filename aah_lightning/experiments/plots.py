"""A suite's pictures: final val loss against ACR (and its difference to the same seed's baseline), the validation
curves per row, the quality-compute frontier per family and, on the recall task, recall accuracy by distance per
family at each target. PNG files, drawn without a display."""

from __future__ import annotations

import math
import os

from aah_lightning.atomic import atomic_write
from aah_lightning.experiments.stats import BASELINE, baseline_by_seed, mean_curve, mean_std, paired_diffs
from aah_lightning.experiments.tables import frontier_rows


def pyplot():
    """matplotlib's pyplot on the file-only backend (the suite runs without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_vs_acr(out: str, by_row: dict[str, list[dict]], base: dict[int, float]) -> None:
    """val_loss_vs_acr.png."""
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
    save_png(fig, os.path.join(out, "val_loss_vs_acr.png"))
    plt.close(fig)


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
    save_png(fig, os.path.join(out, "val_loss_curves.png"))
    plt.close(fig)


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
    save_png(fig, os.path.join(out, "frontier.png"))
    plt.close(fig)


def plot_recall(out: str, by_row: dict[str, list[dict]]) -> None:
    """recall_by_distance.png: one panel per target ACR, the recall accuracy of each family by distance to the answer
    (mean ± std over seeds), the baseline in every panel."""
    plt = pyplot()
    cols = sorted(
        {k for recs in by_row.values() for x in recs for k in x if k.startswith("recall ")},
        key=lambda c: int(c.split(" ", 1)[1].split("-")[0]),
    )
    rows = frontier_rows(by_row)
    targets = sorted({t for t, f, _ in rows if f != BASELINE})
    if not cols or not targets:
        return
    families = sorted({f for _, f, _ in rows})
    fig, axes = plt.subplots(1, len(targets), figsize=(6.5 * len(targets), 5), squeeze=False)
    for ax, target in zip(axes[0], targets):
        for t, family, r in sorted(rows, key=lambda e: e[1]):
            if (t != target and family != BASELINE) or not by_row[r]:
                continue
            means = [mean_std([x.get(c, math.nan) for x in by_row[r]]) for c in cols]
            ax.errorbar(
                range(len(cols)),
                [m for m, _ in means],
                yerr=[s for _, s in means],
                fmt="o-",
                capsize=3,
                color=f"C{families.index(family) % 10}",
                label=family,
            )
        ax.set_xticks(range(len(cols)), [c.split(" ", 1)[1] for c in cols], rotation=45, fontsize=8)
        ax.set_xlabel("distance to the answer (tokens): the window that reaches it")
        ax.set_ylabel("recall accuracy, mean ± std over seeds")
        ax.set_title(f"target ACR {target:g}")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, os.path.join(out, "recall_by_distance.png"))
    plt.close(fig)


def save_png(fig, path: str) -> None:
    """The figure as a PNG through the atomic writer."""
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
