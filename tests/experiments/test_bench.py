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


def test_the_static_table_keeps_one_key_value_head_in_n_whole_and_the_widest_window_within_the_acr():
    import torch

    from aah_lightning.benchmarks.common import static_table
    from aah_lightning.windows import metrics

    # SmolLM2-135M's shape: 30 layers, 9 query heads, 3 key/value heads
    table, width = static_table(30, 9, 3, 2048, 0.25, 4, 6)
    kv = table.view(30, 3, 3)
    assert bool((kv == kv[..., :1]).all())  # the query heads of a key/value head alike: the ACR is the KV share
    assert int((kv[..., 0] == 2048).sum()) == 15 and bool((kv[::2, 0, 0] == 2048).all())  # one in 6, in order
    assert set(table.flatten().tolist()) == {width, 2048}
    assert (
        float(metrics.acr(table, 2048, 4))
        <= 0.25
        < float(metrics.acr(torch.where(table < 2048, width + 1, table), 2048, 4))
    )
    with pytest.raises(ValueError, match="the full heads and the sink alone cover more"):
        static_table(30, 9, 3, 2048, 0.1, 4, 6)
