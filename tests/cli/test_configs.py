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


def _merged(*paths):
    def merge(a, b):
        for k, v in b.items():
            a[k] = merge(a.get(k) or {}, v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
        return a

    out = {}
    for p in paths:
        with open(p) as f:
            merge(out, yaml.safe_load(f) or {})
    return out


ROWS = sorted(
    p
    for folder in ("recall", "copy", "relay", "relay_lean", "retrofit/recall")
    for p in glob.glob(f"{REPO}/configs/{folder}/*.yaml")
    if "base.yaml" not in p
)


@pytest.mark.parametrize("row", ROWS, ids=lambda p: "/".join(p.split("/")[-2:]))
def test_every_recall_and_copy_row_builds_its_policy_within_its_run(row):
    """Each row's window policy is built from base + row as a run would, and a budget over the run (reach first
    included) is checked against the run's length before any step."""
    from aah_lightning.windows.config import AAHConfig
    from aah_lightning.windows.policy_base import make_policy

    cfg = _merged(os.path.join(os.path.dirname(row), "base.yaml"), row)
    gpt, data = cfg["model"]["gpt"], cfg["data"]
    policy = make_policy(AAHConfig(**cfg["model"]["aah"]), gpt["n_layer"], gpt["n_head"], data["seq_len"])
    if hasattr(policy, "set_run_length"):
        policy.set_run_length(cfg["trainer"]["max_steps"])
    table = policy.initial_table()
    assert table.shape == (gpt["n_layer"], gpt["n_head"])
