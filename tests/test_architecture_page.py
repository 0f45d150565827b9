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
