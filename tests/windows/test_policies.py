import glob

import pytest
import torch
import yaml

from aah_lightning.errors import ConfigError
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.policy_base import make_policy


def test_full_fixed_static_tables():
    assert torch.equal(
        make_policy(AAHConfig("full"), 2, 3, 64).initial_table(), torch.full((2, 3), 64, dtype=torch.int32)
    )
    assert torch.equal(
        make_policy(AAHConfig("fixed", fixed={"window": 8}), 2, 3, 64).initial_table(),
        torch.full((2, 3), 8, dtype=torch.int32),
    )
    table = [[1, 2, 64], [8, 8, 16]]
    assert make_policy(AAHConfig("static", static={"table": table}), 2, 3, 64).initial_table().tolist() == table


def test_random_policy_is_seeded_redraws_on_schedule_and_resumes():
    cfg = AAHConfig("random", candidates=[4, 8, 16, 32], seed=5, random={"redraw_interval": 10})
    a, b = make_policy(cfg, 3, 4, 32), make_policy(cfg, 3, 4, 32)
    first = a.initial_table()
    assert torch.equal(first, b.initial_table())
    assert set(first.flatten().tolist()) <= {4, 8, 16, 32}
    assert a.on_train_step(9, None, None) is None
    redrawn = a.on_train_step(10, None, None)
    assert redrawn is not None and not torch.equal(redrawn, first)
    # a policy restored from a's state makes a's next decision
    c = make_policy(cfg, 3, 4, 32)
    c.initial_table()
    c.load_state_dict(a.state_dict())
    assert torch.equal(c.on_train_step(20, None, None), a.on_train_step(20, None, None))


@pytest.mark.parametrize(
    "cfg, setting",
    [
        (AAHConfig("nonsense"), "model.aah.policy"),
        (AAHConfig("fixed", fixed={"window": 0}), "model.aah.fixed.window"),
        (AAHConfig("fixed", fixed={"window": 65}), "model.aah.fixed.window"),
        (AAHConfig("random", candidates=[0, 8]), "model.aah.candidates"),
        (AAHConfig("random", candidates=[8, 128]), "model.aah.candidates"),
        (AAHConfig("static", static={"table": [[8, 8, 8]]}), "model.aah.static.table"),
        (AAHConfig("full", sink=-1), "model.aah.sink=-1 is not allowed: an integer >= 0"),
        (AAHConfig("fixed", sink=1.5), "model.aah.sink=1.5 is not allowed"),
        (AAHConfig("random", sink=True), "model.aah.sink=True is not allowed"),
    ],
)
def test_bad_policy_settings_name_the_setting(cfg, setting):
    with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
        make_policy(cfg, 2, 3, 64)


def load_config(*paths):
    merged = {}
    for path in paths:
        with open(path) as f:
            doc = yaml.safe_load(f)
        for key, value in doc.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
    return merged


@pytest.mark.parametrize("path", sorted(glob.glob("configs/policies/*.yaml")))
def test_each_policy_config_builds_the_table_it_describes(path):
    cfg = load_config("configs/quickstart.yaml", path)
    model_cfg = cfg["model"]
    module = AAHModule(
        gpt=GPTConfig(**model_cfg["gpt"], seq_len=cfg["data"]["seq_len"]),
        aah=AAHConfig(**model_cfg["aah"]),
    )
    table = module.model.windows
    aah = model_cfg["aah"]
    assert table.shape == (model_cfg["gpt"]["n_layer"], model_cfg["gpt"]["n_head"])
    if aah["policy"] == "full":
        assert (table == cfg["data"]["seq_len"]).all()
    elif aah["policy"] == "fixed":
        assert (table == aah["fixed"]["window"]).all()
    elif aah["policy"] == "static":
        assert table.tolist() == aah["static"]["table"]
    else:
        assert set(table.flatten().tolist()) <= set(aah["candidates"])


def test_fixed_after_a_full_context_warmup():
    """``warmup_steps``: every head sees the whole context first, then one window for all, exactly once."""
    policy = make_policy(AAHConfig(policy="fixed", fixed={"window": 8, "warmup_steps": 3}), 2, 4, 32)
    assert policy.initial_table().tolist() == [[32] * 4] * 2
    decided = {step: policy.on_train_step(step, None, None) for step in range(6)}
    assert [s for s, t in decided.items() if t is not None] == [3]
    assert decided[3].tolist() == [[8] * 4] * 2


