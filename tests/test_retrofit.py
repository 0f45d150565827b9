"""``model.init_from``: a run that starts from a trained model's weights (an aah checkpoint or a Hugging Face folder),
with the window table its policy decides. The weights reach the model before the first step and the window table does
not come along; settings that do not build the source's model are refused in one line before any step; the
controller decides at step 0 from the loaded weights on a task whose answer is known, at either budget scope; a
resume of such a run is exact; the recipe configs run."""

from __future__ import annotations

import glob
import os
from dataclasses import asdict

import pytest
import torch
import yaml

from aah_lightning import checkpoint as ck
from aah_lightning import retrofit
from aah_lightning.cli import main
from aah_lightning.errors import ConfigError
from aah_lightning.export import importer
from aah_lightning.lit.module import AAHModule
from aah_lightning.model import hf_import
from aah_lightning.windows import metrics
from helpers.cli import REPO, cli_error
from helpers.hf_models import save_tiny, save_tokenizer
from helpers.resume import check_resumed, interrupted_then_resumed, read_run, run_args

# -- the copy task: every target repeats the token DISTANCE back (data.recall.task: copy) -------------------------------
T, DISTANCE = 32, 20
CANDIDATES = "[4,8,16,32]"
SOURCE_TABLE = [[8, 8, 32, 8], [8, 8, 8, 8]]  # only head 2 of layer 0 sees 20 back: the head that learns the copy


def copy_args(folder, *extra, steps: int) -> list[str]:
    """An in-process ``aah fit`` on the copy task: 2 layers x 4 heads, d = 64, T = 32, 16 symbols (chance 2.8 nats)."""
    return [
        "fit",
        f"--trainer.max_steps={steps}",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.val_check_interval=1000",  # once, at the end
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
        f"--checkpoint.dirpath={folder}/ckpt",
        "--diagnostics.every_n_steps=1000",
        "--sample.enabled=false",
        "--model.gpt.n_layer=2",
        "--model.gpt.n_head=4",
        "--model.gpt.n_embd=64",
        f"--model.aah.candidates={CANDIDATES}",
        "--data.source=recall",
        "--data.recall.task=copy",
        f"--data.recall.copy_distance={DISTANCE}",
        "--data.recall.keys=8",
        "--data.recall.values=8",
        f"--data.seq_len={T}",
        "--data.batch_size=16",
        "--data.val_blocks=8",
        "--data.test_blocks=8",
        "--trainer.callbacks+=helpers.resume.Recorder",
        f"--trainer.callbacks.folder={folder}/rec",
        *extra,
    ]


@pytest.fixture(scope="module")
def copy_source(tmp_path_factory) -> str:
    """A model trained on the copy task for 250 steps (~12 s) with one long head: it learns the copy (loss < 0.05)."""
    folder = tmp_path_factory.mktemp("copy_source")
    table = str(SOURCE_TABLE).replace(" ", "")
    main(
        copy_args(
            folder, "--model.aah.policy=static", f"--model.aah.static.table={table}", "--model.optim.lr=3e-3", steps=250
        )
    )
    assert read_run(folder / "rec")[-1]["loss"] < 0.05
    return str(folder / "ckpt" / "last.ckpt")


def retrofit_args(signal: str, scope: str, target: float) -> list[str]:
    """The controller deciding at step 0 (and, within these few steps, only then)."""
    return [
        "--model.aah.policy=adaptive",
        "--model.aah.controller.schedule.warmup_steps=0",
        f"--model.aah.controller.need.signal={signal}",
        f"--model.aah.controller.budget.scope={scope}",
        f"--model.aah.controller.budget.target_acr={target}",
        "--model.aah.controller.allocation.coverage_target=1.0",
        "--model.aah.controller.groups.method=none",
        "--model.optim.lr=1e-3",
    ]


