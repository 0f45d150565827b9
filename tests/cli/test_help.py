"""`aah fit --help` lists the choices of every setting that has a fixed set, and says what every setting means."""

from __future__ import annotations

import re

import pytest

from aah_lightning.cli import main


def _help(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["fit", *args])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _undocumented(text: str, prefix: str) -> list[str]:
    """Options under ``prefix`` whose help is only jsonargparse's "(type: ..., default: ...)"."""
    entries = re.findall(rf"^  (--{re.escape(prefix)}\.\S+)[^\n]*\n((?:^ {{10,}}\S[^\n]*\n)*)", text, re.M)
    return [name for name, body in entries if " ".join(body.split()).startswith("(type:")]


def test_help_lists_the_choices(capsys):
    text = _help(capsys, "--help")
    from aah_lightning.model.attention import backend_names

    assert "--model.gpt.backend {" + ",".join(backend_names()) + "}" in text
    assert {"auto", "flex", "sdpa", "banded", "split"} <= set(backend_names())
    # The data source is a registered name too (a plugin source needs no edit of the data module): its help names them.
    from aah_lightning.data.sources import source_names

    source = text[text.index("  --data.source SOURCE") :][:700]
    assert all(name in source for name in source_names()) and "module:name" in source
    aah = _help(capsys, "--model.aah.help", "AAHConfig")
    # The allocator is a name of the controller's registry (the settings dataclass does not import it): its help
    # names each one.
    allocator = aah[aah.index("  --model.aah.controller.allocation.allocator ALLOCATOR") :][:300]
    assert "``reach``" in allocator and "``paper``" in allocator
    for option in (
        "groups.method {cluster,none,fixed_random,kv_heads}",
        "groups.metric {euclidean,cosine}",
        "groups.feature_set {paper,reach,all}",
        "budget.scope {layer,model}",
        "reach.formation_fill {knapsack,even}",
    ):
        assert f"--model.aah.controller.{option}" in aah
    # The policy is a registered name (a new policy needs no edit of the config class): its help lists them.
    policy = aah[aah.index("  --model.aah.policy POLICY") :]
    assert all(name in policy[:800] for name in ("full", "fixed", "static", "random", "adaptive", "shuffle"))


@pytest.mark.parametrize(
    "args, prefix",
    [
        (["--help"], "model"),
        (["--help"], "data"),
        (["--model.aah.help", "AAHConfig"], "model.aah"),
        (["--model.optim.help", "OptimConfig"], "model.optim"),
    ],
)
def test_every_setting_is_documented(capsys, args, prefix):
    assert _undocumented(_help(capsys, *args), prefix) == []


def test_a_value_outside_the_choices_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--model.aah.controller.groups.metric=manhattan", "--data.source=synthetic"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "aah: error: model.aah.controller.groups.metric='manhattan' is not allowed: one of euclidean or cosine"
    ]
