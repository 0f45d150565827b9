import pytest
import torch

from aah_lightning.lit.module import WindowUsage
from aah_lightning.model import window_math
from aah_lightning.model.masks import dense_mask, window_mask_mod
from aah_lightning.windows import metrics


def table_with_fractions(fractions, windows, n=192):
    counts = [round(f * n) for f in fractions]
    values = sum(([w] * c for w, c in zip(windows, counts)), [])
    return torch.tensor(values).view(16, 12)


def test_acr_of_the_papers_grouping_off_row():
    # window fractions .328/.0885/.130/.453 over 512/1024/2048/4096 at T=4096 -> ACR 0.5814 (paper Table 1)
    table = table_with_fractions([63 / 192, 17 / 192, 25 / 192, 87 / 192], [512, 1024, 2048, 4096])
    assert float(metrics.acr(table, 4096)) == pytest.approx(0.5814, abs=1e-4)


@pytest.mark.parametrize(
    "window, coverage, density",
    [(512, 0.2343, 0.2841), (1024, 0.4375, 0.4773), (2048, 0.7499, 0.7727), (4096, 1.0, 1.0)],
)
def test_causal_coverage_and_block_density_of_one_window(window, coverage, density):
    table = torch.full((2, 3), window)
    assert float(metrics.causal_coverage(table, 4096)) == pytest.approx(coverage, abs=1e-4)
    assert float(metrics.block_density(table, 4096, 128)) == pytest.approx(density, abs=1e-4)


def test_windows_beyond_the_sequence_count_as_full():
    table = torch.tensor([[100, 10_000]])
    assert float(metrics.acr(table, 100)) == 1.0
    assert float(metrics.causal_coverage(table, 100)) == 1.0


@pytest.mark.parametrize("sink", [1, 4, 40])
def test_a_sink_raises_acr_and_coverage_by_exactly_its_pairs(sink):
    """The pairs a sink adds, counted on the mask itself (the dense mask of the mask_mod with and without it), raise
    the measured ACR by exactly those pairs over T^2 per head and the causal coverage by them over the causal pairs."""
    T = 64
    table = torch.tensor([[1, 5, 16, 64], [3, 64, 100, 32]], dtype=torch.int32)
    added = 0
    for row in table:
        with_sink = dense_mask(window_mask_mod(row, sink=sink), 1, 4, T, "cpu").sum()
        added += int(with_sink - dense_mask(window_mask_mod(row), 1, 4, T, "cpu").sum())
    assert added == sum(window_math.sink_pairs(int(w), sink, T) for w in table.flatten()) > 0
    heads = table.numel()
    assert float(metrics.acr(table, T, sink) - metrics.acr(table, T)) == pytest.approx(
        added / (heads * T * T), abs=1e-15
    )
    coverage = metrics.causal_coverage(table, T, sink) - metrics.causal_coverage(table, T)
    assert float(coverage) == pytest.approx(added / (heads * T * (T + 1) / 2), abs=1e-15)
    # heads that see the whole sequence pay nothing for it; the run's average (WindowUsage) counts the same
    assert float(metrics.acr(torch.tensor([[64, 80]]), T, sink)) == 1.0
    usage = WindowUsage(2, 4, T, sink)
    for _ in range(3):
        usage.step(table, changed=False)
    torch.testing.assert_close(usage.head_acr(), metrics.head_acr(table, T, sink), rtol=0, atol=1e-15)
    assert float(usage.head_acr().mean()) == pytest.approx(float(metrics.acr(table, T, sink)), abs=1e-15)


def test_causal_pairs_counts_by_hand():
    # T=5, W=2: query 0 sees 1 key, queries 1..4 see 2 -> 9 pairs; full causal 15
    assert float(metrics.causal_pairs(torch.tensor(2), 5)) == 9
    assert float(metrics.causal_coverage(torch.tensor([[2, 5]]), 5)) == pytest.approx((9 + 15) / 30)
