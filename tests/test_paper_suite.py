"""tools/suite.py end to end: a 2-row x 2-seed micro-suite of real (tiny) runs, and its table checked against the
runs' TensorBoard events read back independently with tests/tb.py."""

import csv
import importlib.util
import math
import os
import statistics
from pathlib import Path

import pytest
from tb import read_events

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("suite", ROOT / "tools" / "suite.py")
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)

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
  n_layer: 2
  n_head: 4
  n_embd: 32
  aah:
    candidates: [4, 8, 16, 32]
    controller: {warmup_steps: 2, control_interval: 2, depth: 2}
data:
  source: synthetic
  seq_len: 32
  batch_size: 4
  synthetic_documents: 64
"""
ROWS = {
    "baseline": "model:\n  aah:\n    policy: full\n",
    # a compute ceiling makes the controller shorten windows even in a 6-step run
    "full_adaptive": "model:\n  aah:\n    policy: adaptive\n    controller: {target_acr: 0.5}\n",
}
SEEDS = [0, 1]


def last(events, tag):
    return sorted(events["scalars"][tag])[-1][1]


def val_losses(events):
    """The two validations of a micro run (after steps 3 and 6), in step order."""
    return [v for _, v in sorted(events["scalars"]["val/loss"])]


def cell(table_line: str, column: int) -> str:
    return [c.strip() for c in table_line.strip().strip("|").split("|")][column]


@pytest.mark.heavy
def test_micro_suite_writes_the_table_of_the_real_runs(tmp_path, capsys):
    rows_dir, out = tmp_path / "rows", tmp_path / "out"
    rows_dir.mkdir()
    (rows_dir / "base.yaml").write_text(BASE)
    for name, text in ROWS.items():
        (rows_dir / f"{name}.yaml").write_text(text)
    suite.main(["--rows", str(rows_dir), "--seeds", *map(str, SEEDS), "--out", str(out)])

    # every run's events, read independently of the suite
    events = {(r, s): read_events(out / r / f"seed{s}") for r in ROWS for s in SEEDS}
    for (r, s), ev in events.items():
        assert len(ev["scalars"]["val/loss"]) == 2, (r, s)  # validations after steps 3 and 6: the runs finished
    with open(out / "results.csv") as f:
        records = list(csv.DictReader(f))
    assert [(x["row"], int(x["seed"])) for x in records] == [(r, s) for r in sorted(ROWS) for s in SEEDS]
    assert set(records[0]) == {"row", "seed", "wall_s", *suite.COLUMNS}
    for x in records:
        ev = events[(x["row"], int(x["seed"]))]
        assert float(x["val_loss"]) == pytest.approx(last(ev, "val/loss"), rel=1e-6)
        assert float(x["acr"]) == pytest.approx(last(ev, "aah/acr"), rel=1e-6)
        tps = statistics.median(v for _, v in ev["scalars"]["perf/tokens_per_sec"])
        assert float(x["tokens_per_sec"]) == pytest.approx(tps, rel=1e-6)
        assert float(x["wall_s"]) > 0

    lines = (out / "results.md").read_text().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["row", "seeds", "val loss", "val ppl", "Δ val loss vs baseline", "gain in last val interval",
                      "ACR", "causal coverage", "block density", "attention-mass coverage", "tokens/s"]
    body = {cell(line, 0): line for line in lines[2:]}
    assert set(body) == set(ROWS)
    loss = {r: [last(events[(r, s)], "val/loss") for s in SEEDS] for r in ROWS}
    for r in ROWS:
        assert cell(body[r], 1) == "2"
        assert cell(body[r], 2) == f"{statistics.fmean(loss[r]):.4f} ± {statistics.stdev(loss[r]):.4f}"
        acr = [last(events[(r, s)], "aah/acr") for s in SEEDS]
        assert cell(body[r], 6) == f"{statistics.fmean(acr):.3f} ± {statistics.stdev(acr):.3f}"
        gains = [first_val - last_val for first_val, last_val in (val_losses(events[(r, s)]) for s in SEEDS)]
        assert cell(body[r], 5) == f"{statistics.fmean(gains):.4f} ± {statistics.stdev(gains):.4f}"
        ppl = [last(events[(r, s)], "val/ppl") for s in SEEDS]
        assert cell(body[r], 3) == f"{statistics.fmean(ppl):.2f} ± {statistics.stdev(ppl):.2f}"
    diffs = [a - b for a, b in zip(loss["full_adaptive"], loss["baseline"])]  # paired by seed
    assert cell(body["full_adaptive"], 4) == f"{statistics.fmean(diffs):+.4f} ± {statistics.stdev(diffs):.4f}"
    assert cell(body["baseline"], 4) == "–"
    assert cell(body["baseline"], 6) == "1.000 ± 0.000"  # the baseline's every head sees the whole context
    assert float(cell(body["full_adaptive"], 6).split()[0]) <= 0.5  # the controller shortened the windows
    assert (out / "val_loss_vs_acr.png").stat().st_size > 0
    assert (out / "val_loss_curves.png").stat().st_size > 0

    # the seed reaches the policy: each run's adaptive state was seeded by its own seed
    for s in SEEDS:
        assert f"--model.aah.seed={s}" in suite.fit_command(str(rows_dir), str(rows_dir / "baseline.yaml"), s,
                                                              str(out), [])

    # a second invocation reuses the finished runs instead of training again
    stamps = {p: os.path.getmtime(p) for p in out.glob("*/seed*/done")}
    capsys.readouterr()
    suite.main(["--rows", str(rows_dir), "--seeds", *map(str, SEEDS), "--out", str(out)])
    assert {p: os.path.getmtime(p) for p in out.glob("*/seed*/done")} == stamps
    assert "val" in capsys.readouterr().out
    assert not math.isnan(float(records[0]["val_loss"]))
