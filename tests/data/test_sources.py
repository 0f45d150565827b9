"""Data sources as plugins: the registry, and the worked example of docs/architecture.md trained through the CLI."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from aah_lightning.checkpoint import checkpoint_tokenizer, read_checkpoint
from aah_lightning.cli import main
from aah_lightning.data.sources import get_source, is_stream, is_text, source_names
from aah_lightning.errors import ConfigError
from aah_lightning.lit.datamodule import TextDataModule

ROOT = Path(__file__).resolve().parents[2]


def example_source() -> str:
    """The Python block of docs/architecture.md's "Adding a data source"."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## Adding a data source", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


@pytest.fixture
def my_sources(tmp_path, monkeypatch):
    (tmp_path / "my_sources.py").write_text(example_source())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_sources", None)


def test_every_built_in_source_is_registered_with_its_contract():
    assert source_names() == ("stdlib", "files", "tokens", "hub", "synthetic", "recall")
    assert [get_source(n).has_tokens for n in source_names()] == [True, True, True, True, False, False]
    assert [n for n in source_names() if get_source(n).streamed] == ["hub"]
    assert [n for n in source_names() if get_source(n).mixable] == ["stdlib", "files", "tokens"]
    assert not is_text("recall") and is_text("stdlib") and is_text("no_such_source")


def test_is_stream_is_the_one_answer_to_whether_data_is_a_stream():
    assert [n for n in source_names() if is_stream(get_source(n))] == ["hub"]
    assert not TextDataModule(source="recall", seq_len=16).streamed
    assert TextDataModule(source="hub", hub={"name": "local/fake"}).streamed  # nothing is read until setup


def test_the_recall_mix_is_a_source_get_source_returns():
    from aah_lightning.data.config import DataConfig
    from aah_lightning.data.sources.recall import RecallMix
    from aah_lightning.data.sources.text import StdlibSource

    assert get_source("stdlib", 0.25) is RecallMix and get_source("stdlib", 0.0) is StdlibSource
    mix = get_source("tokens", 0.5)(DataConfig(source="tokens", recall={"fraction": 0.5}))
    assert type(mix.text).__name__ == "TokenFolderSource" and mix.has_tokens and not is_stream(mix)
    with pytest.raises(ConfigError, match=r"data.recall.fraction=0.5 .*only with data.source stdlib, files or tokens"):
        get_source("hub", 0.5)
    # The data module names no source: it asks the registry (the layering test checks the rest of its imports).
    module = (ROOT / "aah_lightning" / "lit" / "datamodule.py").read_text()
    assert "data.sources." not in module and "data.streaming" not in module and "RecallSource" not in module


def test_an_unknown_source_is_refused_with_what_is_allowed():
    with pytest.raises(ConfigError, match=r"data.source='nope' .*one of stdlib, files, tokens, hub, synthetic, recall"):
        TextDataModule(source="nope")
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_module'"):
        TextDataModule(source="no_such_module:x")
    with pytest.raises(ConfigError, match=r"module 'aah_lightning.errors' registers no data source named 'x'"):
        TextDataModule(source="aah_lightning.errors:x")


def test_the_documented_example_source_trains_through_the_cli(my_sources, tmp_path, tiny_args):
    data = TextDataModule(source="my_sources:counting", seq_len=16, batch_size=4, plugin={"vocab": 10})
    data.setup("fit")
    assert data.vocab_size == 11 and data.tokenizer is None
    item = data.train_set[3]["tokens"]
    assert torch.equal(item, (torch.arange(17) + 3) % 10)
    with pytest.raises(ConfigError, match=r"data.plugin.vocab=1 .*an integer >= 2"):
        TextDataModule(source="my_sources:counting", plugin={"vocab": 1})

    main(tiny_args("--data.source=my_sources:counting", "--data.plugin.vocab=10", steps=4))
    saved = read_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert saved["global_step"] == 4
    assert saved["datamodule_hyper_parameters"]["source"] == "my_sources:counting"
    assert checkpoint_tokenizer(saved) is None  # a source of its own ids: no tokenizer comes with the model
    # It resumes like any source: the data position is DataPosition's, not the source's.
    main(tiny_args("--data.source=my_sources:counting", "--data.plugin.vocab=10", "--ckpt_path=last", steps=6))
    assert read_checkpoint(tmp_path / "ckpt" / "last.ckpt")["global_step"] == 6
