"""Tokenize a corpus once into a token folder (``token_folder.py``), with Hugging Face ``datasets``.

The documents are put in the seeded order training uses (``document_order``: the same as reading the corpus into
memory always did, so blocks and splits are unchanged), tokenized by ``Dataset.map(batched=True, num_proc=N)`` into
Arrow files on disk, and streamed from there into the folder, a batch at a time: memory stays bounded whatever the
corpus size. The data module calls ``cached_folder`` for ``stdlib`` and ``files`` (a folder per source and tokenizer
under the cache folder, prepared once); ``aah-prepare`` (``tools/prepare_data.py``) writes one where you say.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import time
import zlib

import numpy as np

from aah_lightning.data import corpora
from aah_lightning.data.config import DataConfig, nest_data_settings
from aah_lightning.data.token_folder import FolderWriter, is_token_folder, read_meta, token_dtype, verify
from aah_lightning.data.tokenizers import load_tokenizer
from aah_lightning.errors import ConfigError
from aah_lightning.inputs import read_yaml, writable_folder
from aah_lightning.progress import stage

CACHE_ENV = "AAH_CACHE_DIR"
SMALL_CORPUS = 64 << 20  # below this many bytes of text, extra tokenizer processes cost more than they save


def cache_root(cache_dir: str | None = None) -> str:
    """Where prepared token folders are kept: ``cache_dir``, else $AAH_CACHE_DIR, else ~/.cache/aah."""
    root = cache_dir or os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "aah")
    return os.path.join(root, "tokens")


def document_order(n: int, seed: int, max_documents: int | None = None) -> list[int]:
    """A seeded, content-independent document order: the split is the same on every machine and rank."""
    order = sorted(range(n), key=lambda i: zlib.crc32(f"{seed}:{i}".encode()))
    return order[:max_documents] if max_documents else order


def describe_source(
    source: str, paths=None, text_field="text", hub_name=None, hub_config=None, hub_split="train", repeat: int = 1
) -> dict:
    """What identifies the text: a changed file (size or time) or another Python gives another description."""
    if source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        stats = [(p, os.stat(p)) for p in corpora.stdlib_files()]
        listing = [(os.path.relpath(p, root), st.st_size, st.st_mtime_ns) for p, st in stats]
        desc = {
            "source": "stdlib",
            "python": platform.python_version(),
            "root": root,
            "files": hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16],
            "documents": len(listing),
        }
    elif source == "files":
        files = [os.path.abspath(p) for p in corpora.expand_paths(paths or [])]
        desc = {
            "source": "files",
            "text_field": text_field,
            "files": [[p, os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in files],
        }
    elif source == "hub":
        desc = {"source": "hub", "name": hub_name, "config": hub_config, "split": hub_split, "text_field": text_field}
    else:
        raise ConfigError(f"data.source={source!r} cannot be prepared: use stdlib, files or hub")
    if repeat != 1:
        desc["repeat"] = repeat
    return desc


def folder_key(description: dict, tokenizer, seed: int, max_documents: int | None) -> str:
    spec = {"source": description, "tokenizer": tokenizer.fingerprint, "seed": seed, "max_documents": max_documents}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def load_source(description: dict, cache_dir: str | None = None):
    """The described corpus as a map-style ``datasets.Dataset`` with a ``text`` column (hub datasets are downloaded);
    its ``repeat`` is applied by ``prepare``."""
    source = description["source"]
    if source == "stdlib":
        ds = corpora.stdlib_corpus()
    elif source == "files":
        ds = corpora.file_corpus([p for p, _, _ in description["files"]], description["text_field"], cache_dir)
    else:
        ds = corpora.hub_dataset(
            description["name"], description["config"], description["split"], description["text_field"], cache_dir
        )
    return ds.select_columns(["text"])


def _tokenize(batch, tokenizer, dtype: str):
    """``Dataset.map`` function on Arrow batches: token ids per document (no end-of-document id), per-token byte
    counts for Hugging Face tokenizers, and whether the document is kept (empty texts are dropped)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = pc.fill_null(batch.column("text").combine_chunks(), "")
    keep = pc.greater(pc.binary_length(text), 0)
    if tokenizer.name == "byte":  # the tokens are the UTF-8 bytes Arrow already stores: take them as they are
        width = np.int64 if pa.types.is_large_string(text.type) else np.int32
        offsets = np.frombuffer(text.buffers()[1], width)[text.offset : text.offset + len(text) + 1].astype(np.int64)
        data = np.frombuffer(text.buffers()[2], np.uint8) if text.buffers()[2] is not None else np.zeros(0, np.uint8)
        values = data[offsets[0] : offsets[-1]]  # kept as bytes here (the end-of-document id 256 is added later)
        ids = pa.LargeListArray.from_arrays(pa.array(offsets - offsets[0]), pa.array(values))
        return pa.table({"ids": ids, "keep": keep})
    encoded = tokenizer.encode_batch_with_bytes(text.to_pylist())
    ids = [np.zeros(0, dtype)] + [i for i, _ in encoded]
    nbytes = [np.zeros(0, np.int64)] + [b for _, b in encoded]
    offsets = pa.array(np.cumsum([len(i) for i in ids], dtype=np.int64))
    ids = pa.LargeListArray.from_arrays(offsets, pa.array(np.concatenate(ids).astype(dtype)))
    nbytes = np.minimum(np.concatenate(nbytes), 65535).astype(np.uint16)  # bytes.bin's cap, documented there
    return pa.table({"ids": ids, "nbytes": pa.LargeListArray.from_arrays(offsets, pa.array(nbytes)), "keep": keep})


