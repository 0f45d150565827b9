"""tools/gpu_tune.py's code paths (aah_lightning/benchmarks/gpu_tune.py) on CPU (--smoke: tiny shapes, float32, CPU kernels); the numbers mean nothing."""

import json

import pytest

from aah_lightning.benchmarks import gpu_tune as tune
from helpers.cli import run_tool


@pytest.mark.heavy  # an end-to-end tool run (~15-30 s on a busy 2-core machine)
def test_gpu_tune_smoke_writes_one_report(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert run_tool("gpu_tune", "--smoke") == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "gpu_tune.json").read_text())
    assert results["smoke"] and not results["errors"] and not results["skipped"]
    # every registered CUDA plan is listed; those that cannot train on CPU say why
    reasons = {r["plan"]: r["unavailable"] for r in results["attention"] if "unavailable" in r}
    assert set(reasons) == {"flex", "flex_tuned", "varlen", "flex_fa4", "fa4_window"}
    assert "no backward" in reasons["flex"] and "CUDA only" in reasons["varlen"]
    timed = {(r["T"], r["plan"], r["kind"]) for r in results["attention"] if "ms" in r}
    for T in (128, 256):
        for plan in ("sdpa causal", "split", "banded"):
            assert {(T, plan, kind) for kind in ("fwd", "fwd+bwd", "bwd")} <= timed
    # Each plan's time against SDPA causal, the fastest causal kernel measured (SDPA here: flex has no CPU backward)
    # and its own tiling: tiles computed / causal tiles, from the plan's tile counts.
    for r in results["attention"]:
        if "ratio" in r:
            assert r["vs_fastest_causal"] == pytest.approx(r["ratio"])
            assert r["per_density"] == pytest.approx(r["ratio"] / r["realized_density"])
            assert 0 < r["realized_density"] <= 1
            assert r["plan"] != "sdpa causal" or r["realized_density"] == 1
    assert "/ fastest causal | tile density | / (SDPA causal x density)" in out
    assert sorted(r["plan"] for r in results["parity"]) == ["banded", "split"]
    assert all(r["passed"] for r in results["parity"])
    assert {r["variant"] for r in results["end_to_end"]} == {"full causal", "AAH, banded", "AAH, split"}
    assert all(r["same groups"] == 0 for r in results["recompiles"])
    targets = [t["target"] for t in results["targets"]]
    assert any(t.startswith("attention fwd+bwd") for t in targets) and any(t.startswith("end to end") for t in targets)
    assert "### targets" in out and "command: `python" in out


def test_gpu_tune_tuning_stage_code_path(monkeypatch):
    """The kernel_options stage runs flex candidates on CUDA only; here each candidate is a banded plan (CPU can
    train it) so that the stage's timing, parity and table code runs."""
    import argparse

    import torch

    from aah_lightning.model.attention import banded

    monkeypatch.setattr(tune, "candidate_plan", lambda options, block, row, T, device: banded.build_plan(row, T))
    args = argparse.Namespace(seq_lens=[64], batch=1, heads=4, head_dim=8, repeats=1, stage_estimate=0.0)
    run = tune.Run(budget=60)
    tune.tuning(run, args, torch.device("cpu"), torch.float32)
    assert [r["candidate"] for r in run.results["tuning"]] == list(tune.CANDIDATES)
    assert all(r["fwd+bwd"]["ratio"] > 0 for r in run.results["tuning"])
    assert all(r["passed"] for r in run.results["parity"])
    assert "kernel_options candidates" in tune.report({**run.results, "targets": []})


def test_verdicts_hold_auto_to_the_fastest_compiled_plan_and_use_the_targets():
    def e2e(T, plan, tokens_per_s):
        return {
            "T": T,
            "variant": f"AAH, {plan}, compiled blocks",
            "tokens_per_s": tokens_per_s,
            "vs_full_causal": tokens_per_s / 100.0,
        }

    results = {
        "attention": [{"T": 4096, "plan": "flex_tuned", "kind": "fwd+bwd", "ratio": 0.56}],
        "end_to_end": [
            e2e(4096, "flex_tuned", 120.0),
            e2e(4096, "flex_fa4", 130.0),
            e2e(16384, "flex_tuned", 140.0),
            {"T": 16384, "variant": "AAH, flex_fa4, compiled blocks", "unavailable": "not installed"},
        ],
        "auto": [{"T": 4096, "plan": "flex_tuned"}, {"T": 16384, "plan": "flex_tuned"}],
        "recompiles": [],
        "parity": [],
    }
    rows = {r["target"]: r for r in tune.verdicts(results, [4096, 16384])}
    slower = rows["auto (flex_tuned) trains as fast as the fastest plan measured, T=4096"]
    assert slower["best"] == "flex_fa4" and slower["measured"] == pytest.approx(120 / 130) and not slower["met"]
    assert rows["auto (flex_tuned) trains as fast as the fastest plan measured, T=16384"]["met"]
    assert not rows["attention fwd+bwd / SDPA causal <= 0.55, T=4096"]["met"]  # 0.56 misses 0.55
    assert rows["end to end tokens/s >= 1.15 x full causal, T=4096"]["met"]  # 1.30
    assert rows["end to end tokens/s >= 1.35 x full causal, T=16384"]["met"]  # 1.40