@pytest.mark.parametrize("layer", [0, 1])
def test_random_with_long_layer_puts_the_widest_window_there(layer):
    """``long_layer``: over many seeds the table's widest window is always in that layer, on varying heads, and the
    histogram of windows is the table's."""
    table = [[26, 204, 26, 51], [51, 26, 102, 26]]
    heads = set()
    for seed in range(12):
        cfg = AAHConfig(policy="random", random={"table": table, "long_layer": layer}, seed=seed)
        drawn = make_policy(cfg, 2, 4, 256).initial_table()
        assert sorted(drawn.flatten().tolist()) == sorted(sum(table, []))
        assert 204 in drawn[layer].tolist()
        heads.add(drawn[layer].tolist().index(204))
    assert len(heads) > 1


def test_flat_policy_settings_still_work_with_one_deprecation_line():
    """The settings each policy now reads from its own block (``model.aah.fixed.window``) were flat before
    (``model.aah.window``): a flat key moves into the block with a FutureWarning naming the new key."""
    with pytest.warns(FutureWarning, match=r"model\.aah\.window is deprecated: write model\.aah\.fixed\.window"):
        cfg = AAHConfig("fixed", window=8, warmup_steps=2)
    assert (cfg.fixed.window, cfg.fixed.warmup_steps, cfg.window, cfg.warmup_steps) == (8, 2, None, None)
    with pytest.warns(FutureWarning):
        cfg = AAHConfig("random", table=[[8, 16]], redraw_interval=3, long_layer=0)
    assert (cfg.random.table, cfg.random.redraw_interval, cfg.random.long_layer) == ([[8, 16]], 3, 0)
    assert (cfg.static.table, cfg.shuffle.redraw_interval) == ([[8, 16]], 3)  # every block that reads the key
    assert make_policy(cfg, 1, 2, 16).initial_table().tolist() in ([[8, 16]], [[16, 8]])
    assert "window" not in cfg.settings() and cfg.settings()["random"]["redraw_interval"] == 3  # saved nested only
    with pytest.raises(ConfigError, match=r"model\.aah\.window=8 and model\.aah\.fixed\.window=16 are both set"):
        with pytest.warns(FutureWarning):
            AAHConfig("fixed", window=8, fixed={"window": 16})


def test_flat_keys_on_the_command_line(tiny_args, capsys):
    from aah_lightning.cli import main
    from helpers.cli import cli_error

    with pytest.warns(FutureWarning, match="model.aah.window is deprecated"):
        main(tiny_args("--model.aah.policy=fixed", "--model.aah.window=8", steps=1))
    code, line = cli_error(
        tiny_args("--model.aah.policy=fixed", "--model.aah.window=8", "--model.aah.fixed.window=16"), capsys
    )
    assert code == 2 and "are both set" in line, line


def test_checkpoints_of_the_flat_layout_are_read_nested():
    from aah_lightning.checkpoint import HPARAMS_FORMAT, HPARAMS_FORMAT_ENTRY, upgrade_hyperparameters

    flat = {"gpt": {}, "aah": {"policy": "random", "table": [[8, 16]], "redraw_interval": 2, "window": None}}
    hp = upgrade_hyperparameters({**flat, HPARAMS_FORMAT_ENTRY: 2})
    assert hp[HPARAMS_FORMAT_ENTRY] == HPARAMS_FORMAT
    assert hp["aah"] == {
        "policy": "random",
        "static": {"table": [[8, 16]]},
        "random": {"table": [[8, 16]], "redraw_interval": 2},
        "shuffle": {"redraw_interval": 2},
    }
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an old checkpoint loads without a deprecation line
        assert AAHConfig(**hp["aah"]).random.redraw_interval == 2


def test_an_unknown_allocator_is_refused_by_the_controller(tiny_args, capsys):
    """The settings dataclass no longer knows the allocator registry: the controller's validate checks the name."""
    from helpers.cli import cli_error

    with pytest.raises(
        ConfigError, match=r"model\.aah\.controller\.allocation\.allocator='greedy' is not allowed: one of paper, reach"
    ):
        make_policy(AAHConfig("adaptive", controller={"allocation": {"allocator": "greedy"}}), 2, 3, 64)
    code, line = cli_error(
        tiny_args("--model.aah.policy=adaptive", "--model.aah.controller.allocation.allocator=greedy"), capsys
    )
    assert code == 2 and "model.aah.controller.allocation.allocator='greedy'" in line, line
