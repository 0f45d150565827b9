"""The retrofit verdict (``experiments/retrofit_verdict.py``, ``tools/retrofit_eval.py``): its tables meet the budget,
its random control holds as many long key/value heads as the need table, its passkeys sit where they say, its exact
test is McNemar's, and the tool runs end to end on an imported model."""

import json
import random

import pytest
import torch
from scipy import stats as scipy_stats

from aah_lightning.experiments import retrofit_verdict as rv
from aah_lightning.windows import metrics
from helpers.cli import run_tool
from helpers.hf_models import save_tiny, save_tokenizer


def test_the_widest_window_meets_the_budget_and_one_more_token_would_not():
    for sink in (0, 4):
        w = rv.widest_window(256, 0.25, sink, 2, 3)
        assert float(metrics.acr(torch.full((2, 3), w), 256, sink)) <= 0.25
        assert float(metrics.acr(torch.full((2, 3), w + 1), 256, sink)) > 0.25


def test_random_tables_move_whole_key_value_groups_and_keep_their_count():
    need = torch.tensor([[64, 64, 8, 8, 8, 8], [8, 8, 8, 8, 64, 64], [8, 8, 64, 64, 8, 8]])
    draws = rv.random_tables(need, 3, 20, seed=1)
    placements = set()
    for t in draws:
        groups = t.view(3, 3, 2)
        assert torch.equal(groups[..., 0], groups[..., 1])  # the query heads of a key/value head share its window
        assert int((t == 64).sum()) == 6 and set(t.flatten().tolist()) == {8, 64}
        placements.add(tuple(t.flatten().tolist()))
    assert len(placements) > 5  # drawn, not fixed


def test_a_passkey_trial_holds_its_needle_at_its_distance():
    hay = list(range(1000, 4000))

    def encode(s):
        return [ord(c) for c in s]

    trials = rv.passkey_trials(hay, encode, [(100, 200), (300, 400)], 5, seed=3)
    assert [b for _, b, _ in trials] == [0] * 5 + [1] * 5
    for tokens, b, distance in trials:
        assert (100, 300)[b] <= distance < (200, 400)[b]
        question_at = len(tokens) - len(encode(rv.QUESTION.format(key="00000")))
        needle_at = question_at - distance
        text = "".join(chr(t) for t in tokens[needle_at:question_at] if t < 1000)
        key = "".join(chr(t) for t in tokens[-rv.DIGITS :])
        assert text == rv.NEEDLE.format(key=key)  # the needle, then held-out text up to the question


def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_trials():
    rng = random.Random(0)
    a = [rng.random() < 0.7 for _ in range(60)]
    b = [rng.random() < 0.4 for _ in range(60)]
    ab = sum(x and not y for x, y in zip(a, b))
    ba = sum(y and not x for x, y in zip(a, b))
    assert rv.mcnemar(a, b) == pytest.approx(scipy_stats.binomtest(ab, ab + ba).pvalue, rel=1e-9)
    assert rv.mcnemar([True, False], [True, False]) == 1.0


def imported_tiny(tmp_path):
    """A tiny Mistral through ``aah import`` (``m.ckpt``, context 64) and 3,000 words of text (``text.txt``)."""
    folder = tmp_path / "hf"
    save_tiny("mistral", folder, max_position_embeddings=64)
    save_tokenizer(folder)
    from aah_lightning.export.importer import main as import_main

    assert import_main([str(folder), "--out", str(tmp_path / "m.ckpt")]) == 0
    (tmp_path / "text.txt").write_text(" ".join(random.Random(0).choices([f"w{i}" for i in range(62)], k=3000)))


