"""A real small file system for the full-disk tests: a tmpfs of a given size, mounted for the test (root or
CAP_SYS_ADMIN), or the test skips where the machine does not allow it."""

from __future__ import annotations

import contextlib
import subprocess

import pytest


@contextlib.contextmanager
def small_disk(folder, size: str):
    """``folder`` (created) as a tmpfs of ``size`` (``600k``) while the body runs."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
