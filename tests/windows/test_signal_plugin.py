"""A new need signal is one module and one registry line: the worked example of docs/controller.md ("Adding a
mechanism"), read from the page, trains through ``aah fit`` and decides the table."""

import re
import sys
from pathlib import Path

import pytest
import torch

from aah_lightning.cli import main
from aah_lightning.windows.controller.features import FeatureLayout
from aah_lightning.windows.controller.signals import SIGNALS
from helpers.cli import cli_error

PAGE = Path(__file__).resolve().parents[2] / "docs" / "controller.md"
CANDIDATES = [4, 8, 16, 32]


def example() -> str:
    """The Python block of the page's "Adding a mechanism" section."""
    section = PAGE.read_text().split("## Adding a mechanism", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def signal(tmp_path, monkeypatch):
    (tmp_path / "my_signals.py").write_text(example())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_signals:last_probe_mass"
    SIGNALS.pop("last_probe_mass", None)  # forget it: the next test imports and registers it afresh
    sys.modules.pop("my_signals", None)


def controller_args(tiny_args, signal, *extra):
    return tiny_args(
        "--model.aah.policy=adaptive",
        f"--model.aah.candidates={CANDIDATES}",
        f"--model.aah.controller.need.signal={signal}",
        "--model.aah.controller.schedule.warmup_steps=1",
        "--model.aah.controller.schedule.control_interval=1",
        "--model.aah.controller.need.ema_alpha=0.5",
        *extra,
        steps=4,
    )


def test_the_documented_signal_trains_through_the_cli_and_decides(signal, tiny_args):
    main(controller_args(tiny_args, signal))
    dirpath = next(a for a in tiny_args() if a.startswith("--checkpoint.dirpath=")).split("=", 1)[1]
    ckpt = torch.load(f"{dirpath}/last.ckpt", weights_only=True)
    state = ckpt["aah_policy"]
    assert state["decisions"] == 3  # steps 1, 2 and 3
    assert ckpt["hyper_parameters"]["aah"]["controller"]["need"]["signal"] == signal
    # The need that decided the last table is a mass share per candidate (1 at the whole context) and is not the
    # smoothed profile the built-in mass signal would have used: the example's own need decided.
    need = state["last_need"]
    smoothed = state["ema"][..., FeatureLayout(len(CANDIDATES)).profile].clone()
    smoothed[..., -1] = 1.0
    assert need.shape == (2, 4, len(CANDIDATES)) and torch.all(need[..., -1] == 1) and torch.all(need <= 1 + 1e-9)
    assert not torch.allclose(need, smoothed)


def test_an_unknown_signal_is_one_line(signal, capsys, tiny_args):
    code, line = cli_error(controller_args(tiny_args, "my_signals:nearest"), capsys)
    assert code == 2 and "registers no need signal named 'nearest'" in line
    code, line = cli_error(controller_args(tiny_args, "attention"), capsys)
    assert code == 2 and "model.aah.controller.need.signal='attention' is not allowed: one of mass, gain" in line
