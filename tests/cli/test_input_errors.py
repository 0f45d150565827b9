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

from aah_lightning import preflight
from aah_lightning.cli import main
from aah_lightning.errors import ConfigError
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig
from helpers.cli import cli_error, run_tool, tiny_config, train_tiny


def files_source(paths: str, cache=None) -> list[str]:
    """The command-line settings of a ``files`` source (and its cache folder)."""
    cache_args = [f"--data.cache_dir={cache}"] if cache is not None else []
    return ["--data.source=files", f"--data.files.paths={paths}", *cache_args]


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


# -- parse errors: the setting, the file it came from, the nearest valid setting; no usage ---------------------------
def parse_refusal(tmp_path, capsys, *args, **sections) -> str:
    """The whole stderr of a refused parse: exactly one line."""
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", tiny_config(tmp_path, **sections), *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "usage:" not in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "ckpts")
    return err.strip()


def test_a_mistyped_setting_on_the_command_line_names_the_nearest_one(tmp_path, capsys):
    assert parse_refusal(tmp_path, capsys, "--trainer.max_stepz=3") == (
        "aah: error: trainer.max_stepz is not a setting of aah fit: did you mean trainer.max_steps? "
        "(aah fit --help lists every setting)"
    )
    # A field of a dataclass setting (jsonargparse reports only the part below model.aah)
    line = parse_refusal(tmp_path, capsys, "--model.aah.controller.warmup_stepz=3")
    assert line.startswith("aah: error: model.aah.controller.warmup_stepz is not a setting of aah fit: did you mean ")
    assert "model.aah.controller.schedule.warmup_steps?" in line


def test_a_mistyped_setting_in_a_config_file_names_the_file(tmp_path, capsys):
    config = tiny_config(tmp_path)
    line = parse_refusal(tmp_path, capsys, model={"gpt": {"n_layr": 3}})  # tiny.yaml, rewritten with the typo
    assert line == (
        f"aah: error: model.gpt.n_layr (set in {config}) is not a setting of aah fit: did you mean model.gpt.n_layer? "
        "(aah fit --help lists every setting)"
    )
    line = parse_refusal(tmp_path, capsys, model={"aah": {"polcy": "random"}})
    assert line.startswith(f"aah: error: model.aah.polcy (set in {config}) is not a setting of aah fit: did you mean ")
    assert line.endswith("model.aah.policy? (aah fit --help lists every setting)")


def test_a_value_of_the_wrong_type_names_the_setting_and_its_file(tmp_path, capsys):
    assert parse_refusal(tmp_path, capsys, "--data.batch_size=four") == (
        "aah: error: data.batch_size='four' is not allowed: a value of type int"
    )
    config = tiny_config(tmp_path)
    assert parse_refusal(tmp_path, capsys, data={"batch_size": "four"}) == (
        f"aah: error: data.batch_size='four' (set in {config}) is not allowed: a value of type int"
    )
    assert parse_refusal(tmp_path, capsys, "--model.aah.controller.budget.target_acr=half") == (
        "aah: error: model.aah.controller.budget.target_acr='half' is not allowed: a value of type float or null"
    )


def test_the_later_source_of_a_setting_is_the_one_named(tmp_path, capsys):
    other = tmp_path / "other.yaml"
    other.write_text("data:\n  batch_size: four\n")
    line = parse_refusal(tmp_path, capsys, "--config", str(other))
    assert line == f"aah: error: data.batch_size='four' (set in {other}) is not allowed: a value of type int"


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
    line = refuse(
        tmp_path, capsys, "--model.aah.policy", "static", "--model.aah.static.table", "[[8, 16], [8, 16], [8, 16]]"
    )
    assert "model.aah.static.table" in line and "n_layer=2" in line and "n_head=2" in line


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


# -- legal but questionable: one warning line, and the run goes on --------------------------------------------------
def _warnings_of(module, data) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        preflight.warn_questionable(module, data)
    return [str(w.message) for w in caught]


