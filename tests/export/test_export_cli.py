"""``aah export`` end to end on a real ``aah fit`` checkpoint, and every refusal: one line, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from aah_lightning.checkpoint import load_checkpoint_file
from aah_lightning.cli import main
from aah_lightning.model import generate as gen
from helpers.cli import run_tool
from helpers.modules import module_of

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "configuration_aah.py",
    "modeling_aah.py",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
}


class Payload:
    """An object a weights-only load refuses to unpickle."""


def run_export(args, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(["export", *args])
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def test_export_of_a_fitted_checkpoint(fitted_checkpoint, tmp_path, capsys):
    out = tmp_path / "hf"
    code, printed, err = run_export(["--ckpt_path", fitted_checkpoint, "--out", str(out)], capsys)
    assert code == 0, err
    assert printed.startswith(f"exported {fitted_checkpoint} -> {out}: 2 layers x 4 heads")
    assert set(os.listdir(out)) == EXPECTED_FILES
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".hf.partial")]  # the temporary folder is gone

    ckpt = load_checkpoint_file(fitted_checkpoint, weights_only=True)
    table = ckpt["state_dict"]["model.windows"]
    config = json.loads((out / "config.json").read_text())
    assert config["windows"] == table.tolist() and set(table.flatten().tolist()) <= {8, 16, 32, 64}
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_aah.AAHForCausalLM"
    assert (config["max_position_embeddings"], config["eos_token_id"], config["vocab_size"]) == (64, 256, 257)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:  # the output layer is the embedding
        assert "model.wte.weight" in f.keys() and not any("lm_head" in k or "windows" in k for k in f.keys())
    for name in ("modeling_aah.py", "configuration_aah.py"):  # self-contained: runs without aah
        assert "aah_lightning" not in (out / name).read_text()

    card = (out / "README.md").read_text()
    assert "- ACR (mean over heads of min(W, T) / T, T = 64): **" in card
    assert "causal coverage" in card and "trust_remote_code=True" in card and '"policy": "random"' in card
    assert "optimizer step 4" in card
    assert card.startswith("---\nlicense: apache-2.0\n")
    for section in ("## Training data", "## Metrics", "## Window table", "## Limitations", "## Load"):
        assert f"\n{section}\n" in card, section
    assert "- `data.source: files`" in card and "training tokens (4 optimizer steps)" in card
    assert re.search(r"- best `val/loss` during training: \*\*\d+\.\d{4}\*\*", card)
    assert "add_bos_token=False" in card and "aah's own generation keeps their last T tokens" in card

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.randint(0, 257, (2, 64))

    aah = module_of(ckpt).model.eval()
    with torch.no_grad():
        assert (model(ids).logits - aah(ids)).abs().max().item() <= 1e-5


def refused(args, capsys, tmp_path) -> str:
    before = sorted(os.listdir(tmp_path))
    code, printed, err = run_export(args, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and printed == "" and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("aah export: error: ")
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, not even a temporary folder
    return lines[0]


def test_refuses_what_cannot_be_exported(make_module, write_checkpoint, tmp_path, capsys):
    good = write_checkpoint(make_module(seed=0), tmp_path / "good.ckpt")
    out = str(tmp_path / "out")

    line = refused(["--ckpt_path", str(tmp_path / "missing.ckpt"), "--out", out], capsys, tmp_path)
    assert "missing.ckpt" in line and "does not exist" in line

    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(open(good, "rb").read()[:5000])
    line = refused(["--ckpt_path", str(truncated), "--out", out], capsys, tmp_path)
    assert "truncated or not a PyTorch checkpoint" in line

    unsafe = tmp_path / "unsafe.ckpt"
    torch.save({"hyper_parameters": {}, "state_dict": {}, "x": Payload()}, unsafe, pickle_module=pickle)
    line = refused(["--ckpt_path", str(unsafe), "--out", out], capsys, tmp_path)
    assert "could run arbitrary code" in line and "--weights_only false" in line

    other = tmp_path / "other.ckpt"
    torch.save({"weights": torch.zeros(3)}, other)
    line = refused(["--ckpt_path", str(other), "--out", out], capsys, tmp_path)
    assert "not a checkpoint written by aah fit" in line

    ckpt = torch.load(good, weights_only=True)
    ckpt["hyper_parameters"]["gpt"]["n_embd"] = 64  # weights of another shape than the hyperparameters say
    mismatched = tmp_path / "mismatched.ckpt"
    torch.save(ckpt, mismatched)
    line = refused(["--ckpt_path", str(mismatched), "--out", out], capsys, tmp_path)
    assert "do not match its hyperparameters" in line

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    line = refused(["--ckpt_path", good, "--out", str(busy)], capsys, tmp_path)
    assert "exists and is not empty" in line
    assert os.listdir(busy) == ["keep.txt"]

    line = refused(["--ckpt_path", good, "--out", str(busy / "keep.txt")], capsys, tmp_path)
    assert "is a file" in line

    line = refused(
        ["--ckpt_path", good, "--out", out, "--tokenizer", str(tmp_path / "no" / "tok.json")], capsys, tmp_path
    )
    assert "no such file or folder" in line


def test_an_empty_out_folder_is_used_and_parents_are_created(make_module, write_checkpoint, tmp_path, capsys):
    good = write_checkpoint(make_module(seed=0), tmp_path / "good.ckpt")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_export(["--ckpt_path", good, "--out", str(empty)], capsys)[0] == 0
    assert set(os.listdir(empty)) == EXPECTED_FILES
    nested = tmp_path / "a" / "b" / "c"
    assert run_export(["--ckpt_path", good, "--out", str(nested)], capsys)[0] == 0
    assert set(os.listdir(nested)) == EXPECTED_FILES
    shutil.rmtree(tmp_path / "a")


def test_an_export_onto_a_full_disk_leaves_nothing_not_even_its_folder(make_module, write_checkpoint, tmp_path, capsys):
    """On a real 64 KiB file system (the export's weights alone are larger): one line, and nothing left, not the
    temporary folder nor the folders made for --out."""
    from helpers.disks import small_disk

    good = write_checkpoint(make_module(seed=0), tmp_path / "good.ckpt")
    with small_disk(tmp_path / "disk", "64k") as disk:
        out = disk / "exports" / "tiny"
        line = refused(["--ckpt_path", good, "--out", str(out)], capsys, tmp_path)
        assert line.startswith(f"aah export: error: --out={str(out)!r} could not be written: no space left in "), line
        assert f"in {out.parent} (the export needs about 0.2 MiB, " in line
        assert line.endswith("nothing was left there: free space there or choose another --out")
        assert list(disk.iterdir()) == []


def test_the_folder_a_killed_export_left_is_removed_by_the_next(make_module, write_checkpoint, tmp_path, capsys):
    """A SIGKILL mid-write leaves the hidden temporary folder (the name never appears half-written); the next export
    beside it removes it once its writer is gone."""
    from aah_lightning.atomic import partial_name

    good = write_checkpoint(make_module(seed=0), tmp_path / "good.ckpt")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / "exports" / partial_name().replace(f"-{os.getpid()}-", f"-{int(dead.stdout)}-")
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"half")
    assert run_export(["--ckpt_path", good, "--out", str(tmp_path / "exports" / "tiny")], capsys)[0] == 0
    assert os.listdir(tmp_path / "exports") == ["tiny"]


def test_synthetic_checkpoint_exports_without_a_tokenizer(make_module, write_checkpoint, tmp_path, capsys):
    module = make_module(seed=5)
    ckpt = write_checkpoint(module, tmp_path / "syn.ckpt", source="synthetic")
    code, printed, _ = run_export(["--ckpt_path", ckpt, "--out", str(tmp_path / "syn")], capsys)
    assert code == 0 and "no tokenizer (synthetic data)" in printed
    assert not (tmp_path / "syn" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "syn" / "config.json").read_text())["eos_token_id"] == 256


def test_a_recall_checkpoint_has_no_text_tokenizer_anywhere(make_module, write_checkpoint, tmp_path, capsys):
    """One rule (checkpoint.has_text_tokenizer): a recall-task model reads token ids, as a synthetic one does, for
    the export, load_model (generation, inspection) and model.init_from alike."""
    from aah_lightning import checkpoint as ck
    from aah_lightning import retrofit

    ckpt = write_checkpoint(make_module(seed=5), tmp_path / "recall.ckpt", source="recall")
    assert not ck.has_text_tokenizer(ck.data_settings(ck.read_checkpoint(ckpt)))
    assert ck.load_model(ckpt)[1] is None
    assert retrofit.source_tokenizer(ckpt) is None and "data" not in retrofit.overlay(ckpt)
    code, printed, _ = run_export(["--ckpt_path", ckpt, "--out", str(tmp_path / "recall")], capsys)
    assert code == 0 and "no tokenizer (recall data)" in printed
    assert not (tmp_path / "recall" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "recall" / "config.json").read_text())["eos_token_id"] == 256


def test_compiled_block_names_and_the_tied_output_layer_are_mapped(make_module, write_checkpoint, tmp_path):
    from aah_lightning.export.exporter import model_state

    state = make_module(seed=6).state_dict()
    compiled = {k.replace("model.blocks.0.", "model.blocks.0._orig_mod."): v for k, v in state.items()}
    weights, windows = model_state(compiled)
    assert "model.blocks.0.attn.qkv.weight" in weights and not any("_orig_mod" in k for k in weights)
    assert "model.lm_head.weight" not in weights and torch.equal(windows, state["model.windows"])
    assert set(weights) == {k for k in state if k.startswith("model.")} - {"model.lm_head.weight", "model.windows"}


def test_a_hub_tokenizer_offline_names_the_option_given(fitted_checkpoint, tmp_path, capsys):
    code, _, err = run_export(
        ["--ckpt_path", fitted_checkpoint, "--out", str(tmp_path / "hf"), "--tokenizer", "aah-tests/no-such"], capsys
    )
    assert code == 2 and err.strip().splitlines() == [
        "aah export: error: --tokenizer='aah-tests/no-such' is not in the local Hugging Face cache and HF_HUB_OFFLINE "
        "is set: no file or folder 'aah-tests/no-such' exists either; pass a local tokenizer.json file or folder, or "
        "'byte'"
    ]
    assert not os.path.exists(tmp_path / "hf")


def test_out_below_a_file_is_refused_before_the_checkpoint_is_read(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    import aah_lightning.export.exporter as exporter

    monkeypatch.setattr(exporter, "prepare", lambda *a, **k: pytest.fail("the checkpoint was read"))
    code, _, err = run_export(["--ckpt_path", str(tmp_path / "any.ckpt"), "--out", str(a_file / "sub")], capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"aah export: error: --out={str(a_file / 'sub')!r} cannot be created: {a_file} is a file, not a folder"
    ]


def test_the_model_cards_snippet_runs_as_written(fitted_checkpoint, tmp_path, capsys):
    """Its code block, run as it stands in a fresh interpreter with no terminal to answer a prompt: it loads the
    folder, generates and prints (on the installed transformers)."""
    out = tmp_path / "hf"
    code, _, err = run_export(["--ckpt_path", fitted_checkpoint, "--out", str(out)], capsys)
    assert code == 0, err
    card = (out / "README.md").read_text()
    block = card.split("## Load\n\n```python\n", 1)[1].split("```", 1)[0]
    assert f"from_pretrained({str(out)!r}, trust_remote_code=True)" in block
    done = subprocess.run(
        [sys.executable, "-c", block], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("def fib(") and len(done.stdout) > len("def fib(") + 10


def test_the_card_states_a_decoding_benchmark_of_this_very_checkpoint(make_module, write_checkpoint, tmp_path, capsys):
    """``tools/bench_decode.py --checkpoint`` (its own windows and sink) writes a record that ``aah export --bench``
    puts in the model card; a record of another checkpoint, of a static table or of something else is refused in one
    line before anything is written."""
    table = torch.tensor([[4, 8, 64, 16], [64, 4, 4, 4], [8, 8, 2, 64]], dtype=torch.int32)
    ckpt = write_checkpoint(make_module(seed=1, table=table, sink=2), tmp_path / "win.ckpt")
    record = tmp_path / "bench.json"
    args = ["--checkpoint", ckpt, "--windows", "checkpoint", "--contexts", "96", "--batch", "1", "2"]
    args += ["--repeats", "1", "--new-tokens", "3", "--threads", "1", "--json", str(record)]
    assert run_tool("bench_decode", *args) == 0
    printed = capsys.readouterr().out
    assert "| 96 | 2 | export, windows |" in printed and "| 96 | 1 | aah, full |" in printed
    # the windowed runs' tokens are those of the model's own forward without a cache, in aah and in transformers
    assert "aah, windows: tokens == its own forward without a cache, T=96 | equal | met" in printed
    assert "export, windows: tokens == its own forward without a cache, T=96 | equal | met" in printed
    data = json.loads(record.read_text())
    assert data["windows"] == "checkpoint" and data["tables"]["96"]["table"] == table.tolist()
    rows = {(r["batch"], r["variant"]): r for r in data["results"]}
    ours, full = rows[2, "export, windows"], rows[2, "export, full"]
    # KV bytes: the export's window cache holds min(sink + W, 98) positions per head at T + new tokens - 1 = 98
    windows = table.tolist()
    assert ours["kv_bytes"] == gen.cache_bytes(windows, 98, 8, 2, sink=2) and full["kv_bytes"] == 3 * 4 * 98 * 8 * 8 * 2
    assert ours["vs_full"] == pytest.approx(ours["tokens_per_s"] / full["tokens_per_s"])

    out = tmp_path / "hf"
    code, _, err = run_export(["--ckpt_path", ckpt, "--out", str(out), "--bench", str(record)], capsys)
    assert code == 0, err
    card = (out / "README.md").read_text()
    section = card.split("## Measured decoding\n\n", 1)[1].split("\n## ", 1)[0]
    assert f"by `tools/bench_decode.py`, {data['date']}" in section and f"command: `{data['command']}`" in section
    assert (
        f"| 96 | 2 | {ours['tokens_per_s']:.1f} | {full['tokens_per_s']:.1f} | **{ours['vs_full']:.2f} x** |" in section
    )
    plain = tmp_path / "plain"  # without --bench, no such section
    assert run_export(["--ckpt_path", ckpt, "--out", str(plain)], capsys)[0] == 0
    assert "## Measured decoding" not in (plain / "README.md").read_text()

    other = write_checkpoint(make_module(seed=2, table=table, sink=2), tmp_path / "other.ckpt")
    line = refused(["--ckpt_path", other, "--out", str(tmp_path / "x"), "--bench", str(record)], capsys, tmp_path)
    assert "measured another checkpoint than --ckpt_path=" in line
    static = dict(data, windows="static")
    (tmp_path / "static.json").write_text(json.dumps(static))
    line = refused(["--ckpt_path", ckpt, "--out", str(tmp_path / "x"), "--bench", str(tmp_path / "static.json")],
                   capsys, tmp_path)  # fmt: skip
    assert "measured windows of its own (static), not the checkpoint's" in line
    (tmp_path / "junk.json").write_text('{"results": []}')
    line = refused(["--ckpt_path", ckpt, "--out", str(tmp_path / "x"), "--bench", str(tmp_path / "junk.json")],
                   capsys, tmp_path)  # fmt: skip
    assert "is not a record of tools/bench_decode.py" in line
