"""Loggers other than TensorBoard: scalars reach CSVLogger and W&B; histograms, the window map and text reach W&B;
a logger without them (CSV) gets the scalars and nothing breaks."""

from __future__ import annotations

import csv
import glob
import json
import os

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from aah_lightning.cli import main
from aah_lightning.lit.media import TensorBoardMedia, media_loggers

CORPUS = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 0\n" * 40


def fit_args(tmp_path, *logger) -> list[str]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    return [
        "fit",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        *logger,
        f"--checkpoint.dirpath={tmp_path}/ckpts",
        "--model.gpt.n_layer=2",
        "--model.gpt.n_head=4",
        "--model.gpt.n_embd=32",
        "--model.aah.policy=random",
        "--model.aah.candidates=[8, 16, 32]",
        "--data.source=files",
        f"--data.files.paths=[{corpus}]",
        "--data.seq_len=32",
        "--data.batch_size=4",
        "--diagnostics.every_n_steps=2",
        "--diagnostics.amc_every_n_steps=2",
        "--sample.max_new_tokens=8",
    ]


def test_csv_logger_gets_every_scalar_and_nothing_breaks(tmp_path):
    main(
        fit_args(
            tmp_path,
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={tmp_path}/csv",
        )
    )
    (path,) = glob.glob(f"{tmp_path}/csv/*/version_0/metrics.csv")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    for tag in ("train/loss", "val/loss", "val/bpb", "aah/acr", "aah/causal_coverage", "aah/attention_mass_coverage"):
        assert tag in columns, tag
    acr = [float(r["aah/acr"]) for r in rows if r["aah/acr"]]
    assert acr and all(0 < v <= 1 for v in acr)
    assert {int(r["step"]) for r in rows if r["val/loss"]} == {1, 3}  # both validations (steps 2 and 4)
    assert os.path.isfile(f"{tmp_path}/ckpts/last.ckpt")


def test_media_goes_only_to_loggers_that_show_it(tmp_path):
    class Trainer:
        loggers = [CSVLogger(str(tmp_path)), TensorBoardLogger(str(tmp_path))]

    media = media_loggers(Trainer())
    assert len(media) == 1 and isinstance(media[0], TensorBoardMedia)
    Trainer.loggers = [CSVLogger(str(tmp_path))]
    assert media_loggers(Trainer()) == []


@pytest.mark.heavy
def test_wandb_offline_gets_the_window_map_hierarchy_and_sample(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # nothing in the user's home folder
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    logger = [
        "--trainer.logger=lightning.pytorch.loggers.WandbLogger",
        f"--trainer.logger.save_dir={tmp_path}",
        "--trainer.logger.offline=true",
        "--trainer.logger.project=aah-test",
    ]
    main(fit_args(tmp_path, *logger))
    (run,) = glob.glob(f"{tmp_path}/wandb/offline-run-*")
    assert glob.glob(f"{run}/run-*.wandb")  # the run's history (scalars included)
    assert glob.glob(f"{run}/files/media/images/aah/window_map_*.png")
    assert glob.glob(f"{run}/files/media/table/aah/hierarchy_*.table.json")
    samples = sorted(glob.glob(f"{run}/files/media/table/val/sample_*.table.json"))
    assert len(samples) == 2  # one per validation
    with open(samples[-1]) as f:
        table = json.load(f)
    assert table["columns"] == ["step", "text"] and table["data"][0][1].startswith("def ")