# Layer scope: layer 0 must afford 32 + 3 x 4 = 44 of 128 (ACR 0.344). Model scope: 0.25 of both layers leaves the
# seven other heads 4 tokens each (or one of them 8).
@pytest.mark.parametrize(
    "signal, scope, target", [("gain", "model", 0.25), ("gain", "layer", 0.35), ("mass", "layer", 0.35)]
)
def test_the_controller_decides_at_step_0_from_the_loaded_weights(copy_source, tmp_path, signal, scope, target):
    main(copy_args(tmp_path, f"--model.init_from={copy_source}", *retrofit_args(signal, scope, target), steps=2))
    first = read_run(tmp_path / "rec")[0]  # optimizer step 0: trained under the table decided before it
    table = torch.tensor(first["table"])
    assert int(table[0, 2]) >= DISTANCE  # the head that learned the copy keeps its reach,
    cost = table.clamp(max=T).double() / T
    assert float(cost.mean() if scope == "model" else cost.mean(1).max()) <= target + 1e-9  # within the budget,
    assert int((table >= DISTANCE).sum()) < table.numel() / 2  # which cannot keep every head wide,
    assert first["loss"] < 0.1  # and the loaded weights copy under it at once (chance: ln 16 = 2.8 nats)
    policy = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)[ck.POLICY_KEY]
    assert policy["decisions"] == 1 and policy["last_step"] == 0


def test_a_uniform_window_at_that_budget_cannot_keep_the_copy(copy_source, tmp_path):
    """The control: the same weights under one window for all at ACR 0.25 (8 tokens) lose the copy."""
    main(
        copy_args(
            tmp_path,
            f"--model.init_from={copy_source}",
            "--model.aah.policy=fixed",
            "--model.aah.fixed.window=8",
            steps=1,
        )
    )
    assert read_run(tmp_path / "rec")[0]["loss"] > 1.5


# -- loading -----------------------------------------------------------------------------------------------------------
def _trained_tiny(tiny_args, folder) -> str:
    """A tiny model (2 layers x 4 heads, d = 32, synthetic data) trained 2 steps under random windows."""
    main(
        tiny_args(
            f"--checkpoint.dirpath={folder}",
            f"--trainer.logger.init_args.save_dir={folder}/runs",
            "--model.aah.policy=random",
            "--model.aah.candidates=[8,16,32]",
            steps=2,
        )
    )
    return str(folder / "last.ckpt")


def test_the_weights_load_into_the_model_but_the_table_comes_from_the_policy(tmp_path, tiny_args):
    source = _trained_tiny(tiny_args, tmp_path / "src")
    saved = ck.read_checkpoint(source)
    module = AAHModule(**ck.hyperparameters(saved) | {"aah": {"policy": "full"}}, init_from=source)
    assert not torch.equal(module.model.wte.weight, saved[ck.STATE_DICT_KEY]["model.wte.weight"])  # not yet
    module.configure_model()  # what Lightning calls before the first step (and before FSDP2 shards)
    mine = module.state_dict()
    for key, value in saved[ck.STATE_DICT_KEY].items():
        if key != ck.WINDOWS_STATE_KEY:
            assert torch.equal(mine[key], value), key
    assert ck.window_table(saved).min() < 32  # the source held random windows ...
    assert torch.equal(module.model.windows, torch.full((2, 4), 32, dtype=torch.int32))  # ... the run its policy's
    assert "init_from" not in module.hparams  # a checkpoint of the run is complete without the source


def test_a_run_opens_its_source_once(tmp_path, tiny_args, monkeypatch):
    """The settings, the padded vocabulary, the check and the weights all come from one opening of the source
    (model_source.ModelSource): an aah checkpoint is read once, a Hugging Face folder's config and weights once each."""
    source = _trained_tiny(tiny_args, tmp_path / "src")
    saved = ck.read_checkpoint(source)
    opened = []

    def counting(read):
        return lambda path, *args, **kwargs: opened.append((read.__name__, str(path))) or read(path, *args, **kwargs)

    monkeypatch.setattr(ck, "read_checkpoint", counting(ck.read_checkpoint))
    AAHModule(**ck.hyperparameters(saved), init_from=source).configure_model()
    assert opened == [("read_checkpoint", source)]

    save_tiny("qwen3", tmp_path / "hf")
    folder = str(tmp_path / "hf")
    for name in ("read_config", "read_weights"):
        monkeypatch.setattr(hf_import, name, counting(getattr(hf_import, name)))
    opened.clear()
    module = AAHModule(gpt=hf_import.gpt_config(hf_import.read_config(folder)), init_from=folder)
    opened.clear()  # the settings above were this test's own reading
    AAHModule(gpt=module.gpt_config, init_from=folder).configure_model()
    assert opened == [("read_config", folder), ("read_weights", folder)]


