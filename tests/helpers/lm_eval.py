"""lm-evaluation-harness's own command line on an export folder with the shipped task, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

from aah_lightning.export import next_line_task


def run_lm_eval(folder, out, cwd, limit: int) -> subprocess.CompletedProcess:
    """``python -m lm_eval`` on ``folder`` (trust_remote_code) with ``aah_python_next_line`` on the CPU, samples and
    results written under ``out``; fails the test with lm-eval's output when it does not exit 0."""
    cmd = [
        sys.executable, "-m", "lm_eval",
        "--model", "hf",
        "--model_args", f"pretrained={folder},trust_remote_code=True",
        "--include_path", os.path.dirname(next_line_task.TASK_DIR),
        "--tasks", "aah_python_next_line",
        "--limit", str(limit),
        "--device", "cpu",
        "--batch_size", "16",
        "--log_samples",
        "--output_path", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=cwd, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
