"""tools/suite.py end to end: a 2-row x 2-seed micro-suite of real (tiny) runs through its command line, and its
table (written by aah_lightning/experiments) checked against the runs' TensorBoard events read back independently
with tests/helpers/tb.py."""

import csv
import json
import math
import os
import shlex
import statistics

import pytest

from aah_lightning.experiments.records import COLUMNS, interrupted_time, read_scalars
from aah_lightning.experiments.stats import mean_curve
from helpers.cli import REPO, run_tool
from helpers.tb import read_events

BASE = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 6
  val_check_interval: 3
  limit_val_batches: 2
  log_every_n_steps: 1
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {save_dir: runs, name: micro}
checkpoint:
  dirpath: runs/micro/checkpoints
throughput:
  window: 2
diagnostics:
  every_n_steps: 2
  amc_every_n_steps: 3
model:
  gpt:
    n_layer: 2
    n_head: 4
    n_embd: 32
  aah:
    candidates: [4, 8, 16, 32]
    controller: {schedule: {warmup_steps: 2, control_interval: 2}, groups: {depth: 2}}
data:
  source: synthetic
  seq_len: 32
  batch_size: 4
  synthetic: {documents: 64}
"""
ROWS = {
    "baseline": "model:\n  aah:\n    policy: full\n",
    # a compute ceiling makes the controller shorten windows even in a 6-step run
    "full_adaptive": "model:\n  aah:\n    policy: adaptive\n    controller: {budget: {target_acr: 0.5}}\n",
}
SEEDS = [0, 1]


def last(events, tag):
    return sorted(events["scalars"][tag])[-1][1]


def val_losses(events):
    """The two validations of a micro run (after steps 3 and 6), in step order."""
    return [v for _, v in sorted(events["scalars"]["val/loss"])]


def per_step_mean(points):
    """Mean over every step from the first logged one to the last, each step taking the value last logged."""
    points = sorted(points)
    return statistics.fmean([v for s, v in points if s <= step][-1] for step in range(points[0][0], points[-1][0] + 1))


def cell(table_line: str, column: int) -> str:
    return [c.strip() for c in table_line.strip().strip("|").split("|")][column]


@pytest.mark.heavy
def test_micro_suite_writes_the_table_of_the_real_runs(tmp_path, capsys):
    rows_dir, out = tmp_path / "rows", tmp_path / "out"
    rows_dir.mkdir()
    (rows_dir / "base.yaml").write_text(BASE)
    for name, text in ROWS.items():
        (rows_dir / f"{name}.yaml").write_text(text)
    # two runs at a time, as the suite is used (--jobs), so the four runs take the time of two
    assert (
        run_tool("suite", "--rows", str(rows_dir), "--seeds", *map(str, SEEDS), "--out", str(out), "--jobs", "2") == 0
    )

    # every run's events, read independently of the suite
    events = {(r, s): read_events(out / r / f"seed{s}") for r in ROWS for s in SEEDS}
    for (r, s), ev in events.items():
        assert len(ev["scalars"]["val/loss"]) == 2, (r, s)  # validations after steps 3 and 6: the runs finished
    with open(out / "results.csv") as f:
        records = list(csv.DictReader(f))
    assert [(x["row"], int(x["seed"])) for x in records] == [(r, s) for r in sorted(ROWS) for s in SEEDS]
    window_fields = {"policy", "nonuniform_share", "final_distinct_max"}
    assert set(records[0]) == {"row", "seed", "wall_s", *COLUMNS, "pos 0-31", *window_fields}  # T = 32: one bucket
    for x in records:
        ev = events[(x["row"], int(x["seed"]))]
        assert float(x["val_loss"]) == pytest.approx(last(ev, "val/loss"), rel=1e-6)
        assert float(x["acr"]) == pytest.approx(last(ev, "aah/acr"), rel=1e-6)
        assert float(x["acr_mean"]) == pytest.approx(per_step_mean(ev["scalars"]["aah/acr"]))
        assert float(x["pos 0-31"]) == pytest.approx(last(ev, "val/loss_by_position/0-31"), rel=1e-6)
        tps = statistics.median(v for _, v in ev["scalars"]["perf/tokens_per_sec"])
        assert float(x["tokens_per_sec"]) == pytest.approx(tps, rel=1e-6)
        assert float(x["wall_s"]) > 0

    lines = (out / "results.md").read_text().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == [
        "row",
        "seeds",
        "val loss",
        "val ppl",
        "Δ val loss vs baseline [95 % CI]",
        "gain in last val interval",
        "ACR",
        "ACR, mean over the run",
        "causal coverage",
        "block density",
        "attention-mass coverage",
        "tokens/s",
    ]
    body = {cell(line, 0): line for line in lines[2:]}
    assert set(body) == set(ROWS)
    loss = {r: [last(events[(r, s)], "val/loss") for s in SEEDS] for r in ROWS}
    for r in ROWS:
        assert cell(body[r], 1) == "2"
        assert cell(body[r], 2) == f"{statistics.fmean(loss[r]):.4f} ± {statistics.stdev(loss[r]):.4f}"
        acr = [last(events[(r, s)], "aah/acr") for s in SEEDS]
        assert cell(body[r], 6) == f"{statistics.fmean(acr):.3f} ± {statistics.stdev(acr):.3f}"
        acr_mean = [per_step_mean(events[(r, s)]["scalars"]["aah/acr"]) for s in SEEDS]
        assert cell(body[r], 7) == f"{statistics.fmean(acr_mean):.3f} ± {statistics.stdev(acr_mean):.3f}"
        gains = [first_val - last_val for first_val, last_val in (val_losses(events[(r, s)]) for s in SEEDS)]
        assert cell(body[r], 5) == f"{statistics.fmean(gains):.4f} ± {statistics.stdev(gains):.4f}"
        ppl = [last(events[(r, s)], "val/ppl") for s in SEEDS]
        assert cell(body[r], 3) == f"{statistics.fmean(ppl):.2f} ± {statistics.stdev(ppl):.2f}"
    diffs = [a - b for a, b in zip(loss["full_adaptive"], loss["baseline"])]  # paired by seed
    half = 12.706 * statistics.stdev(diffs) / math.sqrt(2)  # Student's t, 1 degree of freedom
    mean = statistics.fmean(diffs)
    assert cell(body["full_adaptive"], 4) == f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"
    # each run's final table and per-head ACR, from its last checkpoint (tables.json)
    heads = json.loads((out / "tables.json").read_text())
    assert set(heads) == set(ROWS) and set(heads["baseline"]) == {"0", "1"}
    assert (
        heads["baseline"]["0"]["final_table"] == [[32] * 4] * 2
        and heads["baseline"]["0"]["head_acr"] == [[1.0] * 4] * 2
    )
    adaptive = heads["full_adaptive"]["1"]
    assert all(0 < a <= 1 for row in adaptive["head_acr"] for a in row)
    shares = [float(x["nonuniform_share"]) for x in records if x["row"] == "baseline"]
    assert shares == [0.0, 0.0]  # every head of the baseline saw the whole context at every step
    assert cell(body["baseline"], 4) == "–"
    assert cell(body["baseline"], 6) == "1.000 ± 0.000"  # the baseline's every head sees the whole context
    assert float(cell(body["full_adaptive"], 6).split()[0]) <= 0.5  # the controller shortened the windows
    # it started at full context (warmup), so on average it paid more than its final windows cost
    assert float(cell(body["full_adaptive"], 7).split()[0]) > float(cell(body["full_adaptive"], 6).split()[0])
    assert (out / "val_loss_vs_acr.png").stat().st_size > 0
    assert (out / "val_loss_curves.png").stat().st_size > 0

    # the seed reaches the policy: each run's adaptive state was seeded by its own seed
    capsys.readouterr()
    dry = ["--rows", str(rows_dir), "--seeds", *map(str, SEEDS), "--out", str(out), "--only", "baseline", "--dry-run"]
    assert run_tool("suite", *dry) == 0
    fits = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if " fit " in line]
    assert len(fits) == len(SEEDS)
    for s, fit in zip(SEEDS, fits):
        assert f"--model.aah.seed={s}" in fit

    # a second invocation reuses the finished runs instead of training again
    stamps = {p: os.path.getmtime(p) for p in out.glob("*/seed*/done")}
    capsys.readouterr()
    assert run_tool("suite", "--rows", str(rows_dir), "--seeds", *map(str, SEEDS), "--out", str(out)) == 0
    assert {p: os.path.getmtime(p) for p in out.glob("*/seed*/done")} == stamps
    assert "val" in capsys.readouterr().out
    assert not math.isnan(float(records[0]["val_loss"]))
    # --report trains nothing: a seed never run is left out, the finished runs make the tables
    report = ["--rows", str(rows_dir), "--seeds", *map(str, SEEDS), "7", "--out", str(out), "--report"]
    assert run_tool("suite", *report) == 0
    assert not (out / "baseline" / "seed7").exists()
    assert {p: os.path.getmtime(p) for p in out.glob("*/seed*/done")} == stamps
    with open(out / "results.csv") as f:
        assert [(x["row"], int(x["seed"])) for x in csv.DictReader(f)] == [(r, s) for r in sorted(ROWS) for s in SEEDS]

    # a run stopped part-way (here: its 'done' marker lost) resumes from its last checkpoint instead of starting over
    rd = out / "baseline" / "seed0"
    (rd / "done").unlink()
    (rd / "started").write_text(f"{os.path.getmtime(rd / 'checkpoints' / 'last.ckpt') - 5.0} 7.0\n")
    assert run_tool("suite", "--rows", str(rows_dir), "--seeds", "0", "--only", "baseline", "--out", str(out)) == 0
    assert "Restored all states from the checkpoint" in (rd / "fit.log").read_text()
    assert len(list((rd / "logs").glob("events.out.tfevents.*"))) == 2  # the first attempt's events are kept
    assert float((rd / "done").read_text()) >= 7.0 + 5.0  # earlier attempts' time up to their checkpoint counts
    with open(out / "results.csv") as f:
        again = next(csv.DictReader(f))
    assert float(again["val_loss"]) == pytest.approx(loss["baseline"][0], rel=1e-6)


def test_seed_in_the_extra_arguments_is_each_runs_own(tmp_path, capsys):
    """A retrofit suite starts every seed from its own source: ``{seed}`` after ``--`` is the run's seed."""
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    (rows_dir / "base.yaml").write_text(BASE)
    (rows_dir / "baseline.yaml").write_text(ROWS["baseline"])
    src = "--model.init_from=src/seed{seed}/last.ckpt"
    args = ["--rows", str(rows_dir), "--seeds", "3", "11", "--out", str(tmp_path / "out"), "--dry-run", "--", src]
    assert run_tool("suite", *args) == 0
    fits = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if " fit " in line]
    assert [[a for a in fit if a.startswith("--model.init_from")] for fit in fits] == [
        ["--model.init_from=src/seed3/last.ckpt"],
        ["--model.init_from=src/seed11/last.ckpt"],
    ]