def test_the_tool_runs_on_an_imported_model(tmp_path, capsys):
    """A tiny Llama through ``aah import``, then every row at ACR 0.25: the table, the files, each row at its budget
    and the random rows with the need row's count of long key/value heads."""
    imported_tiny(tmp_path)
    out = tmp_path / "verdict"
    argv = [str(tmp_path / "m.ckpt"), "--text", str(tmp_path / "text.txt"), "--seq-len", "64", "--blocks", "2"]
    argv += ["--buckets", "20-30,30-40", "--per-bucket", "3", "--short", "12", "--random-draws", "2"]
    argv += ["--probes", "2", "--copy-span", "8", "--sink", "2", "--out", str(out)]
    (tmp_path / "tune.txt").write_text(" ".join(random.Random(1).choices([f"w{i}" for i in range(62)], k=600)))
    assert run_tool("retrofit_eval", *argv, "--finetune-steps", "-1") == 2
    assert "--finetune-steps must be 0 or more" in capsys.readouterr().err
    overlap = ["--finetune-steps", "2", "--finetune-text", str(tmp_path / "text.txt")]
    assert run_tool("retrofit_eval", *argv, *overlap) == 1
    assert "the held-out text must stay held out" in capsys.readouterr().err and not out.exists()
    argv += ["--finetune-steps", "3", "--finetune-lr", "1e-2", "--finetune-text", str(tmp_path / "tune.txt")]
    assert run_tool("retrofit_eval", *argv) == 0
    report = json.loads((out / "verdict.json").read_text())
    rows = report["rows"]
    names = ["full", "fixed", "streaming", "need", "random_0", "random_1"]
    assert list(rows) == names + [n + "+ft" for n in names]
    for name, row in rows.items():
        assert name.startswith("full") or row["acr"] <= 0.25 + 1e-9
        assert len(row["correct"]) == 6 and len(row["losses"]) == 2
    assert rows["random_0"]["long"] == rows["need"]["long"] == rows["random_1"]["long"]
    for name in names:  # each fine-tune ran under its row's own table, from the imported weights
        tuned = rows[name + "+ft"]
        assert tuned["table"] == rows[name]["table"] and len(tuned["finetune_losses"]) == 3
        assert tuned["losses"] != rows[name]["losses"]
    assert len({tuple(rows[n + "+ft"]["finetune_losses"][:1]) for n in ("full", "fixed")}) == 2
    md = (out / "verdict.md").read_text()
    assert "| need | streaming |" in md and "| need | random_1 |" in md and "| need+ft | streaming+ft |" in md
    assert "fine-tune: 3 steps" in md
    assert "python tools/retrofit_eval.py" in capsys.readouterr().out
    # A stopped run goes on: rows lost from the saved file are measured again, as they were; the others are kept.
    partial = out / "rows.partial.json"
    saved = json.loads(partial.read_text())
    assert list(saved["rows"]) == list(rows)
    for name in ("random_1", "need+ft", "random_1+ft"):
        del saved["rows"][name]
    partial.write_text(json.dumps(saved))
    assert run_tool("retrofit_eval", *argv) == 0
    assert "going on from" in capsys.readouterr().out
    again = json.loads((out / "verdict.json").read_text())["rows"]
    assert list(again) == list(rows)
    for name in rows:
        assert again[name]["correct"] == rows[name]["correct"], name
        assert again[name]["losses"] == pytest.approx(rows[name]["losses"], rel=1e-6), name
    assert again["need"]["wall_s"] == rows["need"]["wall_s"]  # kept, not measured again
    assert again["need+ft"]["wall_s"] != rows["need+ft"]["wall_s"]  # measured again
    before = partial.read_text()
    assert run_tool("retrofit_eval", *argv, "--per-bucket", "4") == 1
    assert "other settings (per_bucket)" in capsys.readouterr().err and partial.read_text() == before


def test_a_fine_tune_lowers_the_loss_it_trains_on_under_the_rows_table():
    """``fine_tune`` trains the whole model under its current windows and sink: the loss of a block it steps on falls,
    the windows and the sink are those it was given, and it leaves the model in eval mode."""
    from aah_lightning.model.config import GPTConfig
    from aah_lightning.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, n_layer=2, n_head=4, n_embd=32, seq_len=32)).eval()
    table = torch.tensor([[4, 32, 4, 4], [8, 8, 32, 8]], dtype=torch.int32)
    model.set_windows(table)
    model.sink = 2
    blocks = torch.randint(0, 32, (1, 33))
    before = rv.block_losses(model, blocks)[0]
    losses = rv.fine_tune(model, blocks, steps=30, lr=1e-2)
    assert len(losses) == 30 and losses[-1] < losses[0]
    assert rv.block_losses(model, blocks)[0] < before - 0.5
    assert not model.training and model.sink == 2 and torch.equal(model.windows.cpu(), table)


def test_fine_tuned_rows_are_compared_with_fine_tuned_rows():
    rng = random.Random(0)
    trial = [(10, 0, 5)] * 8

    def row(p):
        return {
            "losses": [rng.random() for _ in range(4)],
            "correct": [rng.random() < p for _ in range(8)],
            "trials": trial,
            "acr": 0.25,
            "long": 1,
        }

    names = ["full", "streaming", "need", "random_0"]
    rows = {n: row(0.5) for n in names} | {n + rv.FT: row(0.5) for n in names}
    md = rv.report(rows, [(0, 10)])
    pairs = {tuple(line.split(" | ")[:2]) for line in md.splitlines() if line.startswith("| need") and " vs " in line}
    assert pairs == {("| need", n) for n in ("full", "streaming", "random_0")} | {
        ("| need+ft", n + rv.FT) for n in ("full", "streaming", "random_0")
    }


