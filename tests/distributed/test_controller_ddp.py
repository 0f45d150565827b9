"""Rank consistency: under two-process DDP every rank ends every control step with the identical window table."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.heavy
@pytest.mark.parametrize("mechanism", ["mass", "reach_gain", "reach_gain_kept", "rewind_gain_kept"])
def test_two_ranks_hold_the_same_table_after_control_steps(tmp_path, mechanism):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("ddp_controller_run.py")), str(tmp_path), mechanism],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert ("calibrate-and-rewind at step 2" in run.stdout + run.stderr) == (mechanism == "rewind_gain_kept")
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert len(r0["tables"]) == len(r1["tables"]) == 12
    assert r0["batches"] != r1["batches"]  # the ranks saw different data ...
    for a, b in zip(r0["tables"], r1["tables"]):
        assert torch.equal(a, b)  # ... and still decided the same windows at every step
    assert len({str(t.tolist()) for t in r0["tables"]}) > 1  # and the windows did change
    for name in r0["params"]:  # DDP keeps them equal; after a rewind each rank restored its own copy of step 0's
        assert torch.equal(r0["params"][name], r1["params"][name]), name
    p0, p1 = r0["policy"], r1["policy"]
    assert p0["decisions"] == p1["decisions"] == 4  # steps 2, 5, 8, 11
    for key in p0:
        if isinstance(p0[key], torch.Tensor):
            assert torch.equal(p0[key], p1[key]), key
        else:
            assert p0[key] == p1[key], key
