"""Window diagnostics: every tag reaches TensorBoard, values equal hand counts, AMC, group statistics."""

import io

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image

from aah_lightning.cli import main
from aah_lightning.lit import diagnostics
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.diagnostics import TableScalars, WindowDiagnostics
from aah_lightning.lit.module import AAHModule
from aah_lightning.model import masks
from aah_lightning.model.attention.flex import FlexPlan
from aah_lightning.model.attention.sdpa import CausalPlan, DensePlan
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.windows import metrics, plots
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.controller.adaptive import AdaptivePolicy
from aah_lightning.windows.groups import GroupTree
from aah_lightning.windows.policies import StaticPolicy
from aah_lightning.windows.policy_base import PolicyReport
from aah_lightning.windows.probe import ProbeResult, full_causal_probs, mass_within, run_probe
from helpers.tb import read_events

# T=32 with tiles of 8 (4 q-tiles, 10 causal tiles per head). Windows outside the default candidates (4, 8, 16, 32)
# on purpose: their fractions must be logged too.
STATIC = [[4, 8, 16, 32], [32, 2, 5, 1]]
T, TILE = 32, 8
# pairs(W, 32) = W(W+1)/2 + (32-W)W: 4 -> 122, 8 -> 228, 16 -> 392, 32 -> 528, 2 -> 63, 5 -> 150, 1 -> 32
PAIRS = [[122, 228, 392, 528], [528, 63, 150, 32]]
# non-empty tiles of 8 (tile (i, j) is used iff (i-j)*8 - 7 < W): W<=8 -> i-j<=1: 7 tiles; W=16 -> i-j<=2: 9;
# W=32 -> all 10; W=1 -> the diagonal only: 4
TILES = [[7, 7, 9, 10], [10, 7, 7, 4]]


def last(scalars, tag):
    return sorted(scalars[tag])[-1][1]


def test_fit_logs_every_diagnostic_tag(tmp_path, tiny_args):
    main(
        tiny_args(
            "--model.aah.policy=random",
            "--model.aah.candidates=[4,8,16,32]",
            "--model.aah.random.redraw_interval=3",
            "--diagnostics.amc_every_n_steps=2",
            "--diagnostics.visuals_min_interval=1",
            "--throughput.peak_flops=1e12",
            steps=6,
        )
    )
    events = read_events(tmp_path / "runs")
    scalars = events["scalars"]
    expected = [
        "aah/acr",
        "aah/causal_coverage",
        "aah/block_density",
        "aah/attention_mass_coverage",
        "aah/attention_mass_coverage/min_head",
        "aah/window_change_rate",
        "perf/tokens_per_sec",
        "perf/flops_per_sec",
        "perf/mfu",
    ]
    expected += [f"aah/window_fraction/{w}" for w in (4, 8, 16, 32)]
    expected += [
        f"{tag}/layer_{l}"
        for tag in ("aah/acr", "aah/causal_coverage", "aah/block_density", "aah/attention_mass_coverage")
        for l in (0, 1)
    ]
    for tag in expected:
        assert tag in scalars, tag
    for tag in ("aah/windows", "aah/windows/layer_0", "aah/windows/layer_1"):
        assert tag in events["histograms"], tag
    assert "aah/hierarchy/text_summary" in events["text"]
    # the random policy redraws before step 3, so the map is drawn twice: at the first log and after the change
    maps = events["images"]["aah/window_map"]
    assert [e.step for e in maps] == [1, 4]
    image = Image.open(io.BytesIO(maps[-1].encoded_image_string))
    assert image.size == plots.window_map_size(2, 4)
    # the change rate compares with the previous logged table: 0 between redraws, > 0 across one
    rates = dict(scalars["aah/window_change_rate"])
    assert rates[2] == 0.0 and rates[4] > 0.0
    # MFU is the FLOP rate over the peak the user set
    for (s1, flops), (s2, mfu) in zip(sorted(scalars["perf/flops_per_sec"]), sorted(scalars["perf/mfu"])):
        assert s1 == s2 and mfu == pytest.approx(flops / 1e12, rel=1e-5)
    # AMC is a share of probability mass
    assert all(0.0 < v <= 1.0 + 1e-6 for _, v in scalars["aah/attention_mass_coverage"])


