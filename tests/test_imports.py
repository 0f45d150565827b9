"""Every module of the package imports on its own: no import cycles, no module that works only after another one.

One subprocess imports the heavy third-party libraries once (torch, lightning, ...), checks that no module of the
package is loaded yet, and forks one child per module; each child starts from that clean state and imports only its
module. So every module is imported first, in a process where nothing of the package ran, at the cost of a fork.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


# The package's layers, lowest first: a module imports only from its own part or from a lower layer
# (docs/architecture.md). Parts in one layer do not import each other.
LAYERS = [
    ("errors",),
    ("inputs", "plugins", "extras", "atomic", "progress"),
    ("model", "data"),
    ("checkpoint",),
    ("model_source",),
    ("windows", "retrofit"),
    ("lit",),
    ("preflight", "export", "experiments", "benchmarks"),
    ("cli", "hf_checkpoint"),
    ("__main__",),
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def imported_parts(path: Path) -> list[tuple[int, str]]:
    """``(line, part)`` of every import of the package in ``path`` (also those inside functions); ``part`` is the
    first name under ``aah_lightning`` (``lit`` for ``aah_lightning.lit.module``), or the package itself (``""``,
    whose public names are re-exports of every layer)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "aah_lightning" else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "aah_lightning":
                part = parts[1] if len(parts) > 1 else ""
                if (
                    part
                    and not (ROOT / "aah_lightning" / part).is_dir()
                    and not (ROOT / "aah_lightning" / f"{part}.py").is_file()
                ):
                    part = ""  # a public name of the package, not a module
                found.append((node.lineno, part))
    return found


def test_no_module_imports_from_a_higher_layer():
    wrong = []
    for path in sorted((ROOT / "aah_lightning").rglob("*.py")):
        rel = path.relative_to(ROOT / "aah_lightning")
        if rel == Path("__init__.py"):  # the package's public names: lazy re-exports
            continue
        own = rel.parts[0].removesuffix(".py")
        assert own in RANK, f"aah_lightning/{rel}: {own} is in no layer of LAYERS"
        for line, part in imported_parts(path):
            if part == own:
                continue
            if part == "" or RANK[part] >= RANK[own]:
                wrong.append(f"aah_lightning/{rel}:{line} ({own}) imports {part or 'the package itself'}")
    assert not wrong, "imports from the same or a higher layer:\n" + "\n".join(wrong)


@pytest.mark.parametrize("module", ["policy_base.py", "config.py"])
def test_the_policy_contract_and_the_settings_import_no_policy(module):
    # windows/policy_base.py is what every policy builds on: it names the built-in policies' modules (to register
    # them on first use) but imports none of them, nor anything of the controller's. windows/config.py holds every
    # policy's settings as data: the checks that need a policy's internals (the controller's allocator registry)
    # run in that policy's validate.
    plugins = ("aah_lightning.windows.policies", "aah_lightning.windows.shuffle", "aah_lightning.windows.controller")
    import ast

    tree = ast.parse((ROOT / "aah_lightning" / "windows" / module).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported and not [m for m in imported if m.startswith(plugins)], imported


def module_graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports: at module level, inside functions and under
    ``TYPE_CHECKING`` alike (a deferred import still ties two modules together)."""
    import ast

    paths = {}
    for path in (ROOT / "aah_lightning").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in graph and t != name}
    return graph


def test_no_two_modules_import_each_other_even_lazily():
    graph = module_graph()
    assert "aah_lightning.windows.registry" in graph["aah_lightning.windows.config"]
    circles = []
    for start in sorted(graph):  # a path back to the start through the import edges is a circle
        seen, todo = set(), [(start, [start])]
        while todo:
            node, path = todo.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    circles.append(" -> ".join(path + [start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, path + [nxt]))
    assert not circles, "import circles:\n" + "\n".join(sorted(set(circles))[:10])
