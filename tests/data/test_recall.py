"""The recall task (data/recall.py): its sequences, its loss mask, its accuracy by distance, and mixing into text."""

import math

import numpy as np
import pytest
import torch

from aah_lightning.cli import main
from aah_lightning.data.recall import (
    CLASSES,
    RecallBlocks,
    recall_sequence,
    relay_circuit_possible,
    relay_placement_chance,
    relay_sequence,
)
from aah_lightning.errors import ConfigError
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.evaluation import RecallAccuracy
from aah_lightning.lit.module import _masked_mean
from helpers.tb import read_events

K, V, T = 32, 16, 256


def test_every_answer_is_the_value_bound_at_its_distance():
    for i in range(20):
        tokens, mask, dist = recall_sequence(np.random.default_rng(i), T + 1, K, V, "mix")
        targets = tokens[1:]
        assert len(tokens) == T + 1 and len(mask) == len(dist) == T
        assert ((tokens[:-1:3] < K) & (tokens[1::3][: len(tokens[:-1:3])] >= K)).all()  # slots k v k
        answers = np.flatnonzero(dist)
        assert len(answers) > 40  # dense: about 55 answers per sequence at T = 256
        for a in answers:
            d = dist[a]
            assert tokens[a] < K and tokens[a - d] == targets[a]  # the key's last value, d back
            assert tokens[a - d - 1] == tokens[a] and tokens[a - d + 1] == tokens[a]  # bound by this key, then echoed
            # nothing closer than d names this key's value: the window must reach d to see it
            assert not any(tokens[j] == tokens[a] and tokens[j + 1] == targets[a] for j in range(a - d + 1, a))
        # the loss counts the answers and the echoes (the token after each value), nothing else
        echo = np.zeros(T, dtype=bool)
        echo[1::3] = True
        assert (mask == ((dist > 0) | echo)).all()
        # a key names one value in the sequence
        pairs = {(tokens[j], tokens[j + 1]) for j in range(0, T, 3)}
        assert len({k for k, _ in pairs}) == len(pairs)


def test_sequences_are_deterministic_and_splits_differ():
    a = RecallBlocks(T, 10, K, V, seed=3)
    b = RecallBlocks(T, 10, K, V, seed=3)
    val = RecallBlocks(T, 10, K, V, seed=3, split="val")
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(10))
    assert not any(torch.equal(a[i]["tokens"], val[i]["tokens"]) for i in range(10))
    assert torch.equal(a[7]["tokens"], RecallBlocks(T, 10, K, V, seed=3)[7]["tokens"])  # read in any order
    shifted = RecallBlocks(T, 10, K, V, seed=3, offset=257)[2]
    assert torch.equal(shifted["tokens"], a[2]["tokens"] + 257) and torch.equal(shifted["loss_mask"], a[2]["loss_mask"])


def test_distances_reach_across_the_whole_context():
    ds = RecallBlocks(T, 100, K, V, gaps="mix")
    dist = torch.cat([ds[i]["recall_distance"] for i in range(100)])
    d = dist[dist > 0]
    assert (d <= 32).float().mean() > 0.4  # many short answers to learn from
    assert (d > 64).float().mean() > 0.25  # and many a window of T/4 cannot reach
    assert d.max() > 224


def test_masked_loss_is_the_mean_over_the_counted_targets():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, False, True], [False, False, True]])
    assert _masked_mean(losses, mask) == pytest.approx((1 + 3 + 6) / 3)
    assert _masked_mean(losses, None) == pytest.approx(3.5)


def test_recall_accuracy_by_distance_bucket_against_a_hand_count():
    metric = RecallAccuracy(seq_len=64)  # buckets of 8: 1-8, 9-16, ...
    targets = torch.tensor([[3, 1, 2, 0]])
    logits = torch.nn.functional.one_hot(torch.tensor([[3, 0, 2, 1]]), 5).float()  # right, wrong, right, wrong
    distance = torch.tensor([[5, 8, 9, 0]])  # the last target is no answer
    metric.update(logits, targets, distance)
    out = metric.compute()
    assert out["all"] == pytest.approx(2 / 3)
    assert out["1-8"] == pytest.approx(1 / 2) and out["9-16"] == pytest.approx(1.0)
    assert set(out) == {"all", "1-8", "9-16"}


