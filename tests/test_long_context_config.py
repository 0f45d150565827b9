"""configs/cluster/long_context.yaml layers onto ddp.yaml through the real CLI parser (printed, not built: the
cluster configs need GPUs and the hub corpus)."""

import pytest
import yaml

from aah_lightning.cli import AAHCLI
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.module import AAHModule


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
    assert config["model"]["backend"] == "flex_tuned" and config["model"]["rope_base"] == 500000.0
    assert config["model"]["n_layer"] == 12 and config["trainer"]["precision"] == "bf16-mixed"  # from ddp.yaml