def test_a_controller_setting_under_a_policy_that_ignores_it_warns():
    from aah_lightning.windows.config import AAHConfig

    data = TextDataModule(source="synthetic", seq_len=32, batch_size=4)
    gpt = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32, vocab_size=65)
    aah = AAHConfig(policy="random", candidates=[8, 16, 32])
    aah.controller.budget.target_acr = 0.5
    assert _warnings_of(AAHModule(gpt=gpt, aah=aah), data) == [
        "model.aah.controller.budget.target_acr=0.5 has no effect with model.aah.policy='random', which reads "
        "model.aah.candidates and model.aah.random: it is ignored"
    ]
    for policy in ("adaptive", "shuffle"):  # the policies that read it (shuffle wraps the controller): no warning
        aah.policy = policy
        assert _warnings_of(AAHModule(gpt=gpt, aah=aah), data) == [], policy


def test_settings_a_policy_does_not_read_warn_in_one_line_and_are_never_refused():
    from aah_lightning.windows.config import AAHConfig

    data = TextDataModule(source="synthetic", seq_len=32, batch_size=4)
    gpt = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32, vocab_size=65)
    # The retrofit recipe's candidates (up to 2048) switched to one fixed window at a shorter context: the fixed
    # policy never reads them, so a candidate longer than the context is no reason to stop.
    fixed = AAHConfig(policy="fixed", candidates=[8, 16, 64], fixed={"window": 8})
    module = AAHModule(gpt=gpt, aah=fixed)
    assert _warnings_of(module, data) == [
        "model.aah.candidates=[8, 16, 64] has no effect with model.aah.policy='fixed', which reads model.aah.fixed: "
        "it is ignored"
    ]
    assert module.policy.report().candidates == [4, 8, 16, 32]  # what its windows are reported against: T/8 .. T
    full = AAHConfig(policy="full", candidates=[8, 16, 32], static={"table": [[8, 8], [8, 8]]})
    assert _warnings_of(AAHModule(gpt=gpt, aah=full), data) == [
        "model.aah.candidates=[8, 16, 32], model.aah.static.table=[[8, 8], [8, 8]] have no effect with "
        "model.aah.policy='full', which reads none of these settings: they are ignored"
    ]
    drawn = AAHConfig(policy="random", candidates=[8, 16, 32], random={"table": [[8, 32], [8, 8]]})
    assert _warnings_of(AAHModule(gpt=gpt, aah=drawn), data) == [
        "model.aah.candidates=[8, 16, 32] has no effect with model.aah.policy='random', which reads "
        "model.aah.random: it is ignored"
    ]
    with pytest.raises(ConfigError, match=r"model.aah.candidates=\[8, 16, 64\] is not allowed"):
        AAHModule(gpt=gpt, aah=AAHConfig(policy="random", candidates=[8, 16, 64]))  # read, so still checked


def test_a_recall_vocabulary_that_dwarfs_the_model_warns():
    def run(keys: int) -> list[str]:
        data = TextDataModule(source="recall", seq_len=32, batch_size=4, recall={"keys": keys})
        gpt = GPTConfig(n_layer=2, n_head=2, n_embd=64, seq_len=32, vocab_size=data.vocab_size)
        return _warnings_of(AAHModule(gpt=gpt), data)

    assert run(32) == []  # configs/recall's size
    (line,) = run(100000)
    assert line.startswith("data.recall.keys=100000 (with data.recall.values=16) makes a vocabulary of 100017 tokens: ")
    assert "times the rest; fewer keys train faster" in line


