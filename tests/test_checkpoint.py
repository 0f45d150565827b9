"""aah_lightning/checkpoint.py: the one reader of checkpoints (verified, weights-only), ``load_model`` on a real
checkpoint of Lightning, and the checkpoint's keys named in one place only (its table in the docstring, in code and in
docs/architecture.md agree; no other module of the package or tool spells a key out)."""

from __future__ import annotations

import ast
import json
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import aah_lightning
from aah_lightning import checkpoint as ck
from aah_lightning.cli import main as aah
from aah_lightning.errors import ConfigError
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig
from aah_lightning.windows.config import AAHConfig
from helpers.modules import module_of

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "aah_lightning" / "checkpoint.py"

# Strings equal to a key that are not checkpoint keys where they appear: (file, string) -> why.
NOT_KEYS = {
    ("aah_lightning/lit/guards.py", "global_step"): "a field of the non-finite report (JSON), not of a checkpoint",
    ("aah_lightning/lit/guards.py", "epoch"): "a field of the non-finite report (JSON), not of a checkpoint",
    ("aah_lightning/__init__.py", "TextDataModule"): "the class's public name (Lightning names its state after it)",
}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A checkpoint of a real ``aah fit``: 2 steps, random windows (heads differ), tiny model on the synthetic task."""
    from helpers.cli import tiny_cli_args

    tmp = tmp_path_factory.mktemp("fitted")
    aah(
        tiny_cli_args(
            tmp,
            "--model.aah.policy=random",
            "--model.aah.candidates=[4,8,16,32]",
            "--diagnostics.amc_every_n_steps=0",
            "--trainer.val_check_interval=2",
            steps=2,
        )
    )
    return tmp / "ckpt" / "last.ckpt"


def flip_a_weight_byte(src: Path, dst: Path) -> str:
    """A copy of ``src`` with one byte of a weight flipped (torch.load would not notice); the entry's name."""
    shutil.copy(src, dst)
    with zipfile.ZipFile(dst) as z:
        entry = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 64)
    raw = bytearray(dst.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[entry.header_offset + 26 : entry.header_offset + 30])
    raw[entry.header_offset + 30 + name_len + extra_len + 10] ^= 0xFF  # the entry's bytes follow its local header
    dst.write_bytes(raw)
    return entry.filename


def test_read_checkpoint_returns_the_dict_with_aahs_keys(fitted):
    checkpoint = ck.read_checkpoint(fitted)
    assert {ck.STATE_DICT_KEY, ck.HYPER_PARAMETERS_KEY, ck.POLICY_KEY, ck.RNG_KEY, ck.WINDOW_USAGE_KEY} <= set(
        checkpoint
    )
    assert set(checkpoint) <= set(ck.KEYS)  # every key a fit writes is in the table
    assert ck.window_table(checkpoint).shape == (2, 4)


def test_read_checkpoint_refuses_a_corrupt_file_with_one_line(fitted, tmp_path):
    bad = tmp_path / "flipped.ckpt"
    entry = flip_a_weight_byte(fitted, bad)
    with pytest.raises(ConfigError) as error:
        ck.read_checkpoint(bad)
    message = str(error.value)
    assert "\n" not in message and str(bad) in message and "corrupt" in message and entry in message

    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(fitted.read_bytes()[:4000])
    with pytest.raises(ConfigError, match="truncated or not a PyTorch checkpoint") as error:
        ck.read_checkpoint(cut, setting="--ckpt_path")
    assert str(error.value).startswith(f"--ckpt_path={str(cut)!r} ")

    with pytest.raises(ConfigError, match="does not exist") as error:
        ck.read_checkpoint(tmp_path / "gone.ckpt")
    assert "gone.ckpt" in str(error.value) and "'last'" not in str(error.value)  # 'last' is for --ckpt_path only

    listed = tmp_path / "list.ckpt"
    torch.save([1, 2], listed)
    with pytest.raises(ConfigError, match="not a Lightning checkpoint"):
        ck.read_checkpoint(listed)


class Payload:
    """An object a weights-only load refuses to unpickle."""