def prepare(
    ds,
    tokenizer,
    out: str,
    meta: dict,
    seed: int,
    max_documents: int | None = None,
    num_proc: int | None = None,
    progress: bool = True,
    repeat: int = 1,
) -> str:
    """Tokenize ``ds`` (column ``text``), ``repeat`` times over, in the seeded order into the token folder ``out``;
    returns ``out``."""
    import datasets
    import pyarrow.compute as pc

    text_bytes = ds.data.nbytes * repeat
    if num_proc is None:
        num_proc = 1 if text_bytes < SMALL_CORPUS else min(4, os.cpu_count() or 1)
    in_memory = text_bytes < SMALL_CORPUS and num_proc == 1  # small: tokenized in memory (faster), else on disk
    dtype = token_dtype(tokenizer.vocab_size).name
    byte_level = tokenizer.name == "byte"
    writer = FolderWriter(out, tokenizer.vocab_size, tokenizer.eos_id, with_bytes=not byte_level)
    work = os.path.join(writer.tmp, "work")  # the Arrow files of this prepare: gone with it, whatever happens
    try:
        if num_proc > 1 and not ds.cache_files:  # in memory: workers would each get a pickled copy; map it from disk
            ds.save_to_disk(os.path.join(work, "source"))
            ds = datasets.load_from_disk(os.path.join(work, "source"))
        if repeat > 1:  # copies of a memory-mapped table share its file: nothing is held twice
            ds = datasets.concatenate_datasets([ds] * repeat)
        ds = ds.select(document_order(len(ds), seed, max_documents))
        tokens = ds.with_format("arrow").map(
            _tokenize,
            batched=True,
            batch_size=256,
            num_proc=num_proc if num_proc > 1 else None,
            fn_kwargs={"tokenizer": tokenizer, "dtype": dtype},
            remove_columns=ds.column_names,
            keep_in_memory=in_memory,
            cache_file_name=None if in_memory else os.path.join(work, "tokens.arrow"),
            desc=f"tokenizing ({tokenizer.name})",
        )
        with stage("writing token folder", total=len(tokens), unit="doc", after=None if progress else math.inf) as bar:
            for batch in _record_batches(tokens):
                ids = batch.column("ids")
                keep = batch.column("keep").to_numpy(zero_copy_only=False)
                lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)[keep]  # dropped ones have no tokens
                nbytes = None if byte_level else batch.column("nbytes").flatten().to_numpy()
                writer.add(ids.flatten().to_numpy(), lengths, nbytes)
                bar.advance(len(keep))
        del tokens, ds
        shutil.rmtree(work, ignore_errors=True)
        meta = {
            **meta,
            "tokenizer": {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint},
            "seed": seed,
            "max_documents": max_documents,
            "dtype": dtype,
        }
        return writer.finish(meta)
    except BaseException:
        writer.abort()
        raise