def test_a_context_longer_than_the_sources_is_one_warning_naming_both(tmp_path, capsys):
    """Allowed (a context is extended by fine-tuning at it), said in one line: by a run, and by aah import."""
    import warnings
    from dataclasses import replace

    from helpers.hf_models import T as trained

    save_tiny("llama3", tmp_path / "hf")  # max_position_embeddings: trained
    save_tokenizer(tmp_path / "hf")
    folder = str(tmp_path / "hf")
    theirs = hf_import.gpt_config(hf_import.read_config(folder))
    with pytest.warns(UserWarning) as said:
        AAHModule(gpt=replace(theirs, seq_len=2 * trained), init_from=folder)
    assert [str(w.message) for w in said] == [
        f"data.seq_len={2 * trained} is longer than the context {folder} was trained for ({trained} tokens): positions past {trained} "
        f"are new to it, and until a fine-tune at {2 * trained} has taught them it may do worse there; data.seq_len={trained} "
        "keeps to what it knows"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the source's context: nothing to say
        AAHModule(gpt=replace(theirs, seq_len=trained), init_from=folder)
    capsys.readouterr()
    assert importer.main([folder, "--out", str(tmp_path / "long.ckpt"), "--seq_len", str(2 * trained)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"aah import: warning: --seq_len={2 * trained} is longer than the context {folder} was trained for ({trained} "
                   f"tokens): positions past {trained} are new to it, and until a fine-tune at {2 * trained} has taught them it "
                   f"may do worse there; --seq_len={trained} keeps to what it knows"], err  # fmt: skip


def test_settings_that_do_not_build_the_source_are_refused_in_one_line(tmp_path, tiny_args, capsys):
    source = _trained_tiny(tiny_args, tmp_path / "src")
    args = tiny_args(f"--model.init_from={source}", "--model.gpt.n_embd=64", "--model.gpt.norm=rmsnorm")
    args = [a.replace(f"{tmp_path}/ckpt", f"{tmp_path}/run") for a in args]
    code, line = cli_error(args, capsys)
    assert code == 2
    assert "model.gpt.n_embd: source 32, this run 64; model.gpt.norm: source 'layernorm', this run 'rmsnorm'" in line
    assert f"python -m aah_lightning.retrofit {source} prints them" in line
    assert not (tmp_path / "run").exists()  # refused before any step
    code, line = cli_error(tiny_args(f"--model.init_from={tmp_path}/nothing.ckpt"), capsys)
    assert code == 2 and "does not exist" in line and "model.init_from=" in line


def test_sources_that_are_no_model_are_refused_in_one_line(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="is not a checkpoint written by aah"):
        retrofit.source_config(tmp_path / "other.pt")
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / ".metadata").write_bytes(b"")
    with pytest.raises(ConfigError, match="a sharded checkpoint folder without meta.pt"):
        retrofit.source_config(tmp_path / "sharded")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="a folder without config.json"):
        retrofit.source_config(tmp_path / "empty")


def test_a_resume_of_a_run_started_from_a_source_is_exact(tmp_path, tiny_args):
    """init_from loads before the checkpoint is restored, so the resumed run continues from its own weights."""
    source = ["--model.init_from=" + _trained_tiny(tiny_args, tmp_path / "src")]
    main(run_args(tiny_args, tmp_path / "whole", *source))
    interrupted_then_resumed(tiny_args, tmp_path / "parts", *source)
    check_resumed(tmp_path)