def test_read_checkpoint_is_weights_only_unless_told(tmp_path):
    unsafe = tmp_path / "unsafe.ckpt"
    torch.save({"x": Payload()}, unsafe, pickle_module=pickle)
    with pytest.raises(ConfigError, match="could run arbitrary code"):
        ck.read_checkpoint(unsafe)
    assert isinstance(ck.read_checkpoint(unsafe, weights_only=False)["x"], Payload)


def test_load_model_round_trip(fitted):
    """The module Lightning saved, rebuilt by load_model: the same window table and the same logits."""
    checkpoint = torch.load(fitted, weights_only=True)
    module = module_of(checkpoint).eval()  # what Lightning trained, as generation rebuilt it before
    model, tokenizer = aah_lightning.load_model(fitted)
    assert tokenizer is None  # the synthetic task: token ids, no text
    assert not model.training and isinstance(model, aah_lightning.GPT)
    assert torch.equal(model.windows, checkpoint[ck.STATE_DICT_KEY][ck.WINDOWS_STATE_KEY])
    assert len(set(model.windows.flatten().tolist())) > 1  # the heads' windows differ
    assert model.cfg == module.gpt_config
    ids = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), module.model(ids))


def test_load_model_of_a_text_checkpoint_and_its_refusals(tmp_path):
    """A hand-made module saved as aah fit saves it (through Lightning's Trainer.save_checkpoint)."""
    import lightning as L

    torch.manual_seed(0)
    module = AAHModule(gpt=GPTConfig(n_layer=2, n_head=2, n_embd=16, seq_len=16, vocab_size=257))
    module.model.set_windows([[3, 16], [16, 5]])
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "hand.ckpt")
    model, tok = aah_lightning.load_model(tmp_path / "hand.ckpt")
    assert tok.name == "byte" and model.windows.tolist() == [[3, 16], [16, 5]]
    ids = torch.randint(0, 257, (1, 16))
    with torch.no_grad():
        assert torch.equal(model(ids), module.model.eval()(ids))

    checkpoint = torch.load(tmp_path / "hand.ckpt", weights_only=True)
    checkpoint[ck.HYPER_PARAMETERS_KEY]["gpt"]["n_embd"] = 32
    torch.save(checkpoint, tmp_path / "wider.ckpt")
    with pytest.raises(ConfigError, match="its weights do not match its hyperparameters"):
        aah_lightning.load_model(tmp_path / "wider.ckpt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.ckpt")
    with pytest.raises(ConfigError, match="not a checkpoint written by aah fit"):
        aah_lightning.load_model(tmp_path / "other.ckpt")


def test_the_keys_table_is_the_same_everywhere():
    table = ck.keys_table()
    assert table in ck.__doc__
    assert table in (ROOT / "docs" / "architecture.md").read_text()
    names = {n for n in dir(ck) if n.endswith("_KEY")} - {"WINDOWS_STATE_KEY"}
    assert {getattr(ck, n) for n in names} == set(ck.KEYS)  # a constant for every key in the table, and no other


def _spelled_keys(path: Path, keys: set[str]) -> list[tuple[int, str]]:
    """``(line, key)`` of string literals in ``path`` equal to a checkpoint key; attribute names (``hasattr(x,
    "state_dict")``) are not keys."""
    tree = ast.parse(path.read_text(), str(path))
    attribute_names = {
        id(node.args[1])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("hasattr", "getattr", "setattr")
        and len(node.args) > 1
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in keys and id(node) not in attribute_names
    ]


