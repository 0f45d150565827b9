"""Every bad input ends `aah` with one line that names the setting, exit code 2, and no training step.

Each test runs the real CLI in-process and checks that the checkpoint folder was never created: checkpoints are
written from the first optimizer step on, so its absence shows the error came before any training.

Bad settings of the adaptive policy (model.aah.controller.*) are inputs like every other."""

from __future__ import annotations

import os
import shutil
import struct
import zipfile

import lightning as L
import pytest

from aah_lightning.errors import ConfigError
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig
from helpers.cli import cli_error, tiny_config, train_tiny


def refuse(tmp_path, capsys, *args, subcommand="fit", **sections) -> str:
    code, line = cli_error([subcommand, "--config", tiny_config(tmp_path, **sections), *args], capsys)
    assert code == 2, line
    assert line.startswith("aah: error: "), line
    assert not os.path.exists(tmp_path / "ckpts"), "a checkpoint folder appeared: training started"
    return line


def text_file(tmp_path, name="corpus.txt", text=None) -> str:
    path = tmp_path / name
    path.write_text(text if text is not None else "def f(x):\n    return x * 2\n" * 400)
    return str(path)


# -- model shape and window settings ---------------------------------------------------------------------------------
def test_a_gpt_setting_where_it_was_before_model_gpt_says_where_it_is_now(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--model.n_layer=3")
    assert (
        line
        == "aah: error: model.n_layer is now model.gpt.n_layer: the GPT's settings are under model.gpt (aah fit --help)"
    )
    line = refuse(tmp_path / "yaml", capsys, model={"backend": "sdpa"})  # in a config file
    assert "model.backend is now model.gpt.backend" in line


def test_candidate_window_zero(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--model.aah.candidates", "[0, 16]")
    assert "model.aah.candidates" in line and "[1, seq_len=32]" in line


def test_candidate_window_longer_than_seq_len(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--model.aah.candidates", "[8, 64]")
    assert "model.aah.candidates" in line and "64" in line


def test_static_table_wrong_shape(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--model.aah.policy", "static", "--model.aah.table", "[[8, 16], [8, 16], [8, 16]]")
    assert "model.aah.table" in line and "n_layer=2" in line and "n_head=2" in line


def test_n_embd_not_divisible_by_n_head(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--model.gpt.n_head", "3")
    assert "model.gpt.n_embd=32" in line and "model.gpt.n_head=3" in line


def test_head_size_rope_cannot_use(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--model.gpt.n_embd", "30")  # 2 heads of 15 channels: RoPE needs pairs
    assert "RoPE" in line and "model.gpt.n_embd=30" in line


def test_unknown_policy(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--model.aah.policy", "clever")
    assert "model.aah.policy='clever'" in line and "random" in line


def test_unknown_backend(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--model.gpt.backend", "cuda_magic")
    assert "model.gpt.backend='cuda_magic'" in line and "sdpa" in line


def test_flex_cannot_train_on_cpu_says_what_works(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--model.gpt.backend", "flex")
    assert "model.gpt.backend=flex" in line and "auto" in line and "sdpa" in line


def test_seq_len_not_positive(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--data.seq_len", "0")
    assert "seq_len=0" in line


# -- data ------------------------------------------------------------------------------------------------------------
def test_empty_corpus(tmp_path, capsys):
    paths = f"[{text_file(tmp_path, 'empty.txt', '')}]"
    line = refuse(
        tmp_path, capsys, "--data.source", "files", "--data.paths", paths, "--data.cache_dir", str(tmp_path / "hf")
    )
    assert "empty corpus" in line and "data.paths" in line


def test_corpus_shorter_than_one_block(tmp_path, capsys):
    paths = f"[{text_file(tmp_path, 'short.txt', 'a short document')}]"
    line = refuse(
        tmp_path, capsys, "--data.source", "files", "--data.paths", paths, "--data.cache_dir", str(tmp_path / "hf")
    )
    assert "data.seq_len" in line and "tokens" in line


def test_missing_data_file(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--data.source", "files", "--data.paths", f"[{tmp_path / 'nowhere.txt'}]")
    assert "data.paths" in line and "nowhere.txt" in line


def test_unreadable_data_file(tmp_path, capsys):
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"text": "fine"}\nthis line is not json {\n')
    line = refuse(
        tmp_path, capsys, "--data.source", "files", "--data.paths", f"[{bad}]", "--data.cache_dir", str(tmp_path / "hf")
    )
    assert "data.paths" in line and "json" in line


def test_hub_dataset_unreachable_offline(tmp_path, capsys, monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    line = refuse(tmp_path, capsys, "--data.source", "hub", "--data.hub_name", "aah-tests/no-such-dataset")
    assert "data.hub_name='aah-tests/no-such-dataset'" in line and "cannot be reached" in line


def test_tokenizer_larger_than_model_vocabulary(tmp_path):
    # The CLI links model.gpt.vocab_size to the tokenizer; code that builds the pieces itself gets the same check.
    model = AAHModule(gpt=GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32, vocab_size=100))
    data = TextDataModule(
        source="files", paths=[text_file(tmp_path)], seq_len=32, batch_size=4, cache_dir=str(tmp_path / "hf")
    )
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(
        ConfigError, match=r"data.tokenizer='byte' produces ids up to 256, but model.gpt.vocab_size=100"
    ):
        trainer.fit(model, datamodule=data)
    assert trainer.global_step == 0


# -- checkpoints -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory) -> str:
    folder = train_tiny(tmp_path_factory.mktemp("good"), "--trainer.max_steps", "2")
    return os.path.join(folder, "last.ckpt")


def test_ckpt_path_does_not_exist(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--ckpt_path", str(tmp_path / "gone.ckpt"))
    assert "ckpt_path=" in line and "gone.ckpt" in line and "does not exist" in line


def test_ckpt_path_last_without_a_checkpoint(tmp_path, capsys):
    # Lightning only warns here and silently trains from scratch.
    line = refuse(tmp_path, capsys, "--ckpt_path", "last")
    assert "ckpt_path='last'" in line and str(tmp_path / "ckpts") in line


def test_truncated_checkpoint(tmp_path, capsys, good_ckpt):
    cut = tmp_path / "cut.ckpt"
    data = open(good_ckpt, "rb").read()
    cut.write_bytes(data[: len(data) // 2])
    line = refuse(tmp_path, capsys, "--ckpt_path", str(cut))
    assert "ckpt_path=" in line and "truncated" in line


def test_corrupt_checkpoint(tmp_path, capsys, good_ckpt):
    # One flipped byte inside a weight: torch.load would accept it silently; the archive's CRC does not match.
    bad = tmp_path / "flipped.ckpt"
    shutil.copy(good_ckpt, bad)
    with zipfile.ZipFile(bad) as z:
        entry = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 64)
    raw = bytearray(bad.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[entry.header_offset + 26 : entry.header_offset + 30])
    start = entry.header_offset + 30 + name_len + extra_len  # the entry's bytes follow its local header
    raw[start + 10] ^= 0xFF
    bad.write_bytes(raw)
    line = refuse(tmp_path, capsys, "--ckpt_path", str(bad))
    assert "ckpt_path=" in line and "corrupt" in line and entry.filename in line


def test_checkpoint_of_another_head_count(tmp_path, capsys, good_ckpt):
    line = refuse(tmp_path, capsys, "--ckpt_path", good_ckpt, "--model.gpt.n_head", "4")
    assert "model.gpt.n_head=2" in line and "model.gpt.n_head=4" in line


def test_checkpoint_of_another_shape(tmp_path, capsys, good_ckpt):
    line = refuse(tmp_path, capsys, "--ckpt_path", good_ckpt, "--model.gpt.n_layer", "3", "--model.gpt.n_embd", "64")
    assert "model.gpt.n_layer=2" in line and "model.gpt.n_embd=32" in line and "model.gpt.n_layer=3" in line


def test_checkpoint_trained_with_another_tokenizer(tmp_path, capsys, good_ckpt):
    # The checkpoint's model has the synthetic task's 65 symbols; the byte tokenizer needs 257.
    line = refuse(
        tmp_path, capsys, "--ckpt_path", good_ckpt, "--data.source", "files", "--data.paths", f"[{text_file(tmp_path)}]"
    )
    assert "model.gpt.vocab_size=65" in line and "data.tokenizer" in line


def test_validate_checks_the_checkpoint_too(tmp_path, capsys, good_ckpt):
    line = refuse(tmp_path, capsys, "--ckpt_path", good_ckpt, "--model.gpt.n_head", "4", subcommand="validate")
    assert "model.gpt.n_head=4" in line


def test_checkpoint_shape_check_without_the_cli(tmp_path, good_ckpt):
    # Trainer.fit(ckpt_path=...) directly: AAHModule.on_load_checkpoint reports the setting before load_state_dict.
    model = AAHModule(gpt=GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=32, vocab_size=65))
    data = TextDataModule(source="synthetic", seq_len=32, batch_size=4, synthetic_documents=100)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(ConfigError, match=r"model.gpt.n_head=2, but this run builds model.gpt.n_head=4"):
        trainer.fit(model, datamodule=data, ckpt_path=good_ckpt)
    assert trainer.global_step == 0


def test_error_inside_a_class_given_by_class_path_is_unwrapped(tmp_path, capsys):
    # jsonargparse wraps it in "Does not validate against any of the Union subtypes ..." with a traceback.
    line = refuse(
        tmp_path,
        capsys,
        "--trainer.callbacks+=aah_lightning.lit.guards.NonFiniteGuard",
        "--trainer.callbacks.check_every_n_steps",
        "0",
    )
    assert line == "aah: error: nonfinite_guard.check_every_n_steps=0 is not allowed: a positive integer or null"


def test_checkpoint_folder_that_cannot_be_created(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    line = refuse(tmp_path, capsys, "--checkpoint.dirpath", str(tmp_path / "a_file" / "ckpts"))
    assert line.startswith("aah: error: checkpoint.dirpath=") and "a_file" in line and "cannot be created" in line


def test_checkpoint_folder_that_cannot_be_written(tmp_path, capsys):
    # /proc refuses new files even to root, so this holds whoever runs the tests.
    line = refuse(tmp_path, capsys, "--checkpoint.dirpath", "/proc/aah-ckpts")
    assert line.startswith("aah: error: checkpoint.dirpath='/proc/aah-ckpts' cannot be created or written"), line


ADAPTIVE = ("--model.aah.policy", "adaptive")


@pytest.mark.parametrize(
    "setting, value, allowed",
    [
        ("allocator", "greedy", "reach"),
        ("feature_set", "everything", "paper, reach or all"),
        ("grouping", "kmeans", "cluster, none or fixed_random"),
    ],
)
def test_unknown_controller_choice(tmp_path, capsys, setting, value, allowed):
    line = refuse(tmp_path, capsys, *ADAPTIVE, f"--model.aah.controller.{setting}", value)
    assert f"model.aah.controller.{setting}='{value}'" in line and allowed in line


@pytest.mark.parametrize("value", ["0", "1.5"])
def test_coverage_target_outside_zero_one(tmp_path, capsys, value):
    line = refuse(tmp_path, capsys, *ADAPTIVE, "--model.aah.controller.coverage_target", value)
    assert f"model.aah.controller.coverage_target={float(value)}" in line and "(0, 1]" in line


@pytest.mark.parametrize("budget", ["target_acr", "target_causal_coverage"])
def test_budget_below_the_smallest_windows_cost(tmp_path, capsys, budget):
    # Candidates [8, 16, 32] at seq_len 32: the smallest window alone costs well above 0.01 on either measure.
    line = refuse(tmp_path, capsys, *ADAPTIVE, f"--model.aah.controller.{budget}", "0.01")
    assert f"model.aah.controller.{budget}=0.01" in line and "smallest candidate window 8" in line