# -- a Hugging Face folder -------------------------------------------------------------------------------------------
def test_the_overlay_of_an_imported_checkpoint_is_the_folders_model_and_tokenizer(tmp_path):
    save_tiny("qwen3", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    imported = importer.write_checkpoint(tmp_path / "hf", tmp_path / "imported.ckpt")
    config = retrofit.overlay(imported)
    theirs = asdict(hf_import.gpt_config(hf_import.read_config(tmp_path / "hf")))
    assert config["model"]["gpt"] == {k: theirs[k] for k in retrofit.SOURCE_SETTINGS if k != "vocab_size"}
    assert config["model"]["gpt"]["head_size"] == 16 and config["model"]["gpt"]["qk_norm"] is True
    assert config["data"]["tokenizer"] == str((tmp_path / "hf").resolve())  # what hf_checkpoint recorded
    assert retrofit.overlay(tmp_path / "hf") == config | {
        "model": {**config["model"], "init_from": str(tmp_path / "hf")}
    }


def test_a_gguf_file_is_refused_as_a_source_with_the_import_that_makes_one(tmp_path, tiny_args, capsys):
    """A run takes a GGUF file's aah import, not the file (docs/retrofit.md, "A real model from PyPI"): the line says
    so, and the import it names gives the overlay of a run."""
    from helpers.gguf_models import write_tiny_gguf

    gguf_file = tmp_path / "tiny.gguf"
    original = write_tiny_gguf(gguf_file)
    says = (
        f"model.init_from='{gguf_file}' is a GGUF file: a run starts from its aah import, so import it once "
        f"(aah import {gguf_file} --out tiny.ckpt; pip install 'aah-lightning[gguf]') and pass tiny.ckpt"
    )
    with pytest.raises(ConfigError) as refused:
        retrofit.source_config(gguf_file)
    assert str(refused.value) == says
    code, line = cli_error(tiny_args(f"--model.init_from={gguf_file}"), capsys)
    assert code == 2 and line == f"aah: error: {says}"
    assert retrofit.main([str(gguf_file)]) == 2
    assert capsys.readouterr().err == f"aah: error: {says}\n"

    imported = importer.write_checkpoint(gguf_file, tmp_path / "tiny.ckpt")
    config = retrofit.overlay(imported)
    assert config["data"]["tokenizer"] == str(tmp_path / "tiny.tokenizer.json")
    assert config["model"]["gpt"]["n_kv_head"] == original.config.num_key_value_heads
    assert config["model"]["gpt"]["mlp"] == "swiglu" and config["model"]["gpt"]["tie_embeddings"] is False


def test_a_hugging_face_folder_is_refused_without_its_settings(tmp_path, tiny_args, capsys):
    save_tiny("llama3", tmp_path / "hf")
    capsys.readouterr()
    code, line = cli_error(tiny_args(f"--model.init_from={tmp_path / 'hf'}", seq_len=24), capsys)
    assert code == 2
    for part in ("model.gpt.vocab_size: source 64, this run 65", "model.gpt.n_kv_head: source 2, this run None"):
        assert part in line
    assert "model.gpt.mlp: source 'swiglu', this run 'gelu'" in line and "follows data.tokenizer" in line


def two_synthetic_steps(tmp_path) -> list[str]:
    """A recipe's run cut to two steps and one validation batch, on synthetic token ids of the tiny folders'
    vocabulary (63 + end of text), its logs and checkpoints under ``tmp_path``."""
    return [
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}/runs",
        f"--checkpoint.dirpath={tmp_path}/ckpt",
        "--data.source=synthetic",
        "--data.synthetic.vocab=63",
        "--data.synthetic.documents=64",
    ]


