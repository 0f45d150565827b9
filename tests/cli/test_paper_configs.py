"""Every row of configs/cpu and configs/paper loads with its base through the real CLI parser, and its policy makes
the window table the row describes. Paper-scale rows are only parsed and built at a small width (never trained)."""

import glob
import os
from dataclasses import asdict

import pytest
import torch
import yaml

from aah_lightning.cli import AAHCLI
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.module import AAHModule
from aah_lightning.windows.shuffle import ShufflePolicy
from helpers.controller_inputs import random_profiles, synthetic_features

FOLDERS = ("configs/cpu", "configs/paper")
REQUIRED = {
    "baseline",
    "fixed_w",
    "random_windows",
    "shuffle_post_select",
    "grouping_off",
    "full_adaptive",
    "shallow_freeze",
    "deep_practical_reuse",
    "fixed_random_grouping",
    "no_feature_ema",
    "no_parent_constraint",
    "control_interval_10",
    "static",
}
WARMUP = 100
# How each adaptive row's controller differs from full adaptive's (and nothing else may differ).
ADAPTIVE_DELTAS = {
    "full_adaptive": {},
    "shuffle_post_select": {},
    "grouping_off": {"groups.method": "none", "groups.depth": 1},
    "shallow_freeze": {"groups.depth": 1, "schedule.freeze_after": WARMUP},
    "deep_practical_reuse": {"groups.reuse_groups": True},
    "fixed_random_grouping": {"groups.method": "fixed_random"},
    "no_feature_ema": {"need.ema_alpha": 0.0},
    "no_parent_constraint": {"allocation.parent_constraint": False},
    "control_interval_10": {"schedule.control_interval": 10},
    "full_adaptive_paper_allocator": {"allocation.allocator": "paper"},
    "shallow_freeze_paper_allocator": {
        "allocation.allocator": "paper",
        "groups.depth": 1,
        "schedule.freeze_after": WARMUP,
    },
}


def dotted(controller) -> dict:
    """A controller's settings as ``{"block.name": value}``."""
    return {
        f"{block}.{k}": v
        for block, values in asdict(controller).items()
        if isinstance(values, dict)
        for k, v in values.items()
    }


def rows(folder):
    return sorted(os.path.basename(p)[:-5] for p in glob.glob(f"{folder}/*.yaml") if not p.endswith("base.yaml"))


def build(folder, row, tmp_path):
    """The CLI's parse of base + row, with its classes built (paper scale: 24 channels instead of 1536, on CPU)."""
    small = ["--model.gpt.n_embd=24", "--trainer.accelerator=cpu", "--trainer.precision=32-true"]
    args = [
        "--config",
        f"{folder}/base.yaml",
        "--config",
        f"{folder}/{row}.yaml",
        f"--trainer.logger.init_args.save_dir={tmp_path}/runs",
        f"--checkpoint.dirpath={tmp_path}/ckpt",
        *(small if folder == "configs/paper" else []),
    ]
    return AAHCLI(
        AAHModule, TextDataModule, run=False, args=args, seed_everything_default=1234, auto_configure_optimizers=False
    )


def test_both_scales_have_every_row_of_the_paper():
    assert REQUIRED <= set(rows("configs/cpu"))
    assert rows("configs/cpu") == rows("configs/paper")
    assert set(rows("configs/cpu")) == REQUIRED | {r for r in ADAPTIVE_DELTAS if r.endswith("_paper_allocator")}


def test_the_scales():
    with open("configs/paper/base.yaml") as f:
        paper = yaml.safe_load(f)
    with open("configs/cpu/base.yaml") as f:
        cpu = yaml.safe_load(f)
    m, ctl = paper["model"], paper["model"]["aah"]["controller"]
    gpt = m["gpt"]
    assert (gpt["n_layer"], gpt["n_head"], gpt["n_embd"], paper["data"]["seq_len"]) == (16, 12, 1536, 4096)
    assert m["aah"]["candidates"] == [512, 1024, 2048, 4096]
    assert (ctl["schedule"]["warmup_steps"], ctl["schedule"]["control_interval"]) == (WARMUP, 5)
    assert paper["trainer"]["precision"] == "bf16-mixed" and paper["trainer"]["accelerator"] == "gpu"
    assert cpu["data"]["seq_len"] >= 1024 and cpu["data"]["source"] == "stdlib" and paper["data"]["source"] == "stdlib"
    assert cpu["model"]["aah"]["controller"]["schedule"]["warmup_steps"] == WARMUP
    assert cpu["model"]["aah"]["candidates"][-1] == cpu["data"]["seq_len"]


