"""Overlays (policies, paper rows) name their runs but keep the logger the user chose.

configs/cluster/long_context.yaml layers onto ddp.yaml through the real CLI parser (printed, not built: the
cluster configs need GPUs and the hub corpus)."""

from __future__ import annotations

import glob
import os

import pytest
import yaml

from aah_lightning.cli import AAHCLI, main
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.module import AAHModule
from helpers.cli import REPO

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


def test_long_context_config_parses_on_top_of_ddp(capsys):
    args = ["--config", "configs/cluster/ddp.yaml", "--config", "configs/cluster/long_context.yaml", "--print_config"]
    with pytest.raises(SystemExit) as done:
        AAHCLI(
            AAHModule,
            TextDataModule,
            run=False,
            args=args,
            seed_everything_default=1234,
            auto_configure_optimizers=False,
        )
    assert done.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["data"]["seq_len"] == 16384 and config["data"]["batch_size"] == 1
    gpt = config["model"]["gpt"]
    assert gpt["backend"] == "auto" and gpt["rope_base"] == 500000.0
    assert gpt["n_layer"] == 12 and config["trainer"]["precision"] == "bf16-mixed"  # from ddp.yaml
