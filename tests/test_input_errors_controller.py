"""Bad settings of the adaptive policy (model.aah.controller.*) end `aah` with one line, like every other input."""

from __future__ import annotations

import pytest

from test_input_errors import refuse

ADAPTIVE = ("--model.aah.policy", "adaptive")


@pytest.mark.parametrize(
    "setting, value, allowed",
    [
        ("allocator", "greedy", "reach"),
        ("feature_set", "everything", "paper, reach or all"),
        ("grouping", "kmeans", "cluster, none or fixed_random"),
    ],
)
def test_unknown_controller_choice(tmp_path, capsys, setting, value, allowed):
    line = refuse(tmp_path, capsys, *ADAPTIVE, f"--model.aah.controller.{setting}", value)
    assert f"model.aah.controller.{setting}='{value}'" in line and allowed in line


@pytest.mark.parametrize("value", ["0", "1.5"])
def test_coverage_target_outside_zero_one(tmp_path, capsys, value):
    line = refuse(tmp_path, capsys, *ADAPTIVE, "--model.aah.controller.coverage_target", value)
    assert f"model.aah.controller.coverage_target={float(value)}" in line and "(0, 1]" in line


@pytest.mark.parametrize("budget", ["target_acr", "target_causal_coverage"])
def test_budget_below_the_smallest_windows_cost(tmp_path, capsys, budget):
    # Candidates [8, 16, 32] at seq_len 32: the smallest window alone costs well above 0.01 on either measure.
    line = refuse(tmp_path, capsys, *ADAPTIVE, f"--model.aah.controller.{budget}", "0.01")
    assert f"model.aah.controller.{budget}=0.01" in line and "smallest candidate window 8" in line
