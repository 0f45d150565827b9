"""tools/inspect_windows.py (aah_lightning/windows/inspection.py) on real checkpoints of a tiny run."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from aah_lightning.cli import main as aah
from aah_lightning.model import masks
from aah_lightning.windows import metrics, plots
from helpers.cli import run_tool

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from helpers.cli import tiny_cli_args

    tmp = tmp_path_factory.mktemp("inspect")
    aah(
        tiny_cli_args(
            tmp,
            "--model.aah.policy=random",
            "--model.aah.candidates=[4,8,16,32]",
            "--diagnostics.amc_every_n_steps=0",
            "--trainer.val_check_interval=2",
            steps=2,
        )
    )
    return tmp / "ckpt" / "last.ckpt"


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_csv_and_map_match_the_checkpoint(checkpoint, tmp_path, capsys):
    assert run_tool("inspect_windows", str(checkpoint), "--out", str(tmp_path)) == 0
    table = torch.load(checkpoint, weights_only=True)["state_dict"]["model.windows"]
    rows = read_csv(tmp_path / "windows.csv")
    assert [(int(r["layer"]), int(r["head"]), int(r["window"])) for r in rows] == [
        (l, h, int(table[l, h])) for l in range(2) for h in range(4)
    ]
    assert all(r["group"] == "" for r in rows)  # the random policy has no groups
    with Image.open(tmp_path / "window_map.png") as image:
        assert image.size == plots.window_map_size(2, 4)
    out = capsys.readouterr().out
    assert f"ACR {float(metrics.acr(table, 32)):.4f}" in out
    assert f"causal coverage {float(metrics.causal_coverage(table, 32)):.4f}" in out
    assert "block density 1.0000" in out  # T=32 fits in one tile of 128
    assert "policy random has no groups" in out


def test_groups_come_from_the_checkpointed_policy_state(checkpoint, tmp_path, capsys):
    ckpt = torch.load(checkpoint, weights_only=True)
    ckpt["aah_policy"] = {
        "hierarchies": [[[[0, 3], [1, 2]], [[0, 1, 2, 3]]], [[[0], [1, 2, 3]]]],
        "group_windows": [[[8, 32], [32]], [[4, 16]]],
        "last_step": 1,
    }
    ckpt["hyper_parameters"]["aah"]["policy"] = "adaptive"  # the policy whose state this is
    edited = tmp_path / "grouped.ckpt"
    torch.save(ckpt, edited)
    assert run_tool("inspect_windows", str(edited), "--out", str(tmp_path / "out"), "--block-size", "8") == 0
    groups = [int(r["group"]) for r in read_csv(tmp_path / "out" / "windows.csv")]
    assert groups == [0, 1, 1, 0, 0, 1, 1, 1]
    out = capsys.readouterr().out
    assert "decision at step 1" in out and "L1.g0 W=32 (4 heads)" in out and "L0.g0 W=8: h0=" in out
    table = ckpt["state_dict"]["model.windows"]
    assert f"block density {float(metrics.block_density(table, 32, 8)):.4f}" in out


def test_mask_picture_of_one_head(checkpoint, tmp_path):
    assert (
        run_tool("inspect_windows", str(checkpoint), "--out", str(tmp_path), "--mask", "1", "2", "--seq-len", "40") == 0
    )
    with Image.open(tmp_path / "mask_layer1_head2.png") as image:
        assert image.size == (640, 680)
    # the picture's mask is the layer's mask_mod, head 2
    row = torch.load(checkpoint, weights_only=True)["state_dict"]["model.windows"][1]
    dense = masks.dense_mask(masks.window_mask_mod(row), 1, 4, 40, "cpu")[0, 2]
    assert torch.equal(plots.head_mask(row, 2, 40), dense)
    # out of range: one line, exit code 2
    assert run_tool("inspect_windows", str(checkpoint), "--out", str(tmp_path), "--mask", "2", "0") == 2


def test_runs_as_a_command(checkpoint, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "inspect_windows.py"), str(checkpoint), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "window table" in done.stdout and (tmp_path / "windows.csv").exists()