def _record_batches(ds):
    """The rows of a mapped dataset as Arrow record batches, in order. Its cache files are read as streams, a batch
    at a time, not memory-mapped: mapped pages would stay resident until the whole table is let go."""
    import pyarrow as pa

    if not ds.cache_files:  # tokenized in memory
        yield from ds.data.to_batches()
        return
    for cache in ds.cache_files:  # the shards' files, in the order of the rows
        with pa.OSFile(cache["filename"]) as f:
            yield from pa.ipc.open_stream(f)


def prepared_folder(
    out: str,
    description: dict,
    tokenizer,
    seed: int,
    max_documents: int | None = None,
    num_proc: int | None = None,
    cache_dir: str | None = None,
    progress: bool = True,
    setting: str = "--out",
) -> tuple[str, bool]:
    """Make sure ``out`` holds this corpus's token folder: (path, whether it was tokenized now).

    An existing folder of the same corpus, tokenizer and order is kept (preparing is idempotent); anything else at
    ``out`` is refused, never overwritten."""
    key = folder_key(description, tokenizer, seed, max_documents)
    if os.path.exists(out):
        if not is_token_folder(out):
            raise ConfigError(f"{setting}={out!r} exists and is not a token folder: choose a new path or remove it")
        found = read_meta(out, setting)
        if found.get("key") != key:
            raise ConfigError(
                f"{setting}={out!r} holds another corpus, tokenizer or order (tokenizer "
                f"{found['tokenizer']['name']!r}, source {found.get('source', {}).get('source')!r}): choose a new path "
                f"or remove it"
            )
        return out, False
    with stage(f"reading the corpus ({description['source']})", after=None if progress else math.inf):
        ds = load_source(description, cache_dir)
    meta = {"key": key, "source": description}
    repeat = description.get("repeat", 1)
    return prepare(ds, tokenizer, out, meta, seed, max_documents, num_proc, progress, repeat), True


# -- aah-prepare -------------------------------------------------------------------------------------------------------
# aah-prepare's flags -> the data settings they set (the same names as the training config's).
_FLAG_SETTINGS = {
    "source": ("source",),
    "tokenizer": ("tokenizer",),
    "seed": ("seed",),
    "max_documents": ("max_documents",),
    "cache_dir": ("cache_dir",),
    "paths": ("files", "paths"),
    "text_field": ("files", "text_field"),
    "hub_name": ("hub", "name"),
    "hub_config": ("hub", "config"),
    "hub_split": ("hub", "split"),
}


def _data_settings(args) -> DataConfig:
    """The data section of the training configs (later ones win), then the command line's settings."""
    data: dict = {}
    for path in args.config:
        config = read_yaml(path, "--config")
        if config is not None and not isinstance(config, dict):
            raise ConfigError(f"--config={path!r} holds a YAML {type(config).__name__}, not a training config")
        section = (config or {}).get("data") or {}
        for key, value in nest_data_settings(section.get("init_args", section)).items():
            data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    for flag, setting in _FLAG_SETTINGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if len(setting) == 1:
            data[setting[0]] = value
        else:
            data[setting[0]] = {**(data.get(setting[0]) or {}), setting[1]: value}
    if args.text_field is not None:  # one text column, whichever source reads it
        data["hub"] = {**(data.get("hub") or {}), "text_field": args.text_field}
    try:
        return DataConfig(**data)
    except TypeError as e:
        raise ConfigError(f"the data section of --config {args.config} does not fit the data settings: {e}") from e