def test_a_run_on_the_recall_task_logs_recall_accuracy_by_distance(tmp_path, tiny_args):
    main(
        tiny_args("--data.recall.keys=8", "--data.recall.values=4", "--data.val_blocks=4", source="recall", seq_len=64)
    )
    scalars = read_events(str(tmp_path / "runs"))["scalars"]
    acc = scalars["val/recall_acc"][-1][1]
    assert 0.0 <= acc <= 1.0
    buckets = [t for t in scalars if t.startswith("val/recall_acc_by_distance/")]
    assert "val/recall_acc_by_distance/1-8" in buckets and len(buckets) >= 4
    assert "val/bpb" not in scalars  # no text, no bytes


def test_recall_mixed_into_text_shares_blocks_and_grows_the_vocabulary(tmp_path):
    dm = TextDataModule(source="stdlib", seq_len=64, batch_size=4, recall={"fraction": 0.25}, max_documents=40)
    dm.setup("fit")
    assert dm.vocab_size == 257 + 32 + 16
    n_text, n_recall = len(dm.train_set.text), len(dm.train_set.recall)
    assert n_recall == round(n_text * 0.25 / 0.75)
    text, recall = dm.train_set[0], dm.train_set[n_text]
    assert text["loss_mask"].all() and not text["recall_distance"].any() and text["tokens"].max() < 257
    assert recall["tokens"].min() >= 257 and recall["recall_distance"].any()
    batch = next(iter(torch.utils.data.DataLoader(dm.train_set, batch_size=8, sampler=[0, n_text, 1, n_text + 1])))
    assert batch["tokens"].shape == (4, 65) and batch["loss_mask"].shape == (4, 64)


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"source": "recall", "recall": {"gaps": "far"}}, "data.recall.gaps='far' is not allowed"),
        ({"source": "recall", "recall": {"values": 1}}, "data.recall.values=1 is not allowed"),
        ({"source": "synthetic", "recall": {"fraction": 0.5}}, "data.recall.fraction=0.5 is not allowed"),
        ({"source": "stdlib", "recall": {"fraction": 1.0}}, "data.recall.fraction=1.0 is not allowed"),
        ({"source": "recall", "recall": {"task": "passkey"}}, "data.recall.task='passkey' is not allowed"),
        ({"source": "recall", "recall": {"copy_distance": 64}}, "data.recall.copy_distance=64 is not allowed"),
        ({"source": "recall", "recall": {"task": "relay", "relay_gap": 0}}, "data.recall.relay_gap=0 is not allowed"),
        ({"source": "recall", "recall": {"task": "relay", "relay_gap": 9}}, "data.recall.relay_gap=9 is not allowed"),
    ],
)
def test_bad_recall_settings_are_one_clear_error(settings, match):
    with pytest.raises(ConfigError, match=match):
        TextDataModule(seq_len=64, **settings)


def test_the_copy_task_answers_at_one_distance_only():
    """Every counted target repeats the token exactly ``distance`` back, and is an answer at that distance; the
    first ``distance`` targets do not count (nothing predicts them)."""
    dm = TextDataModule(source="recall", recall={"task": "copy", "copy_distance": 40}, seq_len=64, val_blocks=4)
    dm.setup("fit")
    for i in range(4):
        item = dm.val_set[i]
        tokens, mask, dist = item["tokens"], item["loss_mask"], item["recall_distance"]
        targets = torch.arange(1, 65)
        assert torch.equal(mask, targets >= 40)
        assert torch.equal(tokens[40:], tokens[:-40])  # the copies
        assert set(dist[mask].tolist()) == {40} and not dist[~mask].any()
    assert not torch.equal(dm.val_set[0]["tokens"][:40], dm.val_set[1]["tokens"][:40])  # fresh tokens per sequence
    default = TextDataModule(source="recall", recall={"task": "copy"}, seq_len=64, val_blocks=1)
    default.setup("fit")
    assert set(default.val_set[0]["recall_distance"].unique().tolist()) == {0, 40}  # 5/8 of T by default


def test_chance_is_one_over_the_values():
    # An untrained model guesses: its accuracy is near 1 / recall_values, far from a trained one's.
    torch.manual_seed(0)
    ds = RecallBlocks(64, 50, 8, 4)
    metric = RecallAccuracy(64)
    for i in range(50):
        item = ds[i]
        metric.update(torch.randn(1, 64, 13), item["tokens"][1:].unsqueeze(0), item["recall_distance"].unsqueeze(0))
    assert math.isclose(float(metric.compute()["all"]), 1 / 13, abs_tol=0.05)