def test_the_hugging_face_recipe_fine_tunes_an_imported_folder(tmp_path, tiny_args, capsys):
    """configs/retrofit/hf_import.yaml with the overlay ``python -m aah_lightning.retrofit`` prints for the folder: the
    folder's weights are what the run starts from (a learning rate too small to move them), and the table is the one
    the controller decided at step 0 under the recipe's budget, not the folder's sliding windows."""
    folder = tmp_path / "hf"
    save_tiny("mistral_sliding", folder)  # Mistral with a sliding window of 5 on every layer
    save_tokenizer(folder)
    capsys.readouterr()
    assert retrofit.main([str(folder)]) == 0
    overlay = tmp_path / "source.yaml"
    overlay.write_text(capsys.readouterr().out)
    settings = yaml.safe_load(overlay.read_text())
    assert settings["model"]["gpt"]["n_kv_head"] == 2 and settings["model"]["gpt"]["mlp"] == "swiglu"
    assert settings["data"]["tokenizer"] == str(folder.resolve())
    recipe = os.path.join(REPO, "configs", "retrofit", "hf_import.yaml")
    cpu = [  # the recipe on the CPU, two steps
        "--trainer.accelerator=cpu",
        "--trainer.precision=32-true",
        *two_synthetic_steps(tmp_path),
        "--data.seq_len=24",
        "--data.batch_size=4",
        "--data.global_batch_size=null",
        "--model.aah.candidates=null",  # T/8 .. T
        "--model.gpt.backend=auto",
        "--model.gpt.compile_blocks=false",
        "--model.aah.controller.need.probe_sequences=2",
        "--model.optim.lr=1e-12",
    ]
    main(["fit", "--config", recipe, "--config", str(overlay), *cpu])
    saved = ck.read_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    theirs = hf_import.import_folder(folder)
    ours = saved[ck.STATE_DICT_KEY]
    for key, value in theirs.state_dict().items():
        if key != "windows":
            torch.testing.assert_close(ours["model." + key], value, rtol=0, atol=1e-6, msg=key)
    assert saved[ck.POLICY_KEY]["decisions"] == 1 and saved[ck.POLICY_KEY]["last_step"] == 0
    table = ck.window_table(saved)
    assert not torch.equal(table, hf_import.window_table(hf_import.read_config(folder), theirs.cfg))
    target = yaml.safe_load(open(recipe))["model"]["aah"]["controller"]["budget"]["target_acr"]
    assert float((table.clamp(max=24).double() / 24).mean()) <= target + 1e-9


def test_the_cpu_recipe_decides_per_key_value_head_with_a_sink_and_fine_tunes(tmp_path, capsys):
    """configs/retrofit/smollm2_cpu.yaml on an imported Llama-family model: one decision at step 0 by the retrieval
    signal, every query head of a key/value head on that head's window (the cache keeps what the windows read), the
    4-token sink saved with the run, the budget met with the sink paid for, and the weights moved by the fine-tune."""
    folder = tmp_path / "hf"
    save_tiny("mistral", folder, num_hidden_layers=4, max_position_embeddings=64)
    save_tokenizer(folder)
    assert importer.main([str(folder), "--out", str(tmp_path / "m.ckpt")]) == 0
    capsys.readouterr()
    assert retrofit.main([str(tmp_path / "m.ckpt")]) == 0
    overlay = tmp_path / "source.yaml"
    overlay.write_text(capsys.readouterr().out)
    recipe = os.path.join(REPO, "configs", "retrofit", "smollm2_cpu.yaml")
    small = [  # the recipe at the tiny model's size: T 64, its 2 key/value heads, two steps
        *two_synthetic_steps(tmp_path),
        "--data.seq_len=64",
        "--model.aah.candidates=[4,64]",
        "--model.aah.controller.need.copy_span=8",
        "--model.aah.controller.groups.kv_heads=2",
        "--model.optim.lr=1e-2",
    ]
    main(["fit", "--config", recipe, "--config", str(overlay), *small])
    saved = ck.read_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert saved[ck.POLICY_KEY]["decisions"] == 1 and saved[ck.POLICY_KEY]["last_step"] == 0
    assert ck.hyperparameters(saved)["aah"]["sink"] == 4
    table = ck.window_table(saved)
    groups = table.view(4, 2, 2)
    assert torch.equal(groups[..., 0], groups[..., 1])  # query heads 2k and 2k+1 read key/value head k
    # 4 + 4 sink positions cost 0.125 a head; the budget buys one whole key/value head of 8 and no more
    assert sorted(groups[..., 0].flatten().tolist()) == [4] * 7 + [64]
    target = yaml.safe_load(open(recipe))["model"]["aah"]["controller"]["budget"]["target_acr"]
    assert float(metrics.acr(table, 64, 4)) <= target + 1e-9
    imported = ck.read_checkpoint(tmp_path / "m.ckpt")[ck.STATE_DICT_KEY]
    tuned = saved[ck.STATE_DICT_KEY]
    assert imported.keys() == tuned.keys()
    assert not torch.equal(imported["model.wte.weight"], tuned["model.wte.weight"])  # the fine-tune moved the weights


