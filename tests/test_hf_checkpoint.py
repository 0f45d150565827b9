"""``aah import`` (aah_lightning/export/importer.py; ``python -m aah_lightning.hf_checkpoint``): a Hugging Face
folder written as an aah checkpoint that every reader of checkpoints takes, with the folder's tokenizer."""

from __future__ import annotations

import pytest
import torch

from aah_lightning import checkpoint as ck
from aah_lightning.errors import ConfigError
from aah_lightning.export import importer
from aah_lightning.lit.module import AAHModule
from aah_lightning.model import generate as gen
from aah_lightning.model import hf_import
from helpers.hf_models import T, save_tiny, save_tokenizer


def test_an_imported_checkpoint_loads_with_its_tokenizer_and_generates(tmp_path, capsys):
    theirs = save_tiny("qwen3", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    assert importer.main([str(tmp_path / "hf"), "--out", str(tmp_path / "qwen3.ckpt")]) == 0
    assert "2 layers x 4 heads (2 key/value)" in capsys.readouterr().out
    model, tok = ck.load_model(tmp_path / "qwen3.ckpt")
    assert list(tok.encode("w3 w5")) == [3, 5] and tok.eos_id == 63
    tokens = torch.randint(64, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs(tokens).logits, rtol=1e-4, atol=1e-4)
    # greedy generation through the window KV cache is the argmax of the full forward, token by token
    out = gen.generate(model, [[1, 2, 3]], gen.GenerationConfig(max_new_tokens=5, temperature=0, stop_at_eod=False))
    row = [1, 2, 3]
    for t in out[0].tokens:
        with torch.no_grad():
            assert t == theirs(torch.tensor([row])).logits[0, -1].argmax().item()
        row.append(t)
    module = AAHModule(**ck.hyperparameters(ck.read_checkpoint(tmp_path / "qwen3.ckpt")))
    assert module.gpt_config == model.cfg  # the checkpoint's settings build the Lightning module too


def test_a_folder_without_a_tokenizer_is_refused_in_one_line(tmp_path, capsys):
    save_tiny("llama3", tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bar
    assert importer.main([str(tmp_path / "hf"), "--out", str(tmp_path / "x.ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("no tokenizer.json: pass --tokenizer (a tokenizer.json or hub name)") and "\n" not in err
    assert not (tmp_path / "x.ckpt").exists()
    with pytest.raises(ConfigError, match="unsupported family"):
        hf_import.family({"architectures": ["GPT2LMHeadModel"]})


def aah_import(args, capsys) -> tuple[int, str, str]:
    from aah_lightning.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["import", *args])
    out, err = capsys.readouterr()
    return done.value.code, out, err


def test_aah_import_writes_the_checkpoint_and_refuses_a_bad_folder_in_one_line(tmp_path, capsys):
    theirs = save_tiny("llama3", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    code, out, _ = aah_import([str(tmp_path / "hf"), "--out", str(tmp_path / "llama.ckpt")], capsys)
    assert code == 0 and "llama.ckpt: 2 layers x 4 heads (2 key/value), d = 32" in out
    model, _ = ck.load_model(tmp_path / "llama.ckpt")
    tokens = torch.randint(64, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs(tokens).logits, rtol=1e-4, atol=1e-4)

    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("x")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 32}')
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (corrupt / name).write_bytes((tmp_path / "hf" / name).read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"not safetensors")
    cases = {
        tmp_path / "missing": "does not exist: pass a Hugging Face model folder",
        tmp_path / "a_file": "is not a folder: pass a Hugging Face model folder",
        tmp_path / "empty": "no config.json: not a Hugging Face model folder",
        partial: "no num_attention_heads, num_hidden_layers, intermediate_size, vocab_size, max_position_embeddings",
        corrupt: "model.safetensors: not a readable safetensors file",
    }
    for folder, says in cases.items():
        code, _, err = aah_import([str(folder), "--out", str(tmp_path / "x.ckpt")], capsys)
        assert code == 2 and err.startswith("aah import: error: ") and says in err, err
        assert err.count("\n") == 1, err
    assert not (tmp_path / "x.ckpt").exists()
    code, _, err = aah_import([str(tmp_path / "hf"), "--out", str(tmp_path / "empty")], capsys)
    assert code == 2 and "is a folder: name the checkpoint file to write" in err


def test_aah_import_writes_through_the_atomic_writer(tmp_path, capsys, monkeypatch):
    """Every file aah import writes goes through atomic.atomic_torch_save: a kill leaves no half file."""
    save_tiny("qwen3", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    written = []
    real = importer.atomic_torch_save
    monkeypatch.setattr(importer, "atomic_torch_save", lambda obj, path: written.append(path) or real(obj, path))
    assert importer.main([str(tmp_path / "hf"), "--out", str(tmp_path / "q.ckpt")]) == 0
    assert written == [tmp_path / "q.ckpt"]


@pytest.mark.parametrize("module", ["aah_lightning.hf_checkpoint", "aah_lightning.export"])
def test_the_documented_module_entries_still_run(module):
    import os
    import subprocess
    import sys

    from helpers.cli import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO, env=env)
    assert done.returncode == 0 and "--out" in done.stdout, done.stderr


def test_a_tokenizer_with_more_ids_than_the_model_is_refused_before_anything_is_written(tmp_path, capsys):
    folder = tmp_path / "hf"
    save_tiny("llama3", folder)  # a vocabulary of 64
    (tmp_path / "big").mkdir()
    save_tokenizer(tmp_path / "big", vocab_size=65)
    capsys.readouterr()  # transformers' progress bar
    out = tmp_path / "out" / "x.ckpt"
    assert importer.main([str(folder), "--out", str(out), "--tokenizer", str(tmp_path / "big")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 65 ids, the checkpoint's model 64" in err[0], err
    assert not out.exists() and not (tmp_path / "out").exists()  # nothing written, not even the folder
