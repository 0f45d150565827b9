"""What a suite reads back from its runs: where each run lives, its TensorBoard scalars reduced to one record (the
``COLUMNS`` of results.csv), its loss per position bucket, the time its attempts took, and a finished suite's
results.csv."""

from __future__ import annotations

import csv
import glob
import itertools
import json
import math
import os
import re
import statistics

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
RECALL_TAG = "val/recall_acc_by_distance/"


# -- a run's folder ---------------------------------------------------------------------------------------------------
def run_dir(out: str, row: str, seed: int) -> str:
    return os.path.join(out, row, f"seed{seed}")


def checkpoint_dir(rd: str) -> str:
    return os.path.join(rd, "checkpoints")


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


# -- TensorBoard event files ------------------------------------------------------------------------------------------
def event_files(log_dir: str) -> list[str]:
    """Every events file under ``log_dir``, oldest writer first."""
    paths = glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)
    return sorted(paths, key=events_file_time)


def events_file_time(path: str) -> tuple[float, str]:
    """events.out.tfevents.<unix time>.<host>...: when the writer opened it (ties broken by name)."""
    name = os.path.basename(path)
    try:
        return float(name.split(".")[3]), name
    except (IndexError, ValueError):
        return os.path.getmtime(path), name


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a run. A resumed run has one events file per attempt and re-logs the steps between
    its checkpoint and the interruption: the newest file's value of a step wins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, dict[int, float]] = {}
    for path in event_files(log_dir):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            series.setdefault(tag, {}).update((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(values.items()) for tag, values in series.items()}


# -- a run's record ---------------------------------------------------------------------------------------------------
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


def recall_accuracies(series: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """The last validation's recall accuracy (recall task only): ``recall_acc`` and ``{"recall <a>-<b>": acc}`` by
    distance to the answer; nothing for a run without recall answers."""
    out = {}
    if series.get("val/recall_acc"):
        out["recall_acc"] = series["val/recall_acc"][-1][1]
    for tag, values in series.items():
        if tag.startswith(RECALL_TAG) and values:
            out[f"recall {tag[len(RECALL_TAG) :]}"] = values[-1][1]
    return out


def row_policy(base_yaml: str, row_yaml: str) -> str:
    """The window policy a row runs (``model.aah.policy`` of its overlay, else of the base config)."""
    import yaml

    policy = "full"
    for path in (base_yaml, row_yaml):
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
        policy = ((cfg.get("model") or {}).get("aah") or {}).get("policy", policy)
    return policy


def task_circuit(base_yaml: str):
    """The circuit a row folder's task needs, as a table check for the reports (``data.recall.RelayCircuit`` for the
    relay task), or None: read from the folder's ``base.yaml`` (``data.recall.task``, ``relay_gap``, ``seq_len``)."""
    import yaml

    from aah_lightning.data.config import RecallConfig
    from aah_lightning.data.recall import RelayCircuit

    with open(base_yaml) as f:
        data = (yaml.safe_load(f) or {}).get("data") or {}
    recall = data.get("recall") or {}
    if data.get("source") != "recall" or recall.get("task") != "relay":
        return None
    return RelayCircuit(int(recall.get("relay_gap", RecallConfig.relay_gap)), int(data["seq_len"]))


def window_summary(ckpt_path: str) -> tuple[dict[str, float], dict[str, list]]:
    """From a run's last checkpoint: ``nonuniform_share`` (share of its steps at which some layer's heads held
    different windows), ``final_distinct_max`` (most different windows within one layer of the final table), and the
    final table and each head's ACR averaged over the run (for tables.json)."""
    from aah_lightning.checkpoint import WINDOW_USAGE_KEY, gpt_settings, read_checkpoint, window_table
    from aah_lightning.windows.metrics import usage_head_acr

    ckpt = read_checkpoint(ckpt_path, setting="the run's last checkpoint")
    seq_len = gpt_settings(ckpt)["seq_len"]
    table = window_table(ckpt).clamp(max=seq_len)
    usage = ckpt.get(WINDOW_USAGE_KEY) or {}
    steps = int(usage.get("steps", 0))
    head_acr = usage_head_acr(usage, seq_len) if steps else table.double() * math.nan
    fields = {
        "nonuniform_share": usage.get("nonuniform_steps", 0) / steps if steps else math.nan,
        "final_distinct_max": max(len(set(row.tolist())) for row in table),
    }
    return fields, {"final_table": table.tolist(), "head_acr": [[round(v, 4) for v in r] for r in head_acr.tolist()]}


def eval_lengths(records: list[dict], kind: str = "seq") -> list[int]:
    """The --eval-seq-lens lengths the records hold a validation loss for: ``seq`` (full heads see the whole context)
    or ``span`` (full heads keep the trained span, --eval-trained-span)."""
    found = (re.fullmatch(kind + r"(\d+) val_loss", k) for x in records for k in x)
    return sorted({int(m[1]) for m in found if m})


# -- a finished suite -------------------------------------------------------------------------------------------------
def read_results(out: str) -> dict[tuple[str, int], dict[str, float]]:
    """A finished suite's results.csv: ``{(row, seed): {column: value}}``."""
    with open(os.path.join(out, "results.csv")) as f:
        return {(r["row"], int(r["seed"])): _numbers(r) for r in csv.DictReader(f)}


def _numbers(line: dict[str, str]) -> dict[str, float]:
    """A results.csv line's measured columns as floats (the row, seed and policy columns and empty cells left out)."""
    return {k: float(v) for k, v in line.items() if k not in ("row", "seed", "policy") and v != ""}


def merged_records(folder: str, rows: list[str], seeds: list[int]) -> tuple[list[dict], dict[tuple[str, int], dict]]:
    """The runs of ``rows`` x ``seeds`` recorded in an earlier suite's ``folder`` (its results.csv and, where there,
    tables.json): ``(records, heads)`` as tools/suite.py builds them from runs, without the runs themselves."""
    with open(os.path.join(folder, "results.csv")) as f:
        raw = {(r["row"], int(r["seed"])): r for r in csv.DictReader(f)}
    tables = {}
    if os.path.exists(os.path.join(folder, "tables.json")):
        with open(os.path.join(folder, "tables.json")) as f:
            tables = json.load(f)
    records, heads = [], {}
    for row in rows:
        for seed in seeds:
            r = raw.get((row, seed))
            if r is None:
                continue
            records.append({"row": row, "seed": seed, "policy": r.get("policy"), **_numbers(r)})
            if str(seed) in tables.get(row, {}):
                heads[(row, seed)] = tables[row][str(seed)]
    return records, heads