def test_no_key_is_spelled_out_outside_its_home():
    keys = set(ck.KEYS) | {ck.WINDOWS_STATE_KEY}
    files = sorted((ROOT / "aah_lightning").rglob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    assert HOME in files and len(files) > 50
    spelled = {
        (str(path.relative_to(ROOT)), line, key)
        for path in files
        if path != HOME
        for line, key in _spelled_keys(path, keys)
    }
    found = [f"{path}:{line}: {key!r}" for path, line, key in sorted(spelled) if (path, key) not in NOT_KEYS]
    assert not found, "checkpoint keys spelled out (use the constants of aah_lightning/checkpoint.py):\n" + "\n".join(
        found
    )
    assert set(NOT_KEYS) == {(path, key) for path, _, key in spelled}  # every exception is still needed


def test_the_package_exports_its_public_names_lazily():
    code = "import sys, aah_lightning; print(sorted(m for m in sys.modules if m.startswith('aah_lightning')))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['aah_lightning']"  # nothing else is imported until a name is used
    for name in aah_lightning.__all__:
        assert getattr(aah_lightning, name) is not None
    assert aah_lightning.read_checkpoint is ck.read_checkpoint and aah_lightning.load_model is ck.load_model


# -- a checkpoint of an earlier layout ---------------------------------------------------------------------------------
# ``aah fit`` at commit a3ccbc1, before the GPT's settings became one dataclass (model.gpt): its hyperparameters hold
# them flat (n_layer, ..., aah, optim). 4 steps of a 2 x 2-head, d = 8 model on the synthetic task (62 KB):
#   aah fit --trainer.max_steps=4 --trainer.val_check_interval=2 --trainer.limit_val_batches=1 --trainer.logger=false
#     --trainer.accelerator=cpu --trainer.devices=1 --checkpoint.every_n_train_steps=2 --best_checkpoint.save_top_k=0
#     --model.n_layer=2 --model.n_head=2 --model.n_embd=8 --model.rope_base=500.0 --model.mlp_ratio=2.0
#     --model.aah.policy=random --model.aah.candidates=[4,8,16] --model.aah.seed=3 --model.optim.warmup_steps=1
#     --data.source=synthetic --data.seq_len=16 --data.batch_size=2 --data.synthetic_documents=40
#     --data.synthetic_vocab=12
FORMAT_1 = Path(__file__).parent / "checkpoint_format1.ckpt"
FORMAT_1_TABLE = [[8, 16], [8, 4]]
# The settings it was trained with, as a command line of today.
FORMAT_1_SETTINGS = [
    "--model.gpt.n_layer=2",
    "--model.gpt.n_head=2",
    "--model.gpt.n_embd=8",
    "--model.gpt.rope_base=500.0",
    "--model.gpt.mlp_ratio=2.0",
    "--model.aah.policy=random",
    "--model.aah.candidates=[4,8,16]",
    "--model.aah.seed=3",
    "--model.optim.warmup_steps=1",
    "--data.source=synthetic",
    "--data.seq_len=16",
    "--data.batch_size=2",
    "--data.synthetic.documents=40",
    "--data.synthetic.vocab=12",
]


def _run_args(tmp_path, subcommand: str, *extra: str) -> list[str]:
    return [
        subcommand,
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}/root",
        f"--checkpoint.dirpath={tmp_path}/ckpt",
        "--checkpoint.every_n_train_steps=2",
        *FORMAT_1_SETTINGS,
        *extra,
    ]


def test_hyperparameters_of_every_layout_read_as_todays():
    flat = {"n_layer": 2, "seq_len": 16, "_instantiator": "x", "aah": {"policy": "full"}, "optim": {"lr": 0.1}}
    today = {"gpt": {"n_layer": 2, "seq_len": 16}, "aah": {"policy": "full"}, "optim": {"lr": 0.1}}
    assert ck.hyperparameters({ck.HYPER_PARAMETERS_KEY: flat}) == today
    saved = {**today, ck.HPARAMS_FORMAT_ENTRY: ck.HPARAMS_FORMAT}
    assert ck.upgrade_hyperparameters(saved) == saved and ck.hyperparameters({ck.HYPER_PARAMETERS_KEY: saved}) == today
    assert ck.gpt_settings({ck.HYPER_PARAMETERS_KEY: flat}) == {"n_layer": 2, "seq_len": 16}
    with pytest.raises(ConfigError, match="written by a newer aah"):
        ck.upgrade_hyperparameters({**today, ck.HPARAMS_FORMAT_ENTRY: ck.HPARAMS_FORMAT + 1})