def test_no_validation_blocks_is_refused(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--data.source=recall", "--data.val_blocks=0")
    assert line == (
        "aah: error: data.val_blocks=0 is not allowed: a positive number of held-out blocks (to train without "
        "validation, set trainer.limit_val_batches=0)"
    )


# -- data ------------------------------------------------------------------------------------------------------------
def test_global_batch_size_that_one_process_cannot_reach_or_a_conflicting_accumulation(tmp_path, capsys):
    # tiny_config: data.batch_size=4 on one process
    line = refuse(tmp_path, capsys, "--data.global_batch_size=6")
    assert line == (
        "aah: error: data.global_batch_size=6 is not allowed with data.batch_size=4 on 1 process(es): a multiple of 4 "
        "(data.batch_size x processes), e.g. 4 or 8"
    )
    line = refuse(tmp_path, capsys, "--data.global_batch_size=2")  # below the smallest: one suggestion
    assert line.endswith("a multiple of 4 (data.batch_size x processes), e.g. 4")
    line = refuse(tmp_path, capsys, "--data.global_batch_size=8", "--trainer.accumulate_grad_batches=3")
    assert line.startswith("aah: error: trainer.accumulate_grad_batches=3 is not allowed with data.global_batch_size=8")
    assert "(8 / (data.batch_size=4 x 1 processes) = 2)" in line


def test_a_stream_resumed_on_another_number_of_processes_is_refused():
    from types import SimpleNamespace

    data = TextDataModule(source="hub", hub={"name": "local/fake"}, batch_size=4)
    saved = {"source": "hub", "seed": 1234, "batch_size": 4, "accumulate_grad_batches": 1, "world_size": 2}
    one_process = SimpleNamespace(world_size=1, accumulate_grad_batches=2)  # the same global batch, 8
    with pytest.raises(ConfigError) as e:
        data.check_resume({**saved, "num_workers": 0}, one_process)
    assert "\n" not in str(e.value) and str(e.value).startswith("the checkpoint holds stream positions of 2 process")
    assert "resume on 2 process(es) with data.num_workers=0, or start a new run" in str(e.value)
    two = SimpleNamespace(world_size=2, accumulate_grad_batches=1)
    data.check_resume({**saved, "num_workers": 0}, two)  # the same split: continues
    with pytest.raises(ConfigError, match="data.num_workers=2, this run has 2 with 0"):
        data.check_resume({**saved, "num_workers": 2}, two)


def test_empty_corpus(tmp_path, capsys):
    paths = f"[{text_file(tmp_path, 'empty.txt', '')}]"
    line = refuse(tmp_path, capsys, *files_source(paths, tmp_path / "hf"))
    assert "empty corpus" in line and "data.files.paths" in line


def test_corpus_shorter_than_one_block(tmp_path, capsys):
    paths = f"[{text_file(tmp_path, 'short.txt', 'a short document')}]"
    line = refuse(tmp_path, capsys, *files_source(paths, tmp_path / "hf"))
    assert "data.seq_len" in line and "tokens" in line


def test_missing_data_file(tmp_path, capsys):
    line = refuse(tmp_path, capsys, *files_source(f"[{tmp_path / 'nowhere.txt'}]"))
    assert "data.files.paths" in line and "nowhere.txt" in line


def test_unreadable_data_file(tmp_path, capsys):
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"text": "fine"}\nthis line is not json {\n')
    line = refuse(tmp_path, capsys, *files_source(f"[{bad}]", tmp_path / "hf"))
    assert "data.files.paths" in line and "json" in line


def test_hub_dataset_unreachable_offline(tmp_path, capsys, monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    line = refuse(tmp_path, capsys, "--data.source", "hub", "--data.hub.name", "aah-tests/no-such-dataset")
    assert "data.hub.name='aah-tests/no-such-dataset'" in line and "cannot be reached" in line


def test_a_hub_tokenizer_offline_is_one_line_at_once(tmp_path, capsys, monkeypatch):
    import time

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))  # nothing cached
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    start = time.monotonic()
    line = refuse(tmp_path, capsys, "--data.source=stdlib", "--data.tokenizer=aah-tests/no-such-tokenizer")
    assert time.monotonic() - start < 20  # no retries (they took 33 s)
    assert line.startswith(
        "aah: error: data.tokenizer='aah-tests/no-such-tokenizer' is not in the local Hugging Face cache and "
        "HF_HUB_OFFLINE is set: "
    )


