"""Overlays (policies, paper rows) name their runs but keep the logger the user chose."""

from __future__ import annotations

import glob
import os

import pytest
import yaml

from _cli_helpers import REPO
from aah_lightning.cli import main

OVERLAYS = sorted(glob.glob(f"{REPO}/configs/policies/*.yaml")) + [
    f"{REPO}/configs/{s}/static.yaml" for s in ("cpu", "paper")
]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: os.path.relpath(p, f"{REPO}/configs"))
def test_an_overlay_keeps_the_users_logger(overlay, tmp_path, capsys):
    folder = os.path.dirname(overlay)
    base = f"{folder}/base.yaml" if os.path.exists(f"{folder}/base.yaml") else f"{REPO}/configs/quickstart.yaml"
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "logger": {
                        "class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(tmp_path / "csv")},
                    }
                }
            }
        )
    )
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", base, "--config", str(mine), "--config", overlay, "--print_config"])
    assert exc.value.code == 0
    logger = yaml.safe_load(capsys.readouterr().out)["trainer"]["logger"]
    assert logger["class_path"] == "lightning.pytorch.loggers.CSVLogger"
    assert logger["init_args"]["save_dir"] == str(tmp_path / "csv")
    assert logger["init_args"]["name"] == yaml.safe_load(open(overlay))["trainer"]["logger"]["init_args"]["name"]