def test_static_table_scalars_equal_hand_counts(tmp_path, tiny_args):
    main(
        tiny_args(
            "--model.aah.policy=static",
            f"--model.aah.static.table={STATIC}",
            f"--model.gpt.block_size={TILE}",
            "--diagnostics.amc_every_n_steps=0",
            "--trainer.val_check_interval=4",
            steps=4,
        )
    )
    scalars = read_events(tmp_path / "runs")["scalars"]
    assert last(scalars, "aah/acr") == pytest.approx((4 + 8 + 16 + 32 + 32 + 2 + 5 + 1) / 8 / 32)
    assert last(scalars, "aah/acr/layer_1") == pytest.approx((32 + 2 + 5 + 1) / 4 / 32)
    assert last(scalars, "aah/causal_coverage") == pytest.approx(sum(map(sum, PAIRS)) / (8 * 528))
    assert last(scalars, "aah/causal_coverage/layer_0") == pytest.approx(sum(PAIRS[0]) / (4 * 528))
    assert last(scalars, "aah/block_density") == pytest.approx(sum(map(sum, TILES)) / 80)
    assert last(scalars, "aah/block_density/layer_1") == pytest.approx(sum(TILES[1]) / 40)
    # every candidate and every other window of the table, summing to 1
    fractions = {w: last(scalars, f"aah/window_fraction/{w}") for w in (1, 2, 4, 5, 8, 16, 32)}
    assert fractions == {1: 1 / 8, 2: 1 / 8, 4: 1 / 8, 5: 1 / 8, 8: 1 / 8, 16: 1 / 8, 32: 2 / 8}
    assert [v for _, v in scalars["aah/window_change_rate"]] == [0.0, 0.0]  # logged at steps 2 and 4
    assert "aah/attention_mass_coverage" not in scalars  # switched off
    assert "aah/groups/level_0" not in scalars  # the static policy has no groups


def test_block_density_counts_the_blockmask_of_flex_plans():
    table = torch.tensor(STATIC)
    plans = [FlexPlan(tuple(row.tolist()), T, masks.window_block_mask(row.to(torch.int32), T, TILE)) for row in table]
    density, sources = metrics.plan_block_density(plans, table, T, TILE)
    assert sources == ["blockmask", "blockmask"]
    assert density == pytest.approx([sum(TILES[0]) / 40, sum(TILES[1]) / 40])
    # dense / causal plans have no BlockMask: the analytic count of the same row gives the same numbers
    density, sources = metrics.plan_block_density(
        [DensePlan(tuple(table[0].tolist()), T, None), CausalPlan(tuple(table[1].tolist()), T)], table, T, TILE
    )
    assert sources == ["analytic", "analytic"]
    assert density == pytest.approx([sum(TILES[0]) / 40, sum(TILES[1]) / 40])


def test_reading_the_plans_in_use_builds_nothing():
    module = AAHModule(
        gpt=GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=T, block_size=TILE, backend="sdpa"),
        aah=AAHConfig("static", static={"table": STATIC}),
    )
    module.model(torch.randint(0, 257, (2, T)))  # the training forward builds the plans
    builds = module.model.planner.builds
    values = TableScalars().values(module, torch.tensor(STATIC), T, module.policy.report())
    assert module.model.planner.builds == builds
    assert values["aah/block_density"] == pytest.approx(61 / 80)


def uniform_probe(seq_len, queries, n_head=2, n_layer=1):
    """q = 0: every query attends uniformly to the keys it may see."""
    q = torch.zeros(1, n_head, seq_len, 4)
    k = torch.randn(1, n_head, seq_len, 4)
    queries = torch.tensor(queries)
    probs = [full_causal_probs(q, k, queries) for _ in range(n_layer)]
    return ProbeResult(queries, [q] * n_layer, [k] * n_layer, [k] * n_layer, probs)


def test_amc_of_uniform_attention_has_a_closed_form():
    # uniform over i+1 keys: a window W keeps min(W, i+1) / (i+1) of query i's mass
    queries = [0, 3, 9, 15]
    amc = mass_within(uniform_probe(16, queries), torch.tensor([[4, 16]]))
    expected_w4 = np.mean([min(4, i + 1) / (i + 1) for i in queries])
    assert amc[0, 0].item() == pytest.approx(expected_w4, abs=1e-6)
    assert amc[0, 1].item() == pytest.approx(1.0, abs=1e-6)


