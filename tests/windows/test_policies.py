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
        make_policy(AAHConfig("fixed", window=8), 2, 3, 64).initial_table(), torch.full((2, 3), 8, dtype=torch.int32)
    )
    table = [[1, 2, 64], [8, 8, 16]]
    assert make_policy(AAHConfig("static", table=table), 2, 3, 64).initial_table().tolist() == table


def test_random_policy_is_seeded_redraws_on_schedule_and_resumes():
    cfg = AAHConfig("random", candidates=[4, 8, 16, 32], seed=5, redraw_interval=10)
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
        (AAHConfig("fixed", window=0), "model.aah.window"),
        (AAHConfig("fixed", window=65), "model.aah.window"),
        (AAHConfig("random", candidates=[0, 8]), "model.aah.candidates"),
        (AAHConfig("random", candidates=[8, 128]), "model.aah.candidates"),
        (AAHConfig("static", table=[[8, 8, 8]]), "model.aah.table"),
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
        assert (table == aah["window"]).all()
    elif aah["policy"] == "static":
        assert table.tolist() == aah["table"]
    else:
        assert set(table.flatten().tolist()) <= set(aah["candidates"])


def test_fixed_after_a_full_context_warmup():
    """``warmup_steps``: every head sees the whole context first, then one window for all, exactly once."""
    policy = make_policy(AAHConfig(policy="fixed", window=8, warmup_steps=3), 2, 4, 32)
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
        cfg = AAHConfig(policy="random", table=table, long_layer=layer, seed=seed)
        drawn = make_policy(cfg, 2, 4, 256).initial_table()
        assert sorted(drawn.flatten().tolist()) == sorted(sum(table, []))
        assert 204 in drawn[layer].tolist()
        heads.add(drawn[layer].tolist().index(204))
    assert len(heads) > 1