def test_bf16_mixed_measures_under_autocast_and_says_so(tmp_path):
    """``--precision bf16-mixed`` runs every row's forwards under bfloat16 autocast: the losses move off the float32
    ones by bfloat16's rounding, not more, and the report's header states the precision."""
    imported_tiny(tmp_path)
    argv = [str(tmp_path / "m.ckpt"), "--text", str(tmp_path / "text.txt"), "--seq-len", "64", "--blocks", "2"]
    argv += ["--buckets", "20-30", "--per-bucket", "2", "--short", "12", "--random-draws", "1"]
    argv += ["--probes", "2", "--copy-span", "8", "--sink", "2"]
    losses = {}
    for precision in ("32-true", "bf16-mixed"):
        out = tmp_path / precision
        assert run_tool("retrofit_eval", *argv, "--precision", precision, "--out", str(out)) == 0
        losses[precision] = json.loads((out / "verdict.json").read_text())["rows"]["full"]["losses"]
        assert f"precision {precision}" in (out / "verdict.md").read_text()
    assert losses["32-true"] != losses["bf16-mixed"]
    assert losses["bf16-mixed"] == pytest.approx(losses["32-true"], rel=2e-2)


def test_the_passkey_head_scan_widens_and_narrows_one_key_value_head_at_a_time():
    """``passkey_head_scan``: each entry is the change of the digits' log-probability when one key/value head alone
    moves (checked against the table built by hand), and nothing moves when the narrow window already holds every
    trial."""
    from aah_lightning.model.config import GPTConfig
    from aah_lightning.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, seq_len=32)).eval()
    rng = random.Random(0)
    trials = [([rng.randrange(32) for _ in range(30)], 0, 20) for _ in range(3)]
    scan = rv.passkey_head_scan(model, trials, narrow=4, sink=1, seq_len=32)
    assert len(scan["gain"]) == 2 and len(scan["gain"][0]) == 2 and len(scan["loss"][1]) == 2
    table = torch.full((2, 4), 4, dtype=torch.int32)
    table[1, 2:] = 32  # layer 1, key/value head 1: its two query heads whole
    model.set_windows(table)
    assert scan["gain"][1][1] == pytest.approx(rv.answer_logprob(model, trials) - scan["base"], abs=1e-9)
    table = torch.full((2, 4), 32, dtype=torch.int32)
    table[0, :2] = 4
    model.set_windows(table)
    assert scan["loss"][0][0] == pytest.approx(scan["full"] - rv.answer_logprob(model, trials), abs=1e-9)
    assert any(abs(v) > 1e-4 for row in scan["gain"] + scan["loss"] for v in row)
    same = rv.passkey_head_scan(
        model, trials, narrow=31, sink=1, seq_len=32
    )  # 31 of 30 tokens: every window holds it all
    assert same["base"] == pytest.approx(same["full"], abs=1e-6)
    assert all(abs(v) < 1e-6 for row in same["gain"] + same["loss"] for v in row)


def test_the_passkey_heads_tool_runs_on_an_imported_model(tmp_path, capsys):
    imported_tiny(tmp_path)
    argv = [str(tmp_path / "m.ckpt"), "--text", str(tmp_path / "text.txt"), "--seq-len", "64", "--sink", "2"]
    argv += ["--narrow", "12", "--trials", "2", "--distances", "20-40", "--acr", "0.5", "--probes", "2"]
    argv += ["--copy-span", "8", "--out", str(tmp_path / "o")]
    assert run_tool("passkey_heads", *argv) == 0
    scan = json.loads((tmp_path / "o" / "heads.json").read_text())
    model_layers = len(scan["gain"])
    assert model_layers == len(scan["loss"]) and scan["retrieval_chosen"]  # ACR 0.5 buys at least one whole head
    assert "| layer, kv head |" in (tmp_path / "o" / "heads.md").read_text()
    assert run_tool("passkey_heads", *argv[:-1], str(tmp_path / "b"), "--precision", "bf16-mixed") == 0
    tilted = json.loads((tmp_path / "b" / "heads.json").read_text())
    assert "precision bf16-mixed" in (tmp_path / "b" / "heads.md").read_text()
    assert tilted["full"] != scan["full"] and tilted["full"] == pytest.approx(scan["full"], rel=0.05)
    assert run_tool("passkey_heads", *argv[:5], "--narrow", "64", "--out", str(tmp_path / "x")) == 1
    assert "--narrow must be in" in capsys.readouterr().err