def main(argv: list[str] | None = None) -> None:
    """``aah-prepare``: tokenize a training config's corpus into a token folder, once."""
    parser = argparse.ArgumentParser(
        prog="aah-prepare",
        description="Tokenize the corpus of a training config into a token folder (train with data.source=tokens, "
        "data.tokens.path=<folder>). Without --out it fills the cache folder a run of that config reads.",
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        help="training config(s); their data section says what to prepare (later ones win, flags below win over them)",
    )
    parser.add_argument("--out", help="the token folder to write (must not exist, or hold this very corpus)")
    parser.add_argument("--source", choices=("stdlib", "files", "hub"))
    parser.add_argument("--paths", nargs="+", help="files or glob patterns (source files)")
    parser.add_argument("--text_field")
    parser.add_argument("--tokenizer", help="'byte' or a Hugging Face tokenizer name, tokenizer.json path or folder")
    parser.add_argument("--hub_name")
    parser.add_argument("--hub_config")
    parser.add_argument("--hub_split")
    parser.add_argument("--seed", type=int, help="orders the documents (the split is the tail of that order)")
    parser.add_argument("--max_documents", type=int)
    parser.add_argument("--cache_dir", help="cache folder (default $AAH_CACHE_DIR or ~/.cache/aah)")
    parser.add_argument(
        "--num_proc", type=int, help="tokenizer processes (default: 1 below 64 MB of text, else up to 4)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="the corpus this many times over: a large corpus from a small one, for measurements",
    )
    parser.add_argument("--verify", metavar="FOLDER", help="check every checksum of a token folder, then exit")
    args = parser.parse_args(argv)
    try:
        if args.verify:
            meta = verify(args.verify, "--verify", full=True)
            print(f"{args.verify}: intact ({meta['documents']} documents, {meta['tokens']} tokens)")
            return
        data = _data_settings(args)
        if data.source not in ("stdlib", "files", "hub"):
            raise ConfigError(f"data.source={data.source!r} cannot be prepared: use stdlib, files or hub")
        if args.repeat < 1 or (args.num_proc is not None and args.num_proc < 1):
            raise ConfigError("--repeat and --num_proc must be positive integers")
        tokenizer = load_tokenizer(data.tokenizer, "--tokenizer" if args.tokenizer else "data.tokenizer")
        if args.cache_dir:
            writable_folder(args.cache_dir, "--cache_dir")
        if args.out and not os.path.exists(args.out):
            writable_folder(args.out, "--out")  # the folder is written at the end: its place is checked now
        hub = data.hub
        text_field = hub.text_field if data.source == "hub" else data.files.text_field
        description = describe_source(
            data.source, data.files.paths, text_field, hub.name, hub.config, hub.split, args.repeat
        )
        key = folder_key(description, tokenizer, data.seed, data.max_documents)
        out = args.out or os.path.join(cache_root(data.cache_dir), key)
        start = time.perf_counter()
        path, made = prepared_folder(
            out,
            description,
            tokenizer,
            data.seed,
            data.max_documents,
            args.num_proc,
            data.cache_dir,
            setting="--out",
        )
    except ConfigError as e:
        print(f"aah-prepare: error: {e}", file=sys.stderr)
        sys.exit(2)
    meta = read_meta(path, "--out")
    seconds = time.perf_counter() - start
    mb = meta["text_bytes"] / 1e6
    what = f"tokenized in {seconds:.1f} s ({mb / seconds:.1f} MB/s of text)" if made else "already prepared"
    print(
        f"{path}: {meta['documents']} documents, {meta['tokens']} tokens ({meta['dtype']}), {mb:.1f} MB of text; {what}"
    )
    tok = "" if data.tokenizer == "byte" else f" --data.tokenizer={data.tokenizer}"
    print(f"train from it: aah fit ... --data.source=tokens --data.tokens.path={path}{tok}")
