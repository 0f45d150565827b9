"""A new window policy is one file: a module that registers a ``WindowPolicy`` is selected as ``module:name``."""

import sys
import textwrap

import pytest
import torch

from aah_lightning.cli import main
from aah_lightning.windows.policy_base import POLICIES
from helpers.cli import cli_error

PLUGIN = '''
"""Even layers see the whole context; odd layers the plugin setting ``window``, halved at step ``halve_at``."""

import torch

from aah_lightning.windows.policy_base import WindowPolicy, register
from aah_lightning.errors import require


@register("alternating")
class AlternatingPolicy(WindowPolicy):
    @classmethod
    def validate(cls, cfg, seq_len, n_layer, n_head):
        window = cfg.plugin.get("window")
        require(isinstance(window, int) and 2 <= window <= seq_len, "model.aah.plugin.window", window,
                f"an integer in [2, seq_len={seq_len}] (the alternating policy's odd layers)")

    def initial_table(self):
        table = torch.full((self.n_layer, self.n_head), self.seq_len, dtype=torch.int32)
        table[1::2] = self.cfg.plugin["window"]
        return table

    def on_train_step(self, step, model, batch):
        if step == self.cfg.plugin.get("halve_at"):
            table = self.initial_table()
            table[1::2] = self.cfg.plugin["window"] // 2
            return table
        return None
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_policies.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))  # the user's module on their PYTHONPATH
    yield "my_policies:alternating"
    POLICIES.pop("alternating", None)  # forget the plugin: the next test imports and registers it afresh
    sys.modules.pop("my_policies", None)


def test_a_policy_in_its_own_module_trains_through_the_cli(plugin, tiny_args):
    main(
        tiny_args(
            f"--model.aah.policy={plugin}", "--model.aah.plugin.window=8", "--model.aah.plugin.halve_at=2", steps=3
        )
    )
    ckpt = torch.load(_ckpt(tiny_args), weights_only=True)
    table = ckpt["state_dict"]["model.windows"]
    assert table.tolist() == [[32] * 4, [4] * 4]  # layer 1 halved at step 2
    assert ckpt["hyper_parameters"]["aah"]["policy"] == plugin


def test_the_plugin_checks_its_own_settings(plugin, capsys, tiny_args):
    code, line = cli_error(tiny_args(f"--model.aah.policy={plugin}", "--model.aah.plugin.window=1"), capsys)
    assert code == 2 and "model.aah.plugin.window=1" in line and "alternating policy" in line


def test_a_module_without_the_policy_is_one_line(plugin, capsys, tiny_args):
    code, line = cli_error(tiny_args("--model.aah.policy=my_policies:sliding"), capsys)
    assert code == 2 and "registers no policy named 'sliding'" in line
    code, line = cli_error(tiny_args("--model.aah.policy=no_such_module:x"), capsys)
    assert code == 2 and "cannot import module 'no_such_module'" in line


def _ckpt(tiny_args) -> str:
    dirpath = next(a for a in tiny_args() if a.startswith("--checkpoint.dirpath=")).split("=", 1)[1]
    return f"{dirpath}/last.ckpt"
