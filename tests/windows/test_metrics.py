import pytest
import torch

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


def test_causal_pairs_counts_by_hand():
    # T=5, W=2: query 0 sees 1 key, queries 1..4 see 2 -> 9 pairs; full causal 15
    assert float(metrics.causal_pairs(torch.tensor(2), 5)) == 9
    assert float(metrics.causal_coverage(torch.tensor([[2, 5]]), 5)) == pytest.approx((9 + 15) / 30)
