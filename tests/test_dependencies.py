"""What a plain ``pip install -e .`` lacks: every import of the package against pyproject.toml.

Each third-party import in aah_lightning/ (at module level and inside functions) must be installed by
``dependencies``, or be a package of ``aah_lightning.extras.EXTRAS`` that its extra installs and that is imported
only inside a function, through ``extras.need`` (one line naming the extra when it is missing). Subpackages that run
only with an extra (``EXTRA_ONLY_PACKAGES``) may import that extra's packages anywhere. CI also installs the package
bare and runs the quickstart and every command's --help in it (.ci/run).
"""

from __future__ import annotations

import ast
import functools
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from aah_lightning import extras
from aah_lightning.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NAME = canonicalize_name(PROJECT["name"])


def requirement_names(requirements: list[str]) -> set[str]:
    """The distributions that ``requirements`` install directly, an extra of this project (``aah-lightning[hf]``)
    expanded into its own."""
    names = set()
    for line in requirements:
        req = Requirement(line)
        if canonicalize_name(req.name) == NAME:
            for extra in req.extras:
                names |= requirement_names(PROJECT["optional-dependencies"][extra])
        else:
            names.add(canonicalize_name(req.name))
    return names


BASE = requirement_names(PROJECT["dependencies"])
EXTRA = {extra: requirement_names(reqs) for extra, reqs in PROJECT["optional-dependencies"].items()}


def third_party_imports(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, top-level name, at module level)`` of every import of another distribution in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    module_level = {id(node) for node in tree.body}
    for node in tree.body:  # an import under a module-level if / try still runs on import
        if isinstance(node, (ast.If, ast.Try)):
            module_level |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in ("aah_lightning", "__future__"):
                found.append((node.lineno, top, id(node) in module_level))
    return found


def extra_only(path: Path) -> str | None:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return next((extra for pkg, extra in extras.EXTRA_ONLY_PACKAGES.items() if module.startswith(pkg)), None)


@functools.cache
def installed() -> dict[str, list[str]]:
    return packages_distributions()  # reads every installed distribution's metadata: once


def distribution_of(top: str) -> str | None:
    if top in extras.EXTRAS:
        return canonicalize_name(extras.EXTRAS[top][0])
    dists = installed().get(top)
    return canonicalize_name(dists[0]) if dists else None


def test_every_import_is_installed_by_dependencies_or_its_documented_extra():
    problems = []
    files = sorted((ROOT / "aah_lightning").rglob("*.py"))
    assert len(files) > 50
    for path in files:
        where = path.relative_to(ROOT)
        only = extra_only(path)
        for line, top, module_level in third_party_imports(path):
            dist = distribution_of(top)
            if dist is None:
                problems.append(f"{where}:{line}: imports {top}, which no installed distribution provides")
            elif dist in BASE:
                continue
            elif only is not None:
                if dist not in EXTRA[only]:
                    problems.append(f"{where}:{line}: {dist} is in neither dependencies nor the '{only}' extra")
            elif top not in extras.EXTRAS:
                problems.append(
                    f"{where}:{line}: imports {top} ({dist}), which a plain install lacks: add it to dependencies, "
                    "or to an extra and aah_lightning.extras.EXTRAS"
                )
            elif module_level:
                problems.append(f"{where}:{line}: the '{extras.EXTRAS[top][1]}' extra's {top} at module level")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("top", sorted(extras.EXTRAS))
def test_each_extra_package_is_installed_by_the_extra_it_names(top):
    dist, extra = extras.EXTRAS[top]
    assert canonicalize_name(dist) in EXTRA[extra], f"the '{extra}' extra does not install {dist}"
    assert canonicalize_name(dist) not in BASE  # else it is not optional


def test_the_checks_catch_a_missing_dependency(tmp_path):
    # The scan itself: an undeclared package at module level, an extra's package at module level, a lazy one.
    (tmp_path / "m.py").write_text("import yaml\nimport wandb\n\ndef f():\n    import tokenizers\n")
    assert third_party_imports(tmp_path / "m.py") == [(1, "yaml", True), (2, "wandb", True), (5, "tokenizers", False)]
    assert "scipy" not in BASE and canonicalize_name("rich") in BASE and "transformers" in EXTRA["eval"]


def block(monkeypatch, package: str) -> None:
    """Imports of ``package`` and of its submodules raise ImportError, as on a machine without it."""
    for name in [n for n in sys.modules if n.split(".")[0] == package] + [package]:
        monkeypatch.setitem(sys.modules, name, None)


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    block(monkeypatch, "safetensors")
    with pytest.raises(ConfigError) as e:
        extras.need("safetensors.torch", "aah import")
    assert str(e.value) == "aah import needs the 'hf' extra (safetensors is missing): pip install 'aah-lightning[hf]'"


