"""Fixtures of the export tests: tiny aah checkpoints (hand-made or from a real ``aah fit``), their exports, and an
environment in which Hugging Face libraries never reach the network or the user's caches."""

from __future__ import annotations

import os

import pytest
import torch

from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig

CORPUS = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 0\n    y = 0\n\n    def norm(self):\n"
    "        return (self.x ** 2 + self.y ** 2) ** 0.5\n\n"
) * 30


@pytest.fixture(autouse=True)
def hf_offline(tmp_path_factory, monkeypatch):
    """No Hub, and caches (datasets, remote-code modules) in a folder of this test session."""
    home = tmp_path_factory.getbasetemp() / "hf_home"
    for name, value in {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(home),
        "HF_MODULES_CACHE": str(home / "modules"),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        monkeypatch.setenv(name, value)


def random_window_module(
    seed: int = 0,
    n_layer: int = 3,
    n_head: int = 4,
    n_embd: int = 32,
    seq_len: int = 64,
    table=None,
    noise=0.3,
    sink: int = 0,
) -> AAHModule:
    """A tiny byte-vocabulary model with a window table drawn per head from 1..seq_len+8 (or ``table``), and weights
    pushed away from their initialisation so that greedy text is varied (ties in argmax would prove nothing);
    ``sink``: its ``model.aah.sink``."""
    torch.manual_seed(seed)
    gpt = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, seq_len=seq_len, vocab_size=257)
    module = AAHModule(gpt=gpt, aah={"sink": sink})
    if table is None:
        g = torch.Generator().manual_seed(seed + 1)
        table = torch.randint(1, seq_len + 9, (n_layer, n_head), generator=g, dtype=torch.int32)
        table[0, 0], table[-1, -1] = 1, seq_len  # a head that sees only itself, one that sees everything
    module.model.set_windows(table)
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return module.eval()


def save_checkpoint(module: AAHModule, path, tokenizer: str = "byte", source: str = "stdlib") -> str:
    """A checkpoint file with what ``aah fit`` writes that export and tools/generate.py read."""
    torch.save(
        {
            "hyper_parameters": dict(module.hparams),
            "state_dict": module.state_dict(),
            "datamodule_hyper_parameters": {
                "tokenizer": tokenizer,
                "source": source,
                "seq_len": module.gpt_config.seq_len,
            },
            "global_step": 7,
        },
        path,
    )
    return str(path)


@pytest.fixture
def make_module():
    """``random_window_module`` as a fixture (test modules do not import conftest by name)."""
    return random_window_module


@pytest.fixture
def write_checkpoint():
    """``save_checkpoint`` as a fixture."""
    return save_checkpoint


@pytest.fixture
def exported(tmp_path):
    """``make(module, **kw)`` -> the folder of ``module`` exported through a checkpoint file."""
    from aah_lightning.export.exporter import export

    def make(module: AAHModule, name: str = "export", **kw) -> str:
        ckpt = save_checkpoint(module, tmp_path / f"{name}.ckpt", **kw)
        out = str(tmp_path / name)
        export(ckpt, out)
        return out

    return make


@pytest.fixture(scope="session")
def fitted_checkpoint(tmp_path_factory):
    """A real ``aah fit`` checkpoint: 4 steps of a 2-layer model on a small Python text file, byte tokenizer, T=64,
    random windows from {8, 16, 32, 64}."""
    from aah_lightning.cli import main

    root = tmp_path_factory.mktemp("fitted")
    corpus = root / "corpus.txt"
    corpus.write_text(CORPUS)
    main(
        [
            "fit",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.logger=false",
            f"--checkpoint.dirpath={root}/ckpts",
            "--model.gpt.n_layer=2",
            "--model.gpt.n_head=4",
            "--model.gpt.n_embd=32",
            "--model.aah.policy=random",
            "--model.aah.candidates=[8, 16, 32, 64]",
            "--data.source=files",
            f"--data.files.paths=[{corpus}]",
            "--data.seq_len=64",
            "--data.batch_size=4",
            "--sample.enabled=false",
        ]
    )
    path = os.path.join(root, "ckpts", "last.ckpt")
    assert os.path.isfile(path)
    return path
