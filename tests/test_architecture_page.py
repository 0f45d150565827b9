"""docs/architecture.md's module index and the package hold the same modules."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "aah_lightning"


def indexed_modules() -> set[str]:
    page = (ROOT / "docs" / "architecture.md").read_text()
    index = page.split("## Module index", 1)[1]
    return set(re.findall(r"^\| `([^`]+\.py)` \|", index, flags=re.M))


def package_modules() -> set[str]:
    return {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts
    }


def test_every_module_is_on_the_architecture_page():
    missing = sorted(package_modules() - indexed_modules())
    assert not missing, f"add these to the module index of docs/architecture.md: {missing}"


def test_the_architecture_page_names_no_module_that_is_gone():
    gone = sorted(indexed_modules() - package_modules())
    assert not gone, f"the module index of docs/architecture.md names modules that do not exist: {gone}"


def test_the_layer_table_is_the_layering_the_imports_test_enforces():
    from test_imports import LAYERS

    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page.split("| layer | parts |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[2] for line in table.strip().splitlines()[1:]]
    layers = [tuple(re.sub(r"\.py$|/$", "", name) for name in re.findall(r"`([\w]+(?:\.py|/))`", row)) for row in rows]
    assert layers == LAYERS


# Dotted settings (`budget.scope`, `recall.keys`) share their first word with module names, so only names that can
# only be code are checked: fully qualified ones (`aah_lightning.x.Y`), calls (`extras.need()`), and a module's
# classes and constants (`policy_base.BUILTIN_MODULES`). Paths (`windows/controller/reach.py`) must exist; a file
# the reader is asked to write (`my_signals.py`, `mykernel.py`) is an example, not a reference.
SETTING_ROOTS = {"model", "data", "trainer", "checkpoint", "best_checkpoint", "diagnostics", "throughput", "sample"}
FILE_SUFFIXES = {"json", "yaml", "ckpt", "md", "txt", "safetensors", "gguf", "py", "jsonl", "sbatch", "toml"}


def unresolved_names(text: str) -> tuple[list[str], int]:
    """The backticked module-qualified names and paths in ``text`` that name nothing, and how many were checked."""
    import importlib

    repo = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if ".venv" not in p.parts]
    modules: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        modules.setdefault(parts[-1], []).append(".".join(parts))

    def resolves(module: str, attributes: list[str]) -> bool:
        try:
            obj = importlib.import_module(module)
        except ImportError:
            return False
        for name in attributes:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True

    bad, checked = [], 0
    for token in sorted(set(re.findall(r"`([^`\s]+)`", text))):
        name = token.split("(")[0]
        if re.fullmatch(r"[\w./-]+\.py", name):
            if not name.split("/")[-1].startswith("my"):
                checked += 1
                if not any(path == name or path.endswith("/" + name) for path in repo):
                    bad.append(token)
            continue
        match = re.fullmatch(r"([a-z_]\w*)((?:\.[A-Za-z_]\w*)+)", name)
        if not match:
            continue
        first, rest = match.group(1), match.group(2)[1:].split(".")
        if first == "aah_lightning":
            parts = [first, *rest]
            for cut in range(len(parts), 0, -1):  # the longest prefix that is a module, the rest attributes
                if resolves(".".join(parts[:cut]), []):
                    break
            checked += 1
            if not resolves(".".join(parts[:cut]), parts[cut:]):
                bad.append(token)
            continue
        code_like = token.endswith("()") or rest[-1][0].isupper()
        if first in SETTING_ROOTS or first not in modules or rest[-1] in FILE_SUFFIXES or not code_like:
            continue
        checked += 1
        if not any(resolves(module, rest) for module in modules[first]):
            bad.append(token)
    return bad, checked


def test_every_module_qualified_name_in_the_docs_resolves():
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "tests" / "README.md"]
    bad, checked = {}, 0
    for page in pages:
        names, n = unresolved_names(page.read_text())
        checked += n
        if names:
            bad[str(page.relative_to(ROOT))] = names
    assert not bad, f"names in backticks that resolve to nothing: {bad}"
    assert checked > 200  # the docs name code (276 names today); a scan that finds none has broken


def test_the_name_check_catches_what_does_not_resolve():
    text = "`policy_base.BUILTIN_MODULES`, `extras.need()`, `policy_base.NO_SUCH`, `windows/gone.py`, `budget.scope`"
    assert unresolved_names(text) == (["policy_base.NO_SUCH", "windows/gone.py"], 4)
