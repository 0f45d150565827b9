"""The data settings: one block per source (``data.files``, ``data.recall``, ...), the flat keys of earlier versions
with one deprecation line, and checkpoints and configs of the flat layout read nested."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from aah_lightning.checkpoint import data_settings, read_checkpoint
from aah_lightning.data import prepare
from aah_lightning.data.config import FLAT_DATA_SETTINGS, DataConfig, nest_data_settings
from aah_lightning.data.tokenizers import load_tokenizer
from aah_lightning.errors import ConfigError
from aah_lightning.export.model_card import data_summary
from aah_lightning.lit.datamodule import TextDataModule

FORMAT_1 = Path(__file__).resolve().parents[1] / "checkpoint_format1.ckpt"  # flat data settings (synthetic_*)


def test_each_source_reads_its_own_block():
    dm = TextDataModule(source="recall", seq_len=64, recall={"keys": 8, "values": 4}, val_blocks=2)
    assert (dm.config.recall.keys, dm.config.recall.values, dm.vocab_size) == (8, 4, 13)
    dm.setup("fit")
    assert int(dm.train_set[0]["tokens"].max()) < 13
    saved = dict(dm.hparams)
    assert saved["recall"]["keys"] == 8 and not set(FLAT_DATA_SETTINGS) & set(saved)  # saved nested only
    syn = TextDataModule(source="synthetic", seq_len=16, synthetic={"vocab": 5, "documents": 30})
    assert syn.vocab_size == 6 and syn.config.synthetic.documents == 30


def test_flat_data_settings_still_work_with_one_deprecation_line():
    with pytest.warns(FutureWarning, match=r"data\.recall_keys is deprecated: write data\.recall\.keys"):
        dm = TextDataModule(source="recall", seq_len=64, recall_keys=8, recall_values=4)
    assert (dm.config.recall.keys, dm.config.recall.values, dm.vocab_size) == (8, 4, 13)
    with pytest.warns(FutureWarning, match=r"write data\.files\.text_field and data\.hub\.text_field"):
        cfg = DataConfig.from_arguments({"text_field": "body", "hub_name": "a/b"})
    assert (cfg.files.text_field, cfg.hub.text_field, cfg.hub.name) == ("body", "body", "a/b")
    with pytest.raises(ConfigError, match=r"data\.recall_keys=8 and data\.recall\.keys=12 are both set"):
        with pytest.warns(FutureWarning):
            TextDataModule(source="recall", recall_keys=8, recall={"keys": 12})


def test_a_key_a_block_does_not_have_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"data\.recall\.kyes is not a setting: data\.recall takes blocks, "):
        TextDataModule(source="recall", recall={"kyes": 8})


def test_flat_and_nested_keys_on_the_command_line(tiny_args, capsys):
    from aah_lightning.cli import main
    from helpers.cli import cli_error

    with pytest.warns(FutureWarning, match="data.synthetic_vocab is deprecated"):
        main(tiny_args("--data.synthetic_vocab=12", steps=1))
    code, line = cli_error(tiny_args("--data.synthetic_vocab=12", "--data.synthetic.vocab=20"), capsys)
    assert code == 2 and "data.synthetic_vocab=12 and data.synthetic.vocab=20 are both set" in line, line
    code, line = cli_error(tiny_args("--data.synthetic.distance=99"), capsys)  # seq_len 32
    assert code == 2 and line.startswith("aah: error: data.synthetic.distance=99"), line


def test_a_checkpoint_of_the_flat_layout_is_read_nested():
    data = data_settings(read_checkpoint(FORMAT_1))
    assert data["synthetic"] == {"documents": 40, "vocab": 12}  # a None (a default) is left to the block
    assert not set(FLAT_DATA_SETTINGS) & set(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an old checkpoint's settings build the data module without a deprecation line
        dm = TextDataModule(**data)
    assert dm.vocab_size == 13
    assert nest_data_settings({"recall_fraction": 0.5, "paths": None}) == {"recall": {"fraction": 0.5}}


def test_the_model_card_names_the_sources_own_settings():
    files = DataConfig(source="files", files={"paths": ["a.txt"]}).settings()
    assert data_summary(files)["files"] == {"paths": ["a.txt"], "text_field": "text"} and "hub" not in data_summary(
        files
    )
    mixed = DataConfig(source="stdlib", recall={"fraction": 0.25}).settings()
    assert data_summary(mixed)["recall"]["fraction"] == 0.25
    assert "recall" not in data_summary(DataConfig(source="stdlib").settings())


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_aah_prepare_fills_the_cache_folder_a_run_of_the_config_reads(tmp_path, capsys, layout):
    corpus = tmp_path / "a.jsonl"
    corpus.write_text('{"body": "one document"}\n{"body": "and another one"}\n')
    files = {"paths": [str(corpus)], "text_field": "body"}
    data = {"source": "files", "seed": 3}
    data.update({"files": files} if layout == "nested" else files)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"data": data}))
    prepare.main(["--config", str(config), "--cache_dir", str(tmp_path / "cache")])
    printed = capsys.readouterr().out.splitlines()[0]
    dm = TextDataModule(source="files", files=files, seed=3, cache_dir=str(tmp_path / "cache"), seq_len=4)
    assert printed.startswith(dm.source.folder(load_tokenizer("byte")) + ":"), printed


@pytest.mark.parametrize(
    "setting, value",
    [("seq_len", 0), ("batch_size", -1), ("val_fraction", 1.0), ("test_fraction", 0.99), ("val_blocks", 0)],
)
def test_shared_settings_are_checked_by_the_config_itself(setting, value):
    DataConfig().validate()  # the defaults pass
    with pytest.raises(ConfigError, match=f"data.{setting}"):
        DataConfig(**{setting: value}).validate()
    with pytest.raises(ConfigError, match=f"data.{setting}"):  # the data module refuses it before any source work
        TextDataModule(source="recall", **{setting: value})


def test_deprecation_lines_point_at_the_callers_line():
    from aah_lightning.windows.config import AAHConfig

    with pytest.warns(FutureWarning) as data_warnings:
        TextDataModule(source="recall", recall_keys=8)
    with pytest.warns(FutureWarning, match="write model.aah.static.table and model.aah.random.table") as aah_warnings:
        AAHConfig(policy="static", table=[[4]])
    for record in (*data_warnings, *aah_warnings):
        assert record.filename == __file__, record.filename
