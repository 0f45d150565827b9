"""A smoke run shorter than the config's validation interval runs, validates once at its end, and says so once."""

from __future__ import annotations

import warnings

from aah_lightning.cli import main
from tb import read_events


def test_validation_interval_longer_than_the_run_validates_at_the_end(tmp_path, tiny_args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(tiny_args("--trainer.val_check_interval=50", steps=3))
    ours = [str(w.message) for w in caught if str(w.message).startswith("trainer.val_check_interval")]
    assert len(ours) == 1 and "trainer.val_check_interval=50" in ours[0] and "at the end" in ours[0], ours
    scalars = read_events(tmp_path / "runs")["scalars"]
    # Steps are logged from 0: the three steps are 0, 1, 2, and the one validation comes after the last.
    assert [step for step, _ in scalars["train/loss"]] == [0, 1, 2]
    assert [step for step, _ in scalars["val/loss"]] == [2]