def test_a_checkpoint_of_the_flat_layout_loads():
    model, tokenizer = aah_lightning.load_model(FORMAT_1)
    assert tokenizer is None and model.windows.tolist() == FORMAT_1_TABLE
    cfg = model.cfg
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.seq_len, cfg.vocab_size) == (2, 2, 8, 16, 13)
    assert (cfg.rope_base, cfg.mlp_ratio) == (500.0, 2.0)
    assert model.sink == 0  # written before model.aah.sink existed: no sink
    module = AAHModule.load_from_checkpoint(FORMAT_1)
    assert module.gpt_config == cfg and module.aah_config.candidates == [4, 8, 16]
    assert module.optim_config.warmup_steps == 1
    ids = torch.randint(0, 13, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), module.eval().model(ids))


def test_a_checkpoint_gives_every_gpt_built_from_it_its_sink():
    """model.aah.sink of the hyperparameters is the one home of the sink: build_model (load_model, the export,
    inspection) reads it there; AAHModule (resume, validate, predict) from the same settings."""
    checkpoint = ck.read_checkpoint(FORMAT_1)
    checkpoint[ck.HYPER_PARAMETERS_KEY]["aah"]["sink"] = 3
    assert ck.sink_setting(checkpoint) == 3 and ck.sink_setting(ck.read_checkpoint(FORMAT_1)) == 0
    model = ck.build_model(checkpoint)
    module = AAHModule(**ck.hyperparameters(checkpoint))
    assert model.sink == module.model.sink == 3
    module.model.load_state_dict(model.state_dict())
    ids = torch.randint(0, 13, (2, 16), generator=torch.Generator().manual_seed(0))
    without = ck.build_model(ck.read_checkpoint(FORMAT_1))
    with torch.no_grad():
        assert torch.equal(model(ids), module.eval().model(ids))
        assert not torch.allclose(model(ids), without(ids))  # the windows are below 16: the sink changes logits
    ck.check_matches(checkpoint, module)
    with pytest.raises(ConfigError, match=r"trained with model\.aah\.sink=0, but this run has model\.aah\.sink=3"):
        ck.check_matches(ck.read_checkpoint(FORMAT_1), module)


def test_a_checkpoint_of_the_flat_layout_resumes_and_validates(tmp_path, capsys):
    recorder = f"--trainer.callbacks+=helpers.resume.Recorder --trainer.callbacks.folder={tmp_path}/steps".split()
    aah(_run_args(tmp_path, "fit", f"--ckpt_path={FORMAT_1}", "--trainer.max_steps=6", *recorder))
    steps = [json.loads(line)["step"] for line in (tmp_path / "steps" / "rank0.jsonl").read_text().splitlines()]
    assert steps == [5, 6]  # the two optimizer steps after the checkpoint's 4 (counted once done)
    resumed = ck.read_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert resumed[ck.GLOBAL_STEP_KEY] == 6
    assert ck.window_table(resumed).tolist() == FORMAT_1_TABLE  # random windows: drawn once, restored
    # saved in today's layout, with the settings the checkpoint had
    assert resumed[ck.HYPER_PARAMETERS_KEY][ck.HPARAMS_FORMAT_ENTRY] == ck.HPARAMS_FORMAT
    before, after = ck.hyperparameters(ck.read_checkpoint(FORMAT_1)), ck.hyperparameters(resumed)
    # the resumed checkpoint holds every GPT and window-policy setting, those the old one predates at their defaults
    assert GPTConfig(**after.pop("gpt")) == GPTConfig(**before.pop("gpt"))
    assert AAHConfig(**after.pop("aah")) == AAHConfig(**before.pop("aah")) and after == before
    aah(_run_args(tmp_path, "validate", f"--ckpt_path={FORMAT_1}"))
    with pytest.raises(SystemExit) as exc:  # a checkpoint of another shape: the setting named, in one line
        aah(_run_args(tmp_path, "validate", f"--ckpt_path={FORMAT_1}", "--model.gpt.n_embd=16"))
    assert exc.value.code == 2
    assert "holds a model with model.gpt.n_embd=8, but this run builds model.gpt.n_embd=16" in capsys.readouterr().err


def test_a_checkpoint_of_the_flat_layout_exports(tmp_path):
    pytest.importorskip("transformers")
    from aah_lightning.export.exporter import export

    export(str(FORMAT_1), str(tmp_path / "export"))
    config = (tmp_path / "export" / "config.json").read_text()
    assert '"num_hidden_layers": 2' in config and '"rope_base": 500.0' in config
