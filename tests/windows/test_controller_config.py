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
    assert set(aah["controller"]) >= {"warmup_steps", "control_interval", "coverage_target", "depth", "feature_set"}
    cfg.validate(256, 4, 4)


def test_adaptive_config_runs_in_the_cli_and_checkpoints_the_controller(tmp_path, tiny_args):
    args = tiny_args(
        "--model.aah.candidates=[4,8,16,32]",
        "--model.aah.controller.warmup_steps=2",
        "--model.aah.controller.control_interval=2",
        "--model.aah.controller.probe_queries=8",
        "--model.aah.controller.target_acr=0.5",
        steps=6,
    )
    main([args[0], f"--config={CONFIG}", *args[1:]])
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    state = ckpt["aah_policy"]
    assert state["decisions"] == 2 and state["last_step"] == 4  # steps 2 and 4 (warmup 2, interval 2)
    assert torch.equal(state["table"], ckpt["state_dict"]["model.windows"])
    assert ckpt["hyper_parameters"]["aah"]["controller"]["target_acr"] == 0.5
    # the ceiling holds: every layer's mean window fraction is at most 0.5
    assert (state["table"].double().clamp(max=32).mean(1) / 32 <= 0.5 + 1e-9).all()