def test_amc_matches_a_direct_float64_computation():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=24, n_layer=2, n_head=3, n_embd=24, backend="sdpa")
    model = GPT(cfg)
    table = torch.tensor([[1, 5, 24], [3, 12, 7]])
    model.set_windows(table)
    probe = run_probe(
        model, torch.randint(0, 32, (2, 24)), n_sequences=2, n_queries=8, generator=torch.Generator().manual_seed(1)
    )
    amc = mass_within(probe, table)
    for layer in range(2):
        q, k = probe.q[layer].double(), probe.k[layer].double()
        for h in range(3):
            shares = []
            for n in range(2):
                for i in probe.queries.tolist():
                    scores = torch.stack([q[n, h, i] @ k[n, h, j] / 8**0.5 for j in range(i + 1)])
                    p = torch.softmax(scores, 0)
                    shares.append(p[max(0, i - int(table[layer, h]) + 1) :].sum().item())
            assert amc[layer, h].item() == pytest.approx(np.mean(shares), abs=1e-5)
    # full windows keep all of the mass
    assert torch.allclose(mass_within(probe, torch.full((2, 3), 24)), torch.ones(2, 3, dtype=torch.float32), atol=1e-5)


def test_full_windows_log_amc_one(tmp_path, tiny_args):
    main(
        tiny_args(
            "--model.aah.policy=full", "--diagnostics.amc_every_n_steps=1", "--trainer.val_check_interval=2", steps=2
        )
    )
    values = [v for _, v in read_events(tmp_path / "runs")["scalars"]["aah/attention_mass_coverage"]]
    assert len(values) == 2 and values == pytest.approx([1.0, 1.0], abs=1e-5)


# -- the policy's hierarchy, as the adaptive controller exposes it ---------------------------------------------------
HIERARCHY = [
    [[[0, 1], [2], [3]], [[0, 1, 2], [3]], [[0, 1, 2, 3]]],  # layer 0: three levels, 3 -> 2 -> 1 groups
    [[[0, 1, 2, 3]]],  # layer 1: one group
]
GROUP_WINDOWS = [[[4, 8, 16], [8, 16], [16]], [[32]]]
GROUPED_TABLE = [[4, 4, 8, 16], [32, 32, 32, 32]]


TREES = [GroupTree(levels, windows) for levels, windows in zip(HIERARCHY, GROUP_WINDOWS)]


def test_group_stats_and_hierarchy_text():
    levels, counts = metrics.group_stats(TREES)
    assert levels == [3, 1] and counts == [[3, 2, 1], [1]]
    assert [TREES[0].group_of(h) for h in range(4)] == [0, 0, 1, 2]
    # layer 1 has no level 1 or 2: nothing merged further, so its single group counts there
    assert metrics.mean_group_counts(counts) == [2.0, 1.5, 1.0]
    text = metrics.hierarchy_text(torch.tensor(GROUPED_TABLE), TREES, 7)
    assert text.splitlines() == [
        "decision at step 7",
        "layer 0: 3 level(s), groups per level [3, 2, 1]",
        "  L2.g0 W=16 (4 heads)",
        "    L1.g0 W=8 (3 heads)",
        "      L0.g0 W=4: h0=4 h1=4",
        "      L0.g1 W=8: h2=8",
        "    L1.g1 W=16 (1 heads)",
        "      L0.g2 W=16: h3=16",
        "layer 1: 1 level(s), groups per level [1]",
        "  L0.g0 W=32: h0=32 h1=32 h2=32 h3=32",
    ]
    # a policy without groups: each layer's heads and windows
    assert (
        metrics.hierarchy_text(torch.tensor(GROUPED_TABLE), None).splitlines()[1]
        == "layer 1: h0=32  h1=32  h2=32  h3=32"
    )


def test_a_policy_without_groups_reports_none():
    report = StaticPolicy.report_from_state({}, [8, 16])
    assert report.trees is None and report.last_step is None and report.candidates == [8, 16]
    assert AdaptivePolicy.report_from_state({"hierarchies": [None, None], "last_step": -1}, [8]).trees is None


