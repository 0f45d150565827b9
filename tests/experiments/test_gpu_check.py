"""tools/gpu_check.py's dry run on CPU: the same code paths as on a GPU (forward-only parity, compiled blocks with
flex and changing windows, a compiled Lightning training run), so the GPU tool cannot rot unnoticed."""

import subprocess

import pytest

from helpers.cli import PYTHON, REPO, subprocess_env


@pytest.mark.heavy
def test_gpu_check_dry_run_on_cpu_passes_and_prints_one_table():
    out = subprocess.run(
        [PYTHON, "tools/gpu_check.py", "--device", "cpu"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = out.stdout.split("\ncheck ", 1)[1]
    for check in (
        "attention parity float32 out",
        "GPT parity logits",
        "compiled blocks (inference) vs sdpa",
        "new graphs after warm-up",
        "graph breaks",
        "compiled training",
    ):
        assert check in table, check
    assert "FAIL" not in table and "checks passed" in table


def test_gpu_check_without_cuda_says_so():
    env = {**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine with one
    out = subprocess.run([PYTHON, "tools/gpu_check.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--device cpu" in out.stderr
