"""Every module of the package imports on its own: no import cycles, no module that works only after another one.

One subprocess imports the heavy third-party libraries once (torch, lightning, ...), checks that no module of the
package is loaded yet, and forks one child per module; each child starts from that clean state and imports only its
module. So every module is imported first, in a process where nothing of the package ran, at the cost of a fork.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import importlib, multiprocessing as mp, sys, traceback
import torch, lightning, lightning.pytorch.cli, torchmetrics, datasets, matplotlib.pyplot, tensorboard  # shared, heavy
assert not [m for m in sys.modules if m.split(".")[0] == "aah_lightning"], "the package was imported before the fork"

def one(name):
    try:
        importlib.import_module(name)
        return name, ""
    except BaseException:
        return name, traceback.format_exc(limit=-4)

if __name__ == "__main__":
    names = sys.argv[1:]
    with mp.get_context("fork").Pool(2, maxtasksperchild=1) as pool:  # a fresh process for every module
        failed = [(n, err) for n, err in pool.map(one, names, chunksize=1) if err]
    for name, err in failed:
        print(f"--- import {name} failed:\n{err}")
    sys.exit(1 if failed else 0)
"""


def package_modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "aah_lightning").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":  # runs the CLI when imported: a script, not a module
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_imports_on_its_own():
    names = package_modules()
    assert "aah_lightning.windows.policy_base" in names and len(names) > 30
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, *names], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
