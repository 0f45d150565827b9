"""A suite's frontier outputs (aah_lightning/experiments) on hand-made records: the per-step ACR mean, the frontier table, positions.md."""

import math

import pytest

from aah_lightning.experiments import outputs, tables
from aah_lightning.experiments.records import COLUMNS, eval_lengths, last_step, step_mean
from helpers.cli import run_tool


def record(row, seed, val, acr, long=None, **pos):
    x = {"row": row, "seed": seed, "wall_s": 1.0, **{c: math.nan for c in COLUMNS}}
    x.update(val_loss=val, acr_mean=acr, acr=acr)
    if long is not None:
        x["seq2048 val_loss"] = long
    x.update({f"pos {k.replace('_', '-')[1:]}": v for k, v in pos.items()})
    return x


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_step_mean_weights_each_value_by_the_steps_it_held():
    # steps 1..6 hold 1, 1, 0.5, 0.5, 0.5, 0.25
    assert step_mean([(1, 1.0), (3, 0.5), (6, 0.25)]) == pytest.approx(3.75 / 6)
    assert step_mean([(4, 0.3)]) == pytest.approx(0.3)
    # a run of 8 steps whose table last changed at step 6: 0.25 holds for steps 6, 7 and 8
    assert step_mean([(1, 1.0), (3, 0.5), (6, 0.25)], end=8) == pytest.approx(4.25 / 8)
    series = {"aah/acr": [(1, 1.0), (6, 0.5)], "val/loss": [(3, 2.0), (7, 1.5)], "train/loss": [(7, 1.0)]}
    assert last_step(series) == 8  # val/loss at index 7 = after the 8th step


def test_frontier_table_pairs_by_seed_and_shows_what_was_paid(tmp_path):
    records = [
        record("baseline", 0, 2.0, 1.0, long=2.5),
        record("baseline", 1, 2.2, 1.0, long=2.9),
        record("fixed_acr0.25", 0, 1.9, 0.25, long=2.0),
        record("fixed_acr0.25", 1, 2.0, 0.25, long=2.1),
        record("adaptive_model_acr0.25", 0, 1.95, 0.255, long=2.2),
        record("adaptive_model_acr0.25", 1, 2.3, 0.238, long=2.6),
    ]
    rows = ["adaptive_model_acr0.25", "baseline", "fixed_acr0.25"]
    by_row = {r: [x for x in records if x["row"] == r] for r in rows}
    base = {0: 2.0, 1: 2.2}
    lines = tables.frontier_table(by_row, base, eval_lengths(records)).splitlines()
    assert cells(lines[0])[-2:] == ["val loss at 2048 tokens", "Δ at 2048 tokens vs baseline"]
    body = [cells(line) for line in lines[2:]]
    assert [(b[0], b[1]) for b in body] == [("1", "baseline"), ("0.25", "fixed"), ("0.25", "adaptive_model")]
    fixed, adaptive = body[1], body[2]
    assert fixed[3] == "0.250 ± 0.000" and fixed[4] == "+0.000"
    # mean -0.15, std 0.0707 over 2 seeds: half-width t(0.975, 1) * 0.0707 / sqrt(2) = 12.706 * 0.05
    assert fixed[6] == "-0.1500 [-0.7853, +0.4853]" and fixed[7] == "-0.100 / -0.200"
    assert fixed[9] == "-0.6500 ± 0.2121"  # 2.0 - 2.5 and 2.1 - 2.9
    assert adaptive[4] == "-0.012"  # the seed furthest from its target, with its sign
    assert adaptive[6] == "+0.0250 [-0.9279, +0.9779]"  # -0.05 and +0.1


def test_positions_md_orders_buckets_by_position(tmp_path):
    records = [record("fixed_acr0.25", s, 2.0, 0.25, p0_63=3.0 + s, p64_127=2.0, p128_255=1.0) for s in (0, 1)]
    text = tables.position_tables(records, ["fixed_acr0.25"])
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert cells(lines[0]) == ["row", "0-63", "64-127", "128-255"]
    assert cells(lines[2]) == ["fixed_acr0.25", "3.5000 ± 0.7071", "2.0000 ± 0.0000", "1.0000 ± 0.0000"]