def test_group_counts_and_hierarchy_text_reach_tensorboard(tmp_path):
    dm = TextDataModule(source="synthetic", seq_len=T, batch_size=2, synthetic={"documents": 32})
    module = AAHModule(
        gpt=GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=T, vocab_size=dm.vocab_size, backend="sdpa"),
        aah=AAHConfig("static", static={"table": GROUPED_TABLE}),
    )
    decided = {"step": 0}
    module.policy.report = lambda: PolicyReport([4, 8, 16, 32], decided["step"], TREES)

    def decide(step, model, batch):  # a new decision at step 2 that keeps every window
        if step == 2:
            decided["step"] = step

    module.policy.on_train_step = decide
    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        logger=TensorBoardLogger(tmp_path, name="h"),
        callbacks=[WindowDiagnostics(every_n_steps=100, visuals_min_interval=1, amc_every_n_steps=0)],
    )
    trainer.fit(module, dm)
    events = read_events(tmp_path)
    scalars = events["scalars"]
    assert [s for s, _ in scalars["aah/acr"]] == [1]  # first step only: the table never changed
    assert last(scalars, "aah/levels_used") == 2.0
    assert last(scalars, "aah/levels_used/layer_0") == 3.0
    assert [last(scalars, f"aah/groups/level_{k}") for k in range(3)] == [2.0, 1.5, 1.0]
    assert last(scalars, "aah/groups/level_1/layer_0") == 2.0
    # the text follows the decision (made before step 2's batch, seen at its end: global step 3), not the log steps
    texts = events["text"]["aah/hierarchy/text_summary"]
    assert [t.step for t in texts] == [1, 3]
    first, second = (t.tensor_proto.string_val[0].decode() for t in texts)
    assert "decision at step 0" in first and "decision at step 2" in second
    assert "L0.g1 W=8: h2=8" in second


def test_window_map_refresh_is_rate_limited_but_never_lost(tmp_path):
    """A table that changes every step is drawn at most once per visuals_min_interval, and its last state is drawn."""
    dm = TextDataModule(source="synthetic", seq_len=T, batch_size=2, synthetic={"documents": 32})
    module = AAHModule(
        gpt=GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=T, vocab_size=dm.vocab_size, backend="sdpa"),
        aah=AAHConfig("random", candidates=[4, 8, 16, 32], random={"redraw_interval": 1}),
    )
    trainer = L.Trainer(
        max_steps=7,
        accelerator="cpu",
        devices=1,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        logger=TensorBoardLogger(tmp_path, name="r"),
        callbacks=[WindowDiagnostics(every_n_steps=100, visuals_min_interval=3, amc_every_n_steps=0)],
    )
    trainer.fit(module, dm)
    images = read_events(tmp_path)["images"]["aah/window_map"]
    assert [im.step for im in images] == [1, 4, 7]


def test_why_the_controller_chose_reaches_tensorboard(tmp_path, tiny_args):
    """Reach first with the gain signal: every head's window is a curve (the explorers' reach is visible from the
    first step and changes when formation ends), and every decision logs each head's need for every candidate."""
    main(
        tiny_args(
            "--model.aah.policy=adaptive",
            "--model.aah.candidates=[4,8,16,32]",
            "--model.aah.controller.need.signal=gain",
            "--model.aah.controller.reach.explorers=1",
            "--model.aah.controller.reach.formation_steps=4",
            "--model.aah.controller.schedule.warmup_steps=0",
            "--model.aah.controller.schedule.control_interval=2",
            "--model.aah.controller.budget.target_acr=0.3",
            "--model.aah.controller.budget.scope=model",
            "--model.aah.controller.budget.over_run=true",
            "--model.aah.controller.need.probe_queries=8",
            steps=8,
        )
    )
    scalars = read_events(tmp_path / "runs")["scalars"]
    explorer = dict(scalars["aah/head_window/layer_1/head_0"])
    assert explorer[min(explorer)] == 32.0  # the explorer holds the widest window from the start
    for layer in (0, 1):
        for head in range(4):
            assert f"aah/head_window/layer_{layer}/head_{head}" in scalars
            for w in (4, 8, 16, 32):
                need = scalars[f"aah/need/layer_{layer}/head_{head}/{w}"]
                assert sorted(s for s, _ in need) == [1, 3, 5, 7]  # the steps after each decision (0, 2, 4, 6)
    assert all(v == 0.0 for _, v in scalars["aah/need/layer_0/head_1/4"])  # gains are relative to the narrowest


def test_every_tag_a_diagnostic_writes_is_documented():
    """Each part of the window diagnostics names its tags (``tags``); docs/tensorboard.md documents every one, a
    ``/layer_<l>`` variant in the row of per-layer values."""
    import inspect
    import pathlib

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "tensorboard.md").read_text()
    per_layer_row = next(line for line in page.splitlines() if line.startswith("| `<tag>/layer_<l>`"))
    parts = [c for _, c in inspect.getmembers(diagnostics, inspect.isclass) if "tags" in vars(c)]
    assert len(parts) >= 6
    for part in parts:
        for tag in part.tags:
            base = tag.removesuffix("/layer_<l>")
            documented = f"`{tag}`" in page or (base != tag and f"`{base}`" in per_layer_row)
            assert documented, f"{part.__name__} writes {tag}, which docs/tensorboard.md does not document"