def test_a_hub_tokenizer_with_the_hub_out_of_reach_is_one_line_at_once(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # a port nothing listens on
    for proxy in ("HTTPS_PROXY", "https_proxy", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(proxy, raising=False)
    line = refuse(tmp_path, capsys, "--data.source=stdlib", "--data.tokenizer=gpt2")
    assert line == (
        "aah: error: data.tokenizer='gpt2' is not in the local Hugging Face cache and the hub (http://127.0.0.1:9) "
        "cannot be reached from this machine: pass a local tokenizer.json file or folder, or 'byte'"
    )


def test_tokenizer_larger_than_model_vocabulary(tmp_path):
    # The CLI links model.gpt.vocab_size to the tokenizer; code that builds the pieces itself gets the same check.
    model = AAHModule(gpt=GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32, vocab_size=100))
    data = TextDataModule(
        source="files", files={"paths": [text_file(tmp_path)]}, seq_len=32, batch_size=4, cache_dir=str(tmp_path / "hf")
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
        tmp_path,
        capsys,
        "--ckpt_path",
        good_ckpt,
        *files_source(f"[{text_file(tmp_path)}]"),
    )
    assert "model.gpt.vocab_size=65" in line and "data.tokenizer" in line


def test_validate_checks_the_checkpoint_too(tmp_path, capsys, good_ckpt):
    line = refuse(tmp_path, capsys, "--ckpt_path", good_ckpt, "--model.gpt.n_head", "4", subcommand="validate")
    assert "model.gpt.n_head=4" in line


def test_checkpoint_shape_check_without_the_cli(tmp_path, good_ckpt):
    # Trainer.fit(ckpt_path=...) directly: AAHModule.on_load_checkpoint reports the setting before load_state_dict.
    model = AAHModule(gpt=GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=32, vocab_size=65))
    data = TextDataModule(source="synthetic", seq_len=32, batch_size=4, synthetic={"documents": 100})
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


@pytest.mark.parametrize("every", [-1, 0])
def test_a_checkpoint_interval_that_is_not_a_positive_number_of_steps(tmp_path, capsys, every):
    line = refuse(tmp_path, capsys, f"--checkpoint.every_n_train_steps={every}")
    assert line.startswith(
        f"aah: error: checkpoint.every_n_train_steps={every} is not allowed: a positive number of optimizer steps"
    )


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
        ("allocation.allocator", "greedy", "reach"),
        ("groups.feature_set", "everything", "paper, reach or all"),
        ("groups.method", "kmeans", "one of cluster, none, fixed_random or kv_heads"),
    ],
)
def test_unknown_controller_choice(tmp_path, capsys, setting, value, allowed):
    line = refuse(tmp_path, capsys, *ADAPTIVE, f"--model.aah.controller.{setting}", value)
    assert f"model.aah.controller.{setting}='{value}'" in line and allowed in line


@pytest.mark.parametrize("value", ["0", "1.5"])
def test_coverage_target_outside_zero_one(tmp_path, capsys, value):
    line = refuse(tmp_path, capsys, *ADAPTIVE, "--model.aah.controller.allocation.coverage_target", value)
    assert f"model.aah.controller.allocation.coverage_target={float(value)}" in line and "(0, 1]" in line


@pytest.mark.parametrize("budget", ["target_acr", "target_causal_coverage"])
def test_budget_below_the_smallest_windows_cost(tmp_path, capsys, budget):
    # Candidates [8, 16, 32] at seq_len 32: the smallest window alone costs well above 0.01 on either measure.
    line = refuse(tmp_path, capsys, *ADAPTIVE, f"--model.aah.controller.budget.{budget}", "0.01")
    assert f"model.aah.controller.budget.{budget}=0.01" in line and "smallest candidate window 8" in line


# -- files and devices of aah predict, tools/generate.py, tools/inspect_windows.py and aah-prepare ----------------------
LATIN1 = "caf\xe9 au lait\n".encode("latin-1")  # the é is one byte, 0xe9: not UTF-8


def latin1_file(tmp_path, name: str, before: str = "") -> str:
    path = tmp_path / name
    path.write_bytes(before.encode() + LATIN1)
    return str(path)


def tool_error(capsys, name: str, *args: str) -> str:
    """``tools/<name>.py ARGS`` in-process, expecting one error line and exit status 2; returns the line."""
    capsys.readouterr()
    code = run_tool(name, *args)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2 and len(lines) == 1, err
    return lines[0]


def unreadable(monkeypatch, path: str) -> str:
    """``path``, made unreadable to this process: by its permissions, or for root (which reads any file) by
    os.access saying so."""
    os.chmod(path, 0)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if str(p) == path else real(p, mode, *a, **k))
    return path


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine without CUDA or MPS, whatever it has."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(preflight, "_accelerators", lambda: {"cpu": True, "cuda": False, "mps": False, "tpu": False})


