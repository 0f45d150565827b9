"""A run continued from its checkpoint logs like one that was never stopped: into its own log folder, and at the
same steps. Extending a finished run (a larger max_steps) is the case where Lightning's bookkeeping slipped."""

from __future__ import annotations

import os

import pytest

from aah_lightning.cli import main
from tb import read_events

# The checkpoint interval does not divide the first run's length: its last checkpoint is the final step's.
ARGS = ["--checkpoint.every_n_train_steps=4", "--trainer.enable_model_summary=false"]


def _curves(folder) -> dict[str, list[tuple[int, float]]]:
    scalars = read_events(folder / "runs")["scalars"]
    return {tag: scalars[tag] for tag in ("train/loss", "val/loss", "epoch")}


def test_an_extended_run_logs_the_uninterrupted_runs_steps_into_its_own_folder(tmp_path, tiny_args):
    main(tiny_args(*ARGS, steps=10))
    os.rename(tmp_path / "runs", tmp_path / "whole")
    main(tiny_args(*ARGS, steps=6))
    main(tiny_args(*ARGS, "--ckpt_path=last", steps=10))
    whole = {tag: values for tag, values in read_events(tmp_path / "whole")["scalars"].items()}
    extended = _curves(tmp_path)
    for tag in ("train/loss", "val/loss"):
        assert [s for s, _ in extended[tag]] == [s for s, _ in whole[tag]], tag
        assert [v for _, v in extended[tag]] == pytest.approx([v for _, v in whole[tag]], rel=1e-5), tag
    assert [s for s, _ in extended["epoch"]] == [s for s, _ in whole["epoch"]]
    # The finished run had completed its pass over its data, so the extension counts one more epoch, not two.
    assert max(v for _, v in extended["epoch"]) == 1
    # One run, one folder: the resume wrote its events and config.yaml next to the first part's.
    assert os.listdir(tmp_path / "runs" / "tiny") == ["version_0"]
    assert os.path.exists(tmp_path / "runs" / "tiny" / "version_0" / "config.yaml")


def test_a_resume_keeps_a_log_version_the_config_gives(tmp_path, tiny_args):
    main(tiny_args(*ARGS, steps=2))
    main(tiny_args(*ARGS, "--ckpt_path=last", "--trainer.logger.init_args.version=second_part", steps=3))
    assert sorted(os.listdir(tmp_path / "runs" / "tiny")) == ["second_part", "version_0"]