def decide(policy, seed=0):
    """One decision of an adaptive (or shuffle) policy on constructed features: the table it returns."""
    inner = policy.inner if isinstance(policy, ShufflePolicy) else policy
    g = torch.Generator().manual_seed(seed)
    x = synthetic_features(
        inner,
        random_profiles(policy.n_layer, policy.n_head, len(policy.candidates), g),
        torch.rand(policy.n_layer, policy.n_head, 9, generator=g, dtype=torch.float64) + 0.5,
    )
    inner.measure = lambda model, tokens, doc_ids=None: x
    batch = {"tokens": torch.zeros(1, policy.seq_len + 1, dtype=torch.long)}
    step = inner.settings.schedule.warmup_steps
    table = policy.on_train_step(step, None, batch)
    assert inner.last_step == step
    return table if table is not None else policy.initial_table()


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_row_builds_and_its_policy_makes_the_table_it_describes(folder, tmp_path):
    with open(f"{folder}/base.yaml") as f:
        base = yaml.safe_load(f)
    seq_len = base["data"]["seq_len"]
    full = dotted(build(folder, "full_adaptive", tmp_path).model.aah_config.controller)
    for row in rows(folder):
        cli = build(folder, row, tmp_path)
        module, cfg = cli.model, cli.config
        policy, aah = module.policy, module.aah_config
        table = module.model.windows.clone()
        cands = policy.candidates
        assert cands == base["model"]["aah"]["candidates"], row
        with open(f"{folder}/{row}.yaml") as f:
            own = yaml.safe_load(f)
        # runs started by hand (without the suite) don't collide
        assert own["trainer"]["logger"]["init_args"]["name"] == row and row in own["checkpoint"]["dirpath"]
        assert cfg.trainer.logger.init_args.name == row
        assert table.shape == (base["model"]["gpt"]["n_layer"], base["model"]["gpt"]["n_head"])
        if row == "baseline":
            assert aah.policy == "full" and (table == seq_len).all()
        elif row == "fixed_w":
            assert aah.policy == "fixed" and (table == seq_len // 4).all()
        elif row == "static":
            with open(f"{folder}/static.yaml") as f:
                assert table.tolist() == yaml.safe_load(f)["model"]["aah"]["static"]["table"]
            assert set(table.flatten().tolist()) <= set(cands) and len(set(table.flatten().tolist())) == len(cands)
        elif row == "random_windows":
            assert aah.policy == "random" and set(table.flatten().tolist()) <= set(cands)
            assert aah.random.redraw_interval == full["schedule.control_interval"]
            redrawn = policy.on_train_step(aah.random.redraw_interval, None, None)
            assert redrawn is not None and set(redrawn.flatten().tolist()) <= set(cands)
        else:
            ctl = dotted(aah.controller)
            delta = {k: v for k, v in ctl.items() if full[k] != v}
            assert delta == ADAPTIVE_DELTAS[row], row
            assert (table == seq_len).all()  # warmup: full context until the first decision
            decided = decide(policy)
            assert set(decided.flatten().tolist()) <= set(cands)
            inner = policy.inner if isinstance(policy, ShufflePolicy) else policy
            if row == "shuffle_post_select":
                assert aah.policy == "shuffle"
                chosen = inner.table
                for layer in range(table.shape[0]):
                    assert sorted(decided[layer].tolist()) == sorted(chosen[layer].tolist())
                assert not torch.equal(decided, chosen)  # 12 or 4 heads per layer: some window moved
            else:
                assert aah.policy == "adaptive"
            if ctl["groups.method"] == "none":
                assert all(h.levels == [[[i] for i in range(policy.n_head)]] for h in inner.hierarchies)
            if ctl["schedule.freeze_after"] == WARMUP:  # shallow freeze: one decision, then never again
                assert inner.is_control_step(WARMUP) and not inner.is_control_step(
                    WARMUP + ctl["schedule.control_interval"]
                )
            assert max([h.levels_used for h in inner.hierarchies if h is not None], default=0) <= ctl["groups.depth"]
