"""``aah fit`` end to end on a tiny config: TensorBoard tags, checkpoints with the window table, resume.

A smoke run shorter than the config's validation interval runs, validates once at its end, and says so once."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from aah_lightning.cli import main
from helpers.cli import REPO
from helpers.tb import read_events


def test_fit_logs_the_tags_and_checkpoints_the_window_table(tmp_path, tiny_args):
    main(tiny_args("--model.aah.policy=random", "--model.aah.candidates=[4,8,16,32]", steps=6))
    events = read_events(tmp_path / "runs")
    for tag in (
        "train/loss",
        "train/lr",
        "val/loss",
        "val/ppl",
        "perf/tokens_per_sec",
        "aah/acr",
        "aah/causal_coverage",
    ):
        assert tag in events["scalars"], tag
    assert "aah/windows" in events["histograms"]
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    table = ckpt["state_dict"]["model.windows"]
    assert table.shape == (2, 4) and table.dtype == torch.int32
    assert set(table.flatten().tolist()) <= {4, 8, 16, 32}
    acr = [v for _, v in events["scalars"]["aah/acr"]]
    assert acr[-1] == pytest.approx(table.double().clamp(max=32).mean().item() / 32, rel=1e-6)
    assert ckpt["global_step"] == 6


def test_resume_from_last_continues_at_the_saved_step(tmp_path, tiny_args):
    main(tiny_args(steps=3))
    first = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert first["global_step"] == 3
    main(tiny_args("--ckpt_path=last", steps=6))
    second = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert second["global_step"] == 6
    steps = sorted(s for s, _ in read_events(tmp_path / "runs")["scalars"]["train/loss"])
    assert steps[-1] >= 5 and min(s for s in steps if s >= 3) >= 3  # the resumed run logs steps 3.., not 0..


def test_validate_and_test_subcommands_use_a_checkpoint(tmp_path, tiny_args):
    main(tiny_args(steps=3))
    ckpt = f"--ckpt_path={tmp_path}/ckpt/last.ckpt"
    main(tiny_args(ckpt, subcommand="validate"))
    main(tiny_args(ckpt, subcommand="test"))
    scalars = read_events(tmp_path / "runs")["scalars"]
    assert "test/loss" in scalars and "test/ppl" in scalars


def test_print_config_shows_linked_settings(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", os.path.join(REPO, "configs", "quickstart.yaml"), "--print_config"])
    assert not exc.value.code
    out = capsys.readouterr().out
    assert "policy: random" in out and "seq_len: 256" in out and "source: stdlib" in out
    assert "model:\n  gpt:\n    n_layer: 4\n" in out  # the GPT's settings, one group


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


def test_the_progress_bar_of_a_step_bounded_run_has_no_negative_epoch_limit(tmp_path):
    from aah_lightning.cli import AAHCLI
    from aah_lightning.lit.datamodule import TextDataModule
    from aah_lightning.lit.module import AAHModule
    from aah_lightning.lit.throughput import ProgressBar
    from helpers.cli import tiny_config

    config = tiny_config(tmp_path, trainer={"enable_progress_bar": True})
    cli = AAHCLI(AAHModule, TextDataModule, run=False, auto_configure_optimizers=False, args=["--config", config])
    bar = cli.trainer.progress_bar_callback
    assert type(bar) is ProgressBar
    bar.setup(cli.trainer, cli.model, "fit")
    for max_epochs, description in ((-1, "Epoch 0"), (3, "Epoch 0/2")):
        cli.trainer.fit_loop.max_epochs = max_epochs
        assert bar._get_train_description(0).strip() == description