@pytest.fixture
def two_gpus(monkeypatch):
    """This machine with two CUDA devices (nothing is run on them: every check below refuses first)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(preflight, "_accelerators", lambda: {"cpu": True, "cuda": True, "mps": False, "tpu": False})


PREDICT_OUT = "predict_out.jsonl"


def predict_args(tmp_path, *extra) -> list[str]:
    prompts = tmp_path / "prompts.txt"
    if not prompts.exists():
        prompts.write_text("def f(\n")
    return [f"--data.prompts={prompts}", f"--generate.output={tmp_path / PREDICT_OUT}", *extra]


def refuse_predict(tmp_path, capsys, *extra) -> str:
    line = refuse(tmp_path, capsys, *predict_args(tmp_path, *extra), subcommand="predict")
    assert not (tmp_path / PREDICT_OUT).exists()
    return line


def test_predict_prompts_not_utf8(tmp_path, capsys):
    prompts = latin1_file(tmp_path, "latin1.txt", before="def f(\n\n")
    line = refuse_predict(tmp_path, capsys, f"--data.prompts={prompts}")
    assert f"data.prompts='{prompts}' line 3 is not UTF-8" in line and "byte 0xe9 at column 4" in line
    assert "encoded as UTF-8" in line


def test_predict_jsonl_prompts_not_utf8(tmp_path, capsys):
    prompts = latin1_file(tmp_path, "latin1.jsonl", before='{"prompt": "a"}\n')
    line = refuse_predict(tmp_path, capsys, f"--data.prompts={prompts}")
    assert f"data.prompts='{prompts}' line 2 is not UTF-8" in line


def test_prompts_with_a_byte_order_mark_are_utf8(tmp_path):
    from aah_lightning.data.prompts import read_prompts

    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffcaf\xe9\r\nna\xefve\n".encode("utf-8"))  # as Windows editors save UTF-8
    assert read_prompts(str(path)) == ["caf\xe9", "na\xefve"]


def test_predict_prompts_is_a_folder(tmp_path, capsys):
    line = refuse_predict(tmp_path, capsys, f"--data.prompts={tmp_path}")
    assert f"data.prompts='{tmp_path}' is a folder: pass a prompts file" in line


def test_predict_prompts_unreadable(tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "secret.txt"
    prompts.write_text("def f(\n")
    line = refuse_predict(tmp_path, capsys, f"--data.prompts={unreadable(monkeypatch, str(prompts))}")
    assert f"data.prompts='{prompts}' cannot be read" in line


def test_predict_checkpoint_is_a_folder(tmp_path, capsys):
    (tmp_path / "afolder").mkdir()
    line = refuse_predict(tmp_path, capsys, f"--ckpt_path={tmp_path / 'afolder'}")
    assert "ckpt_path=" in line and "is a folder" in line


def test_predict_checkpoint_unreadable(tmp_path, capsys, monkeypatch, good_ckpt):
    ckpt = tmp_path / "copy.ckpt"
    shutil.copy(good_ckpt, ckpt)
    line = refuse_predict(tmp_path, capsys, f"--ckpt_path={unreadable(monkeypatch, str(ckpt))}")
    assert f"ckpt_path='{ckpt}' is not readable" in line


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "does not exist: pass a YAML config file"),
        ("folder", "is a folder: pass a YAML config file"),
        (LATIN1, "line 1 is not UTF-8 text"),
        (b"trainer: [\n", "line 2 column 1 is not valid YAML"),
        (b"- a list\n", "holds a YAML list"),
    ],
)
def test_config_file_that_cannot_be_used(tmp_path, capsys, content, words):
    config = tmp_path / "bad.yaml"
    if content == "folder":
        config.mkdir()
    elif content is not None:
        config.write_bytes(content)
    for subcommand in ("predict", "fit"):
        code, line = cli_error([subcommand, "--config", str(config)], capsys)
        assert code == 2 and line.startswith(f"aah: error: --config='{config}'") and words in line, line


def test_predict_accelerator_gpu_without_a_gpu(tmp_path, capsys, no_gpu):
    for accelerator in ("gpu", "cuda"):
        line = refuse_predict(tmp_path, capsys, f"--trainer.accelerator={accelerator}")
        assert f"trainer.accelerator='{accelerator}' is not allowed" in line and "no " in line and "use cpu" in line


def test_predict_accelerator_unknown(tmp_path, capsys):
    line = refuse_predict(tmp_path, capsys, "--trainer.accelerator=banana")
    assert "trainer.accelerator='banana' is not allowed: one of auto, cpu, gpu, cuda, mps, tpu" in line


def test_predict_more_cuda_devices_than_the_machine_has(tmp_path, capsys, two_gpus):
    for devices in ("[3]", "3", "0,2"):
        line = refuse_predict(tmp_path, capsys, "--trainer.accelerator=cuda", f"--trainer.devices={devices}")
        assert "trainer.devices=" in line and "this machine has 2 CUDA devices" in line and "0 to 1" in line


def test_predict_zero_cpu_devices(tmp_path, capsys):
    line = refuse_predict(tmp_path, capsys, "--trainer.devices=0")
    assert "trainer.devices=" in line and "a positive number of processes" in line


def test_lightning_device_errors_check_devices_does_not_foresee_are_one_line(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "--trainer.num_nodes=0")
    assert "trainer.num_nodes=0 cannot be used on this machine" in line and "num_nodes" in line


# tools/generate.py
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_generate_cuda_without_a_gpu(capsys, no_gpu, good_ckpt, device):
    line = tool_error(capsys, "generate", good_ckpt, "--device", device)
    assert line.startswith(f"generate: error: --device='{device}' is not allowed: no CUDA device is available"), line
    assert "use cpu" in line


def test_generate_cuda_index_beyond_the_machine(capsys, two_gpus, good_ckpt):
    line = tool_error(capsys, "generate", good_ckpt, "--device", "cuda:3")
    assert "--device='cuda:3' is not allowed: this machine has 2 CUDA devices" in line
    assert "cuda:0 to cuda:1" in line


def test_generate_mps_without_one(capsys, no_gpu, good_ckpt):
    line = tool_error(capsys, "generate", good_ckpt, "--device", "mps")
    assert "--device='mps' is not allowed: no Apple GPU (MPS)" in line and "use cpu" in line


@pytest.mark.parametrize("device", ["gpu", "", "meta", "cpu:x"])
def test_generate_device_that_is_not_one(capsys, good_ckpt, device):
    line = tool_error(capsys, "generate", good_ckpt, "--device", device)
    assert f"--device='{device}' is not a device" in line and "cpu" in line


@pytest.mark.parametrize("case", ["missing", "folder", "unreadable"])
def test_generate_checkpoint_that_cannot_be_read(tmp_path, capsys, monkeypatch, good_ckpt, case):
    ckpt = tmp_path / "model.ckpt"
    if case == "folder":
        ckpt.mkdir()
    elif case == "unreadable":
        shutil.copy(good_ckpt, ckpt)
        unreadable(monkeypatch, str(ckpt))
    line = tool_error(capsys, "generate", str(ckpt), "--device", "cpu")
    words = {"missing": "does not exist", "folder": "is a folder", "unreadable": "is not readable"}[case]
    assert f"ckpt_path='{ckpt}' {words}" in line


@pytest.mark.parametrize("case", ["missing", "folder", "latin1"])
def test_generate_tokenizer_that_cannot_be_read(tmp_path, capsys, good_ckpt, case):
    path = {"missing": str(tmp_path / "no" / "tokenizer.json"), "folder": str(tmp_path)}.get(case)
    path = path or latin1_file(tmp_path, "tokenizer.json")
    line = tool_error(capsys, "generate", good_ckpt, "--device", "cpu", "--tokenizer", path)
    words = {"missing": "no such file", "folder": "is a folder without a tokenizer.json", "latin1": "UTF-8"}[case]
    assert f"--tokenizer='{path}'" in line and words in line


# tools/inspect_windows.py
@pytest.mark.parametrize("case", ["missing", "folder", "unreadable"])
def test_inspect_checkpoint_that_cannot_be_read(tmp_path, capsys, monkeypatch, good_ckpt, case):
    ckpt = tmp_path / "model.ckpt"
    if case == "folder":
        ckpt.mkdir()
    elif case == "unreadable":
        shutil.copy(good_ckpt, ckpt)
        unreadable(monkeypatch, str(ckpt))
    line = tool_error(capsys, "inspect_windows", str(ckpt), "--out", str(tmp_path / "out"))
    words = {"missing": "does not exist", "folder": "is a folder", "unreadable": "is not readable"}[case]
    assert f"checkpoint='{ckpt}' {words}" in line
    assert not (tmp_path / "out").exists()


def test_inspect_out_is_a_file(tmp_path, capsys, good_ckpt):
    out = tmp_path / "a_file"
    out.write_text("")
    line = tool_error(capsys, "inspect_windows", good_ckpt, "--out", str(out))
    assert line == f"inspect_windows: error: --out='{out}' is a file, not a folder: name a folder (new or existing)"


def test_inspect_out_cannot_be_written(tmp_path, capsys, good_ckpt):
    line = tool_error(capsys, "inspect_windows", good_ckpt, "--out", "/proc/aah-inspect")
    assert line.startswith("inspect_windows: error: --out='/proc/aah-inspect' cannot be created or written")


# aah-prepare (tools/prepare_data.py)
@pytest.mark.parametrize(
    "content, words",
    [
        (None, "does not exist"),
        ("folder", "is a folder"),
        (LATIN1, "line 1 is not UTF-8 text"),
        (b"data: [\n", "is not valid YAML"),
    ],
)
def test_prepare_config_that_cannot_be_used(tmp_path, capsys, content, words):
    config = tmp_path / "c.yaml"
    if content == "folder":
        config.mkdir()
    elif content is not None:
        config.write_bytes(content)
    line = tool_error(capsys, "prepare_data", "--config", str(config), "--out", str(tmp_path / "tokens"))
    assert line.startswith(f"aah-prepare: error: --config='{config}'") and words in line, line
    assert not (tmp_path / "tokens").exists()


def test_prepare_corpus_not_utf8(tmp_path, capsys):
    corpus = latin1_file(tmp_path, "latin1.txt", before="def f():\n    pass\n")
    args = ["--source", "files", "--paths", corpus, "--out", str(tmp_path / "tokens"), "--cache_dir", str(tmp_path)]
    line = tool_error(capsys, "prepare_data", *args)
    assert f"data.files.paths entry '{corpus}' line 3 is not UTF-8 text" in line
    assert not (tmp_path / "tokens").exists()


def test_fit_corpus_not_utf8(tmp_path, capsys):
    corpus = latin1_file(tmp_path, "latin1.jsonl", before='{"text": "fine"}\n')
    line = refuse(
        tmp_path,
        capsys,
        *files_source(f"[{corpus}]", tmp_path),
    )
    assert f"data.files.paths entry '{corpus}' line 2 is not UTF-8 text" in line


@pytest.mark.parametrize("where", ["under_a_file", "unwritable"])
def test_prepare_out_cannot_be_written(tmp_path, capsys, where):
    (tmp_path / "a_file").write_text("")
    out = str(tmp_path / "a_file" / "tokens") if where == "under_a_file" else "/proc/aah-tokens"
    corpus = text_file(tmp_path)
    line = tool_error(capsys, "prepare_data", "--source", "files", "--paths", corpus, "--out", out)
    assert line.startswith(f"aah-prepare: error: --out='{out}' cannot be created or written"), line


def test_prepare_cache_dir_is_a_file(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    corpus = text_file(tmp_path)
    line = tool_error(
        capsys, "prepare_data", "--source", "files", "--paths", corpus, "--cache_dir", str(tmp_path / "a_file")
    )
    assert f"--cache_dir='{tmp_path / 'a_file'}' is a file, not a folder" in line


def test_prepare_tokenizer_not_a_tokenizer(tmp_path, capsys):
    tokenizer = latin1_file(tmp_path, "tokenizer.json")
    corpus = text_file(tmp_path)
    args = ["--source", "files", "--paths", corpus, "--tokenizer", tokenizer, "--out", str(tmp_path / "tokens")]
    line = tool_error(capsys, "prepare_data", *args)
    assert f"--tokenizer='{tokenizer}' is not a Hugging Face tokenizer.json" in line


@pytest.mark.parametrize("case", ["missing", "a_file"])
def test_prepare_verify_what_is_not_a_token_folder(tmp_path, capsys, case):
    path = tmp_path / case
    if case == "a_file":
        path.write_text("")
    line = tool_error(capsys, "prepare_data", "--verify", str(path))
    assert line.startswith(f"aah-prepare: error: --verify='{path}'"), line