def test_relay_answers_are_values_bound_gap_tokens_before_their_keys():
    """A relay binding is ``v f k c``; a bound key comes back at most once, as a query ``k v``; the loss counts the
    answers and the class after each bound key, nothing else; no token but the bound key and its query names a key."""
    gap, n_keys, n_values = 2, 64, 16
    filler, class0 = n_keys + n_values, n_keys + n_values + 1
    distances = []
    for i in range(20):
        tokens, mask, dist = relay_sequence(np.random.default_rng(i), T + 1, n_keys, n_values, gap)
        targets = tokens[1:]
        assert len(tokens) == T + 1 and len(mask) == len(dist) == T
        answers = np.flatnonzero(dist)
        assert len(answers) > 20  # about 30 queries per sequence at T = 256
        for a in answers:
            d, key = dist[a], tokens[a]
            assert key < n_keys and tokens[a - d] == key  # the query's key, bound d back
            value = tokens[a - d - gap]
            assert n_keys <= value < filler and targets[a] == value  # the value gap tokens before it
            assert (tokens[a - d - gap + 1 : a - d] == filler).all()  # gap - 1 fillers between
            assert targets[a - d] == class0 + (value - n_keys) % CLASSES  # the class after the bound key
        keys = tokens[:-1] < n_keys
        bound = keys & (tokens[1:] >= class0)  # a key followed by a class is a binding, by a value a query
        assert not (keys & ~bound & ~np.isin(np.arange(T), answers)).any()  # every other key is a query
        assert len(set(tokens[:-1][bound])) == bound.sum()  # each key bound once
        assert (mask == ((dist > 0) | bound)).all()
        distances += dist[answers].tolist()
    # answers near and far: short delays to learn from, long ones across the context
    assert min(distances) <= 4 and max(distances) > 200 and np.median(distances) < 100


def _carried(table, tokens_len, gap, queries):
    """Brute force: which positions each position has heard of before each layer (every head of a layer reads the
    positions its window covers), then whether some head can answer every query from a key that knows its value."""
    known = [{p} for p in range(tokens_len)]
    for row in table:
        for w in row:
            if all(p - d < w and (p - d - gap) in known[p - d] for p, d in queries):
                return True
        widest = max(row)
        known = [set().union(*known[max(0, p - widest + 1) : p + 1]) for p in range(tokens_len)]
    return False


def test_the_relay_circuit_needs_a_long_head_below_which_the_value_is_carried():
    """``relay_circuit_possible`` against a brute-force flow of information through the windows of random tables, on
    real relay sequences; then the exact chance of a random placement of the oracle's table (one head of the whole
    context in layer 3, windows of 2 elsewhere) is one in four: the long head must land in the last layer."""
    gap = 3
    tokens, _mask, dist = relay_sequence(np.random.default_rng(0), T + 1, 64, 16, gap, "uniform")
    queries = [(int(a), int(dist[a])) for a in np.flatnonzero(dist)]
    rng = np.random.default_rng(1)
    outcomes = set()
    for _ in range(60):
        table = rng.choice([2, 2, 2, 3, 4, 256], size=(4, 4)).tolist()
        possible = relay_circuit_possible(table, gap, reach=max(d for _, d in queries) + 1)
        assert possible == _carried(table, T, gap, queries), table
        outcomes.add(possible)
    assert outcomes == {True, False}
    oracle = [[2] * 4, [2] * 4, [2] * 4, [256, 2, 2, 2]]
    assert relay_circuit_possible(oracle, gap, T)
    for layer in range(3):
        moved = [[2] * 4 for _ in range(4)]
        moved[layer][0] = 256
        assert not relay_circuit_possible(moved, gap, T)
    assert relay_placement_chance(oracle, gap, T) == (0.25, 16)
    # the shipped rows (configs/relay): 3 layers, gap 2, the long head must land in layer 2
    shipped = [[2] * 4, [2] * 4, [256, 2, 2, 2]]
    assert relay_placement_chance(shipped, 2, T) == (pytest.approx(1 / 3), 12)
    # configs/relay_lean: one carrier of window 2 in each of layers 0 and 1, the rest window 1: the 256 in layer 2
    # (4 of 12 heads) and a 2 in each lower layer (32 of the 110 places of the two 2s): 64 of 660
    lean = [[2, 1, 1, 1], [2, 1, 1, 1], [256, 1, 1, 1]]
    assert relay_circuit_possible(lean, 2, T)
    assert not relay_circuit_possible([[2, 2, 1, 1], [1, 1, 1, 1], [256, 1, 1, 1]], 2, T)  # nothing carries in L1
    assert relay_placement_chance(lean, 2, T) == (pytest.approx(64 / 660), 660)
    # two long heads: only both in one layer of the first three fails (18 of the 120 placements)
    two = [[2] * 4, [2] * 4, [2] * 4, [256, 256, 2, 2]]
    assert relay_placement_chance(two, gap, T) == (1 - 18 / 120, 120)
