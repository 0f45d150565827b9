"""Where the text comes from. Every source yields documents as Hugging Face ``datasets`` rows with a text column.

* ``stdlib``: the embedded default corpus - the Python standard library's own ``.py`` sources (its test suites
  excluded), present on every machine that runs this app, so the quickstart needs no network.
* ``files``: local ``.txt`` (one document per file), ``.jsonl``/``.json`` and ``.parquet`` (one per row).
* ``hub``: a Hugging Face hub dataset by name, streamed (or downloaded whole, to prepare a token folder).
"""

from __future__ import annotations

import glob
import os
import sysconfig

from aah_lightning.errors import ConfigError
from aah_lightning.inputs import first_line, first_non_utf8

_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def stdlib_files() -> list[str]:
    """Sorted paths of the standard library's Python sources, test suites excluded."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found)


def stdlib_corpus():
    """The embedded default corpus as a ``datasets.Dataset`` with columns ``text`` and ``name``."""
    import datasets

    root = sysconfig.get_paths()["stdlib"]
    texts, names = [], []
    for path in stdlib_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        names.append(os.path.relpath(path, root))
    if not texts:
        raise ConfigError(f"data.source='stdlib': no Python sources found under {root}")
    return datasets.Dataset.from_dict({"text": texts, "name": names})


_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def expand_paths(paths: list[str]) -> list[str]:
    """Expand globs; every pattern must match at least one readable file."""
    if not paths:
        raise ConfigError("data.files.paths is empty: data.source='files' needs at least one file or glob pattern")
    out = []
    for pattern in paths:
        matches = sorted(glob.glob(os.path.expanduser(pattern))) or [pattern]
        for path in matches:
            if not os.path.isfile(path):
                raise ConfigError(f"data.files.paths entry {path!r} does not exist or is not a file")
            if not os.access(path, os.R_OK):
                raise ConfigError(f"data.files.paths entry {path!r} is not readable (check its permissions)")
            out.append(path)
    return out


def file_corpus(paths: list[str], text_field: str = "text", cache_dir: str | None = None):
    """Local files through ``datasets.load_dataset``; all files must share one format."""
    import datasets

    files = expand_paths(paths)
    kinds = {_BUILDERS.get(os.path.splitext(p)[1].lower()) for p in files}
    if None in kinds or len(kinds) != 1:
        exts = sorted({os.path.splitext(p)[1] for p in files})
        raise ConfigError(
            f"data.files.paths have extensions {exts}: use one format per run, one of {sorted(_BUILDERS)}"
        )
    builder = kinds.pop()
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir, **kwargs)
    except Exception as e:
        if builder in ("text", "json"):  # the usual cause, which datasets reports without the file: say which, where
            for path in files:
                line = first_non_utf8(path, "data.files.paths entry")
                if line is not None:
                    raise ConfigError(line) from e
        raise ConfigError(
            f"data.files.paths could not be read as {builder}: {type(e).__name__}: {first_line(e)}"
        ) from e
    if text_field not in ds.column_names:
        raise ConfigError(
            f"data.files.text_field={text_field!r} is not a column of {files[0]}; columns are {ds.column_names}"
        )
    if text_field != "text":
        ds = ds.rename_column(text_field, "text")
    return ds


def hub_dataset(name: str, config: str | None, split: str, text_field: str = "text", cache_dir: str | None = None):
    """A hub dataset, downloaded into the datasets cache (for preparing a token folder)."""
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, cache_dir=cache_dir)
    except Exception as e:
        raise ConfigError(
            f"data.hub.name={name!r} (config {config!r}, split {split!r}) cannot be loaded: "
            f"{type(e).__name__}: {str(e)[:200]}. Check the name and network"
        ) from e
    if text_field not in ds.column_names:
        raise ConfigError(
            f"data.hub.text_field={text_field!r} is not a column of {name}; columns are {ds.column_names}"
        )
    return ds.rename_column(text_field, "text") if text_field != "text" else ds


def hub_corpus(name: str, config: str | None, split: str, text_field: str = "text"):
    """A hub dataset, streamed (nothing is downloaded ahead)."""
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
        first = next(iter(ds))
    except Exception as e:
        raise ConfigError(
            f"data.hub.name={name!r} (config {config!r}, split {split!r}) cannot be reached: "
            f"{type(e).__name__}: {str(e)[:200]}. Check the name and network, or use data.source='files' with a "
            f"local copy"
        ) from e
    if text_field not in first:
        raise ConfigError(f"data.hub.text_field={text_field!r} is not a field of {name}; fields are {sorted(first)}")
    return ds
