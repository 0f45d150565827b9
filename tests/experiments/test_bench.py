"""tools/bench.py runs end to end on tiny shapes (no compile: sections b, d and f only; the rest needs minutes)."""

import pytest

from helpers.cli import run_tool


@pytest.mark.heavy  # an end-to-end tool run (~15 s on a quiet 2-core machine)
def test_bench_tiny_sections_b_d_and_f(capsys):
    args = ["--sections", "bdf", "--train-seq-len", "256", "--train-repeats", "1", "--repeats", "1"]
    assert run_tool("bench", *args, "--seq-lens", "128", "--heads", "4") == 0
    out = capsys.readouterr().out
    assert "(b) training step" in out and "auto -> banded" in out and "auto -> causal" in out
    assert "(d) mask rebuild" in out and "| banded |" in out
    assert "(f) one attention layer" in out and "| 128 | 0.5 | split, weights reordered (head_groups) |" in out
    assert "command: `PYTHONPATH=. python" in out
