"""What a run's windows cost per head over the run, whether heads differed, and how the suite reports it."""

import math

import torch

from aah_lightning.cli import main
from aah_lightning.experiments import stats
from aah_lightning.experiments.records import window_summary
from aah_lightning.experiments.tables import heads_cell, recall_table, versus_uniform_table
from aah_lightning.lit.module import WindowUsage


def test_head_acr_is_the_step_weighted_mean_and_nonuniform_steps_are_counted():
    usage = WindowUsage(1, 2, seq_len=8)
    tables = [[[8, 8]]] * 3 + [[[2, 8]]] * 1 + [[[4, 16]]] * 2  # 16 >= T counts as T
    previous = None
    for t in tables:
        t = torch.tensor(t, dtype=torch.int32)
        usage.step(t, previous is None or not torch.equal(t, previous))
        previous = t
    expected = torch.tensor([[(3 * 8 + 2 + 2 * 4) / 6 / 8, 1.0]], dtype=torch.float64)
    assert torch.allclose(usage.head_acr(), expected)
    assert (usage.steps, usage.nonuniform_steps) == (6, 3)
    restored = WindowUsage(1, 2, seq_len=8)
    restored.load_state_dict(usage.state_dict())
    assert torch.equal(restored.head_acr(), usage.head_acr()) and restored.nonuniform_steps == 3


def test_the_last_checkpoint_tells_the_final_table_and_what_each_head_paid(tmp_path, tiny_args):
    # Random windows redrawn every 2 steps over 6 steps: the checkpoint's per-head ACR is the mean of three draws.
    main(
        tiny_args(
            "--model.aah.policy=random", "--model.aah.candidates=[4,8,16,32]", "--model.aah.random.redraw_interval=2"
        )
    )
    fields, tables = window_summary(str(tmp_path / "ckpt" / "last.ckpt"))
    head_acr = torch.tensor(tables["head_acr"])
    assert head_acr.shape == (2, 4) and ((head_acr > 0) & (head_acr <= 1)).all()
    assert fields["final_distinct_max"] == max(len(set(r)) for r in tables["final_table"])
    assert 0 < fields["nonuniform_share"] <= 1


def test_confidence_intervals_and_verdicts():
    assert stats.t975(4) == 2.776 and math.isclose(stats.t975(60), 2.0, abs_tol=0.01)
    mean, low, high = stats.ci95([1.0, 2.0, 3.0])
    assert mean == 2.0 and math.isclose(high - mean, 4.303 * 1.0 / math.sqrt(3), rel_tol=1e-9)
    assert stats.verdict([-0.05, -0.06, -0.04, -0.05, -0.055]) == "better"  # lower loss, interval below 0
    assert stats.verdict([-0.05, 0.01, -0.04, 0.02, -0.03]) == "not resolved"
    assert stats.verdict([0.05, 0.06, 0.04], higher_is_better=True) == "better"
    assert stats.verdict([-0.1]) == "not resolved"  # one seed: no interval
    assert stats.interval([0.1, 0.2, 0.3]).startswith("+0.200 [")


def _rec(row, seed, loss, policy, share, acc=None):
    x = {"row": row, "seed": seed, "val_loss": loss, "policy": policy, "nonuniform_share": share, "acr_mean": 0.25}
    if acc is not None:
        x.update({"recall_acc": acc, "recall 1-32": acc + 0.1, "recall 33-64": acc - 0.1})
    return x


def test_suite_tables_flag_per_head_rows_whose_heads_never_differed():
    by_row = {
        "fixed_acr0.25": [_rec("fixed_acr0.25", s, 2.0 + s / 100, "fixed", 0.0, 0.3) for s in range(5)],
        "adaptive_layer_acr0.25": [
            _rec("adaptive_layer_acr0.25", s, 1.9 + s / 100, "adaptive", 0.0, 0.5) for s in range(5)
        ],
        "static_acr0.25": [
            _rec("static_acr0.25", s, 2.0 + s / 100 + d, "static", 1.0, 0.31)
            for s, d in enumerate([0.01, -0.02, 0.0, 0.02, -0.01])
        ],
    }
    assert "UNIFORM in every seed: not per-head" in heads_cell(by_row["adaptive_layer_acr0.25"])
    assert "UNIFORM" not in heads_cell(by_row["fixed_acr0.25"])  # one window for all by design
    assert heads_cell(by_row["static_acr0.25"]) == "100% of steps, 5/5 seeds"
    table = versus_uniform_table(by_row)
    adaptive = next(line for line in table.splitlines() if "| adaptive_layer |" in line)
    assert "UNIFORM" in adaptive and "| better |" in adaptive  # -0.1 nats in every seed: the interval excludes 0
    static = next(line for line in table.splitlines() if "| static |" in line)
    assert static.count("not resolved") == 1 and static.endswith("| better |")  # recall +0.01 in every seed
    recall = recall_table(by_row, list(by_row))
    assert "| 1-32 | 33-64 |" in recall.splitlines()[0]
