"""configs/aah/adaptive.yaml through the real CLI: it parses, builds the adaptive policy, decides and checkpoints."""

import torch
import yaml

from aah_lightning.cli import main
from aah_lightning.windows.config import AAHConfig, ControllerConfig

CONFIG = "configs/aah/adaptive.yaml"


def test_adaptive_config_sets_every_controller_setting():
    with open(CONFIG) as f:
        aah = yaml.safe_load(f)["model"]["aah"]
    cfg = AAHConfig(**aah)
    assert cfg.policy == "adaptive" and isinstance(cfg.controller, ControllerConfig)
    controller = aah["controller"]
    assert set(controller["schedule"]) >= {"warmup_steps", "control_interval"}
    assert "coverage_target" in controller["allocation"] and {"depth", "feature_set"} <= set(controller["groups"])
    cfg.validate(256, 4, 4)


def test_adaptive_config_runs_in_the_cli_and_checkpoints_the_controller(tmp_path, tiny_args):
    args = tiny_args(
        "--model.aah.candidates=[4,8,16,32]",
        "--model.aah.controller.schedule.warmup_steps=2",
        "--model.aah.controller.schedule.control_interval=2",
        "--model.aah.controller.need.probe_queries=8",
        "--model.aah.controller.budget.target_acr=0.5",
        steps=6,
    )
    main([args[0], f"--config={CONFIG}", *args[1:]])
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    state = ckpt["aah_policy"]
    assert state["decisions"] == 2 and state["last_step"] == 4  # steps 2 and 4 (warmup 2, interval 2)
    assert torch.equal(state["table"], ckpt["state_dict"]["model.windows"])
    assert ckpt["hyper_parameters"]["aah"]["controller"]["budget"]["target_acr"] == 0.5
    # the ceiling holds: every layer's mean window fraction is at most 0.5
    assert (state["table"].double().clamp(max=32).mean(1) / 32 <= 0.5 + 1e-9).all()


def test_the_flat_keys_of_earlier_versions_move_into_their_blocks_with_one_warning():
    import warnings

    import pytest

    from aah_lightning.errors import ConfigError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flat = ControllerConfig(target_acr=0.3, budget_scope="model", reach_heads=1, warmup_steps=0)
    lines = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert (
        len(lines) == 4
        and "model.aah.controller.budget_scope is deprecated: write model.aah.controller.budget.scope" in lines
    )
    nested = ControllerConfig(
        budget={"target_acr": 0.3, "scope": "model"}, reach={"heads": 1}, schedule={"warmup_steps": 0}
    )
    assert flat == nested and flat.target_acr is None  # moved, not kept twice
    with pytest.raises(ConfigError, match="settle_margin=0.1 and model.aah.controller.settle.margin=0.3 are both set"):
        ControllerConfig(settle_margin=0.1, settle={"margin": 0.3})


def test_a_checkpoint_of_the_flat_layout_reads_nested():
    from aah_lightning.checkpoint import HPARAMS_FORMAT, HPARAMS_FORMAT_ENTRY, upgrade_hyperparameters

    old = {
        "gpt": {},
        "aah": {"policy": "adaptive", "controller": {"target_acr": 0.25, "grouping": "none", "settle_margin": 0.0}},
        HPARAMS_FORMAT_ENTRY: 3,
    }
    new = upgrade_hyperparameters(old)
    controller = new["aah"]["controller"]
    assert new[HPARAMS_FORMAT_ENTRY] == HPARAMS_FORMAT == 4
    assert controller == {"budget": {"target_acr": 0.25}, "groups": {"method": "none"}, "settle": {"margin": 0.0}}
    assert AAHConfig(**new["aah"]).controller.groups.method == "none"
