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


def test_the_tool_runs_on_an_imported_model(tmp_path, capsys):
    """A tiny Llama through ``aah import``, then every row at ACR 0.25: the table, the files, each row at its budget
    and the random rows with the need row's count of long key/value heads."""
    folder = tmp_path / "hf"
    save_tiny("mistral", folder, max_position_embeddings=64)
    save_tokenizer(folder)
    from aah_lightning.export.importer import main as import_main

    assert import_main([str(folder), "--out", str(tmp_path / "m.ckpt")]) == 0
    words = random.Random(0).choices([f"w{i}" for i in range(62)], k=3000)
    (tmp_path / "text.txt").write_text(" ".join(words))
    out = tmp_path / "verdict"
    argv = [str(tmp_path / "m.ckpt"), "--text", str(tmp_path / "text.txt"), "--seq-len", "64", "--blocks", "2"]
    argv += ["--buckets", "20-30,30-40", "--per-bucket", "3", "--short", "12", "--random-draws", "2"]
    argv += ["--probes", "2", "--copy-span", "8", "--sink", "2", "--out", str(out)]
    assert run_tool("retrofit_eval", *argv) == 0
    report = json.loads((out / "verdict.json").read_text())
    rows = report["rows"]
    assert list(rows) == ["full", "fixed", "streaming", "need", "random_0", "random_1"]
    for name, row in rows.items():
        assert name == "full" or row["acr"] <= 0.25 + 1e-9
        assert len(row["correct"]) == 6 and len(row["losses"]) == 2
    assert rows["random_0"]["long"] == rows["need"]["long"] == rows["random_1"]["long"]
    md = (out / "verdict.md").read_text()
    assert "| need | streaming |" in md and "| need | random_1 |" in md
    assert "python tools/retrofit_eval.py" in capsys.readouterr().out