def test_write_outputs_adds_the_frontier_files(tmp_path):
    records = [
        record("baseline", 0, 2.0, 1.0),
        record("fixed_acr0.25", 0, 1.9, 0.25),
        record("fixed_acr0.5", 0, 1.95, 0.5),
    ]
    rows = ["baseline", "fixed_acr0.25", "fixed_acr0.5"]
    outputs.write_outputs(str(tmp_path), records, rows, {(r, 0): [(1, 2.0)] for r in rows})
    for name in ("results.md", "results.csv", "positions.md", "frontier.md", "frontier.png"):
        assert (tmp_path / name).exists(), name


def test_trained_span_table_pairs_with_the_baseline_held_to_its_trained_span(tmp_path):
    records = [
        {**record("baseline", 0, 2.0, 1.0, long=2.5), "span2048 val_loss": 1.9},
        {**record("baseline", 1, 2.2, 1.0, long=2.9), "span2048 val_loss": 2.1},
        {**record("fixed_acr0.25", 0, 1.9, 0.25, long=2.0), "span2048 val_loss": 2.0},
        {**record("fixed_acr0.25", 1, 2.0, 0.25, long=2.1), "span2048 val_loss": 2.1},
    ]
    assert eval_lengths(records) == [2048] and eval_lengths(records, "span") == [2048]
    by_row = {r: [x for x in records if x["row"] == r] for r in ("baseline", "fixed_acr0.25")}
    lines = tables.span_table(by_row, [2048]).splitlines()
    body = [cells(line) for line in lines[2:]]
    assert body[0][:4] == ["1", "baseline", "2", "2.0000 ± 0.1414"] and body[0][4] == "–"
    assert body[1][:5] == ["0.25", "fixed", "2", "2.0500 ± 0.0707", "+0.0500 ± 0.0707"]  # +0.1 and 0.0
    outputs.write_outputs(str(tmp_path), records, list(by_row), {(r, s): [(1, 2.0)] for r in by_row for s in (0, 1)})
    assert "trained span" in (tmp_path / "frontier.md").read_text()


def test_dry_run_lists_a_trained_span_validation_per_length(tmp_path, capsys):
    args = ["--rows", "configs/frontier", "--only", "baseline", "--seeds", "0", "--out", str(tmp_path), "--dry-run"]
    assert run_tool("suite", *args, "--eval-seq-lens", "2048", "--eval-trained-span") == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if " validate " in line]
    assert len(commands) == 2
    assert "full_heads_beyond_trained" not in commands[0] and "seq2048" in commands[0]
    assert "--model.gpt.full_heads_beyond_trained=trained_span" in commands[1] and "seq2048_span" in commands[1]


def test_versus_uniform_pairs_each_family_with_the_fixed_row_of_its_target():
    records = [
        record("baseline", 0, 2.0, 1.0),
        record("fixed_acr0.25", 0, 1.9, 0.25),
        record("fixed_acr0.25", 1, 2.0, 0.25),
        record("static_acr0.25", 0, 1.8, 0.25),
        record("static_acr0.25", 1, 1.95, 0.25),
        record("random_acr0.25", 0, 2.0, 0.25),
        record("random_acr0.25", 1, 1.9, 0.25),
        record("random_acr0.5", 0, 1.0, 0.5),  # no fixed row at 0.5: nothing to pair with
    ]
    rows = ["baseline", "fixed_acr0.25", "static_acr0.25", "random_acr0.25", "random_acr0.5"]
    by_row = {r: [x for x in records if x["row"] == r] for r in rows}
    body = [cells(line) for line in tables.versus_uniform_table(by_row).splitlines()[2:]]
    assert body == [  # two seeds: even a difference of the same sign in both is not resolved at 95 %
        ["0.25", "static", "–", "-0.0750 [-0.3926, +0.2426]", "not resolved", "-0.100 / -0.050"],
        ["0.25", "random", "–", "+0.0000 [-1.2706, +1.2706]", "not resolved", "+0.100 / -0.100"],
    ]