@pytest.mark.parametrize("missing", ["transformers", "safetensors", "tokenizers"])
def test_aah_export_without_the_hf_extra_says_so(monkeypatch, tmp_path, capsys, missing):
    from aah_lightning.export.exporter import main

    block(monkeypatch, missing)
    assert main(["--ckpt_path", str(tmp_path / "any.ckpt"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert f"needs the 'hf' extra ({missing} is missing): pip install 'aah-lightning[hf]'" in err
    assert not (tmp_path / "out").exists()


def test_aah_import_without_safetensors_says_so(monkeypatch, tmp_path, capsys):
    from aah_lightning.export.importer import main
    from helpers.hf_models import save_tiny, save_tokenizer

    folder = tmp_path / "hf"
    save_tiny("mistral", folder)
    save_tokenizer(folder)
    capsys.readouterr()  # transformers' progress bar while saving
    block(monkeypatch, "safetensors")
    assert main([str(folder), "--out", str(tmp_path / "x.ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs the 'hf' extra (safetensors is missing)" in err and "\n" not in err
    assert not (tmp_path / "x.ckpt").exists()


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
def test_aah_import_of_a_gguf_file_without_the_gguf_extra_says_so(monkeypatch, tmp_path, capsys, missing):
    from aah_lightning.export.importer import main
    from helpers.gguf_models import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    block(monkeypatch, missing)
    assert main([str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "out" / "x.ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.endswith(f"needs the 'gguf' extra ({missing} is missing): pip install 'aah-lightning[gguf]'"), err
    assert not (tmp_path / "out").exists()


def test_the_gguf_extra_installs_everything_a_gguf_file_is_read_with():
    from aah_lightning.model import hf_import

    for module in hf_import.GGUF_PACKAGES:  # transformers and tokenizers through the 'hf' extra it names
        assert distribution_of(module) in EXTRA[hf_import.GGUF_EXTRA], module
    assert EXTRA[hf_import.GGUF_EXTRA] <= EXTRA["dev"]  # CI's install tests the import of a GGUF file


# -- the docs name the extra a command needs ----------------------------------------------------------------------------
# A command in a code block of the docs, and the extra it needs (the first pattern a line matches decides).
EXTRA_COMMANDS = [
    (r"aah import \S+\.gguf\b", "gguf"),
    (r"(aah import|python -m aah_lightning\.hf_checkpoint)\b", "hf"),
    (r"aah export\b", "hf"),
    (r"(\w+=\S+ )*lm_eval\b", "eval"),
]
# What names an extra: pip's ".[hf]" / 'aah-lightning[hf]', or "the `hf` extra"; an extra that brings another
# (gguf and eval bring hf) names it too.
BRINGS = {"hf": {"hf", "gguf", "eval"}, "gguf": {"gguf"}, "eval": {"eval"}}


def sections_needing_an_unnamed_extra(text: str) -> list[tuple[str, list[str]]]:
    """``(heading, extras)`` of every ``##`` section of a Markdown page whose code blocks run a command that needs an
    extra which neither the section nor the top of the page (before its first ``##``) names."""
    import re

    named = re.compile(r"\[(hf|gguf|eval)\]|`(hf|gguf|eval)` extra")
    commands = [(re.compile(rf"^\s*(\$ )?{pattern}"), extra) for pattern, extra in EXTRA_COMMANDS]
    top, *sections = re.split(r"(?m)^(?=## )", text)
    on_top = {a or b for a, b in named.findall(top)}
    missing = []
    for section in sections:
        said = on_top | {a or b for a, b in named.findall(section)}
        needed = set()
        for block in re.findall(r"```[^\n]*\n(.*?)```", section, re.S):
            for line in block.splitlines():
                needed |= {next((extra for rx, extra in commands if rx.search(line)), None)} - {None}
        unnamed = sorted(extra for extra in needed if not BRINGS[extra] & said)
        if unnamed:
            missing.append((section.splitlines()[0], unnamed))
    return missing


def test_every_section_that_runs_a_command_of_an_extra_names_the_extra():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = {
        str(p.relative_to(ROOT)): found for p in pages if (found := sections_needing_an_unnamed_extra(p.read_text()))
    }
    assert not missing, f"sections whose commands need an extra they do not name (pip install -e '.[extra]'): {missing}"


def test_the_extras_check_finds_a_command_without_its_extra():
    page = "# Page\n\n## Import\n\n```bash\naah import model.gguf --out m.ckpt\n```\n\n## Eval\n\nThe `eval` extra.\n\n```\nlm_eval --model hf\n```\n"
    assert sections_needing_an_unnamed_extra(page) == [("## Import", ["gguf"])]
    assert sections_needing_an_unnamed_extra(page.replace("# Page\n", '# Page\n\npip install -e ".[gguf]"\n')) == []