def test_a_resumed_runs_rewritten_steps_come_from_its_newest_events_file(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    logs = tmp_path / "logs"
    logs.mkdir()
    for stamp, values in ((100, {1: 5.0, 2: 4.0, 3: 3.5}), (200, {3: 3.0, 4: 2.5})):  # two attempts, step 3 in both
        d = tmp_path / f"attempt{stamp}"
        with SummaryWriter(str(d)) as w:
            for step, v in values.items():
                w.add_scalar("val/loss", v, step)
        (f,) = d.glob("events.out.tfevents.*")
        f.rename(logs / f"events.out.tfevents.{stamp}.host.1.0")  # the name carries when the writer opened it
    assert read_scalars(str(tmp_path / "logs"))["val/loss"] == [(1, 5.0), (2, 4.0), (3, 3.0), (4, 2.5)]


def test_interrupted_time_counts_each_attempt_up_to_its_checkpoint(tmp_path):
    assert interrupted_time(str(tmp_path)) is None  # no checkpoint: the run starts over
    (tmp_path / "checkpoints").mkdir()
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    ckpt.write_text("")
    assert interrupted_time(str(tmp_path)) == 0.0  # a checkpoint, but no record of when the attempt began
    os.utime(ckpt, (1000.0, 1000.0))
    (tmp_path / "started").write_text("940.0 30.0\n")
    assert interrupted_time(str(tmp_path)) == pytest.approx(90.0)
    (tmp_path / "started").write_text("1100.0 30.0\n")  # an attempt that died before writing a checkpoint
    assert interrupted_time(str(tmp_path)) == pytest.approx(30.0)


def test_the_curve_plot_averages_only_steps_every_seed_logged():
    # seed 1's point at step 2 was lost (its machine stopped before it reached the disk; the resume started after it)
    steps, means = mean_curve([[(1, 3.0), (2, 2.0), (3, 1.0)], [(1, 5.0), (3, 2.0)]])
    assert steps == [1, 3]
    assert means == [4.0, 1.5]
    assert mean_curve([]) == ([], [])


def test_a_report_merged_from_recorded_results_rebuilds_their_tables(tmp_path):
    """``--report --merge FOLDER`` runs nothing and takes the runs an earlier suite recorded (results.csv and
    tables.json): from the recall frontier's recorded results it writes the same exact tests and frontier table as
    were written from the runs themselves."""
    recorded = os.path.join(REPO, "docs", "frontier_recall10")
    out = tmp_path / "out"
    seeds = [str(s) for s in range(30)]
    args = ["--rows", os.path.join(REPO, "configs", "recall"), "--seeds", *seeds, "--out", str(out), "--report"]
    assert run_tool("suite", *args, "--merge", recorded) == 0
    assert not any(out.glob("*/seed*"))  # nothing was run
    for name in ("protocol.md", "frontier.md"):
        assert (out / name).read_text() == open(os.path.join(recorded, name)).read()


def test_runs_a_merge_folder_holds_are_not_run_again(tmp_path, capsys):
    """A test that outlives one machine resumes from its recorded results: with ``--merge FOLDER`` the runs the
    folder holds are not started, the others are, and a run --out has finished is still read from --out."""
    recorded = os.path.join(REPO, "docs", "frontier_recall10")
    rows = os.path.join(REPO, "configs", "recall")
    with open(os.path.join(recorded, "results.csv")) as f:
        held = {(r["row"], int(r["seed"])) for r in csv.DictReader(f)}
    row, seed = sorted(held)[0]
    missing = max(s for _, s in held) + 1  # a seed the folder does not hold
    args = ["--rows", rows, "--only", row, "--seeds", str(seed), str(missing), "--dry-run"]

    def planned(*more):
        capsys.readouterr()
        assert run_tool("suite", *args, "--out", str(tmp_path / "out"), *more) == 0
        return {int(a.split("=")[1]) for a in capsys.readouterr().out.split() if a.startswith("--seed_everything=")}

    assert planned() == {seed, missing}
    assert planned("--merge", recorded) == {missing}
    done = tmp_path / "out" / row / f"seed{seed}"
    done.mkdir(parents=True)
    (done / "done").write_text("1.0\n")
    assert planned("--merge", recorded) == {seed, missing}  # --out's own finished run wins over the folder's record