RETROFIT_ROWS = sorted(glob.glob(f"{REPO}/configs/retrofit/recall/*.yaml"))


@pytest.mark.parametrize("row", [p for p in RETROFIT_ROWS if not p.endswith("base.yaml")], ids=os.path.basename)
def test_the_recall_retrofit_rows_parse_as_the_recall_task(row, capsys):
    """configs/retrofit/recall: every row is a short fine-tune from a recall baseline, with the recall task's model
    and data settings (the source's shapes: a difference would be refused at start) and the row's policy."""
    base = f"{REPO}/configs/retrofit/recall/base.yaml"
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", base, "--config", row, "--print_config"])
    assert done.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["fit", "--config", f"{REPO}/configs/recall/base.yaml", "--print_config"])
    recall = yaml.safe_load(capsys.readouterr().out)
    assert config["data"] == recall["data"]
    assert config["model"]["gpt"] == recall["model"]["gpt"]
    assert config["model"]["init_from"] == "runs/recall/baseline/checkpoints/last.ckpt"  # configs/recall/baseline's
    assert config["trainer"]["max_steps"] <= 500
    aah = config["model"]["aah"]
    name = os.path.basename(row)[:-5]
    if name.startswith("gain"):
        controller = aah["controller"]
        budget = controller["budget"]
        assert (aah["policy"], controller["need"]["signal"], budget["scope"]) == ("adaptive", "gain", "model")
        assert controller["schedule"]["warmup_steps"] == 0 and budget["target_acr"] == float(name.split("acr")[1])
        assert controller["reach"]["heads"] == (1 if name.startswith("gain_reach") else 0)


def test_a_padded_vocabulary_keeps_its_rows_through_the_fine_tune(tmp_path, tiny_args, capsys):
    """A Qwen3 folder whose embedding has 80 rows for a tokenizer of 64 ids (Qwen pads its vocabulary): the run's
    vocabulary follows the data (64 ids), the model keeps the source's 80 rows (tests/export exports such a model)."""
    folder = tmp_path / "hf"
    theirs = save_tiny("qwen3", folder, vocab_size=80)
    save_tokenizer(folder)  # 64 ids
    capsys.readouterr()
    assert retrofit.main([str(folder)]) == 0
    overlay = tmp_path / "source.yaml"
    overlay.write_text(capsys.readouterr().out)
    run = ["--config", str(overlay), "--data.synthetic.vocab=63", "--model.optim.lr=1e-12", "--model.aah.policy=full"]
    main(tiny_args(*run, steps=2, seq_len=24))
    saved = ck.read_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert ck.gpt_settings(saved)["vocab_size"] == 80
    wte = saved[ck.STATE_DICT_KEY]["model.wte.weight"]
    torch.testing.assert_close(wte, theirs.model.embed_tokens.weight.detach(), rtol=0, atol=1e-6)  # rows 64..79 too
    module = AAHModule(**ck.hyperparameters(saved), init_from=str(folder))  # a resume builds the same model
    assert module.gpt_config.vocab_size == 80
