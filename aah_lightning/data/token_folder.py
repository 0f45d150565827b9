"""Token folders: a corpus tokenized once, kept on disk and read by memory-mapping.

A folder (format version 1) holds::

    tokens.bin   the token stream: every document followed by the end-of-document id; uint16 when the
                 vocabulary fits, else uint32
    starts.bin   int64[documents + 1]: where each document begins in tokens.bin; the last entry is the token count
    bytes.bin    uint16 per token: the UTF-8 bytes of text the token encodes, 0 for end-of-document (Hugging Face
                 tokenizers only, capped at 65535; for the byte tokenizer it is 1 per token, so no file is needed)
    meta.json    what the folder holds (tokenizer, counts, source, seed) and every file's size and checksums

Documents are stored in the seeded order training uses, so a block is a slice of ``tokens.bin`` and the held-out
splits are its tail. A folder is written under a temporary name and renamed when complete: a folder with a valid
``meta.json`` under the final name is always whole.

Checks on opening: every file's size (always), and the CRC-32 of at most ``SAMPLED_CHUNKS`` of its 16 MiB chunks
spread over the file (all of them for files up to that size). ``verify(full=True)`` checks every chunk.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import zlib
from collections.abc import Iterable

import numpy as np

from aah_lightning import progress
from aah_lightning.atomic import publish_folder
from aah_lightning.errors import ConfigError

FORMAT = "aah-token-folder"
VERSION = 1
META = "meta.json"
CHUNK = 16 << 20
SAMPLED_CHUNKS = 8
PARTIAL = ".partial-"
# Mapped pages that were read stay in the process's resident set until they are unmapped (the kernel maps up to
# ~1 MB around each read): a folder-backed stream maps its files afresh after this many block reads, so resident
# memory stays bounded however much of the corpus training has touched.
REMAP_EVERY = 32


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id of a vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class TokenStream:
    """A packed token stream with its document boundaries, in memory or memory-mapped from a token folder.

    ``byte_lengths``: per-token UTF-8 byte counts, or None; ``byte_level``: the byte tokenizer's stream, where every
    token but the end-of-document one is one byte. Neither: the text size is unknown (synthetic data), no bits/byte.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        starts: np.ndarray,
        eos_id: int,
        byte_lengths: np.ndarray | None = None,
        byte_level: bool = False,
        path: str | None = None,
    ):
        self.tokens, self.starts, self.eos_id = tokens, starts, eos_id
        self.byte_lengths, self.byte_level, self.path = byte_lengths, byte_level, path
        self._reads = 0

    @classmethod
    def from_documents(cls, docs: Iterable[np.ndarray], eos_id: int, byte_level: bool = False) -> TokenStream:
        """An in-memory stream of ``docs``, each followed by ``eos_id``."""
        parts, lengths = [], []
        for doc in docs:
            parts += [np.asarray(doc, np.int32), np.array([eos_id], np.int32)]
            lengths.append(len(doc) + 1)
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return cls(tokens, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]), eos_id, byte_level=byte_level)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def has_bytes(self) -> bool:
        return self.byte_level or self.byte_lengths is not None

    def read(self, start: int, stop: int) -> dict:
        """Tokens ``[start, stop)`` (int64), their document ids and, if known, the text bytes of all but the first."""
        out = {"tokens": self.tokens[start:stop].astype(np.int64), "doc_ids": self.doc_ids(start, stop)}
        if self.has_bytes:
            out["bytes"] = self.text_bytes(start + 1, stop)
        self._reads += 1
        if self.path is not None and self._reads % REMAP_EVERY == 0:
            self.__setstate__({"path": self.path})
        return out

    def doc_ids(self, start: int, stop: int) -> np.ndarray:
        """The document index of every position in ``[start, stop)`` (an end-of-document id is its document's)."""
        return np.searchsorted(self.starts, np.arange(start, stop), side="right") - 1

    def text_bytes(self, start: int, stop: int) -> int:
        """UTF-8 bytes of text that tokens ``[start, stop)`` encode; end-of-document tokens encode none."""
        if self.byte_level:
            return int(np.count_nonzero(self.tokens[start:stop] != self.eos_id))
        return int(self.byte_lengths[start:stop].sum(dtype=np.int64))

    # Memory maps travel to DataLoader worker processes as their folder's path, never as their contents.
    def __getstate__(self) -> dict:
        if self.path is None:
            return dict(self.__dict__)
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        if set(state) == {"path"}:
            self.__dict__.update(open_folder(state["path"], check=False)[0].__dict__)
        else:
            self.__dict__.update(state)


# -- writing ---------------------------------------------------------------------------------------------------------
class _ChunkedWriter:
    """Appends arrays to one file and keeps the CRC-32 of every ``CHUNK`` bytes."""

    def __init__(self, path: str, dtype: np.dtype):
        self.f, self.dtype = open(path, "wb"), np.dtype(dtype)
        self.size, self.crcs, self.crc = 0, [], 0

    def write(self, array: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(array, dtype=self.dtype)).cast("B")
        self.f.write(data)
        while len(data):
            room = CHUNK - self.size % CHUNK
            self.crc = zlib.crc32(data[:room], self.crc)
            self.size += min(room, len(data))
            data = data[room:]
            if self.size % CHUNK == 0:
                self.crcs.append(self.crc)
                self.crc = 0

    def close(self) -> dict:
        if self.size % CHUNK:
            self.crcs.append(self.crc)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"dtype": self.dtype.name, "size": self.size, "chunk": CHUNK, "crc32": self.crcs}


class FolderWriter:
    """Writes a token folder into a temporary sibling of ``out`` and renames it into place in ``finish``.

    ``add`` takes a batch of documents as their concatenated tokens (without end-of-document ids, which are added
    here), their token counts and, for Hugging Face tokenizers, the per-token byte counts.
    """

    def __init__(self, out: str, vocab_size: int, eos_id: int, with_bytes: bool):
        self.out = os.path.abspath(out)
        parent = os.path.dirname(self.out)
        os.makedirs(parent, exist_ok=True)
        remove_stale_partials(self.out)
        self.tmp = f"{self.out}{PARTIAL}{socket.gethostname()}-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.eos_id, self.vocab_size = eos_id, vocab_size
        self.tokens = _ChunkedWriter(os.path.join(self.tmp, "tokens.bin"), token_dtype(vocab_size))
        self.starts = _ChunkedWriter(os.path.join(self.tmp, "starts.bin"), np.int64)
        self.bytes = _ChunkedWriter(os.path.join(self.tmp, "bytes.bin"), np.uint16) if with_bytes else None
        self.starts.write(np.zeros(1, np.int64))
        self.n_tokens = self.n_docs = self.n_text_bytes = 0

    def add(self, values: np.ndarray, lengths: np.ndarray, byte_lengths: np.ndarray | None = None) -> None:
        if len(lengths) == 0:
            return
        eod = np.cumsum(lengths, dtype=np.int64) + np.arange(len(lengths))  # where the end-of-document ids go
        text = np.ones(len(values) + len(lengths), bool)
        text[eod] = False
        tokens = np.full(len(text), self.eos_id, self.tokens.dtype)
        tokens[text] = values
        self.tokens.write(tokens)
        self.starts.write(self.n_tokens + eod + 1)
        if self.bytes is not None:
            counts = np.zeros(len(text), np.uint16)
            counts[text] = np.minimum(byte_lengths, 65535)
            self.bytes.write(counts)
            self.n_text_bytes += int(byte_lengths.sum(dtype=np.int64))
        else:
            self.n_text_bytes += len(values)  # the byte tokenizer: one token per byte
        self.n_tokens += len(values) + len(lengths)
        self.n_docs += len(lengths)

    def finish(self, meta: dict) -> str:
        files = {"tokens.bin": self.tokens.close(), "starts.bin": self.starts.close()}
        if self.bytes is not None:
            files["bytes.bin"] = self.bytes.close()
        meta = {
            "format": FORMAT,
            "version": VERSION,
            **meta,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokens": self.n_tokens,
            "documents": self.n_docs,
            "text_bytes": self.n_text_bytes,
            "files": files,
        }
        with open(os.path.join(self.tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        try:
            publish_folder(self.tmp, self.out)
        except OSError:  # another process finished the same folder first: keep theirs if it is whole
            shutil.rmtree(self.tmp, ignore_errors=True)
            read_meta(self.out, "folder")
        return self.out

    def abort(self) -> None:
        for w in (self.tokens, self.starts, self.bytes):
            if w is not None and not w.f.closed:
                w.f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def remove_stale_partials(out: str) -> None:
    """Delete temporary folders of ``out`` left by killed writers on this host (their process is gone)."""
    parent, name = os.path.split(os.path.abspath(out))
    prefix = f"{name}{PARTIAL}{socket.gethostname()}-"
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        if entry.startswith(prefix) and entry[len(prefix) :].isdigit() and not _alive(int(entry[len(prefix) :])):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        pass
    return True


# -- reading ---------------------------------------------------------------------------------------------------------
def is_token_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


def read_meta(path: str, setting: str) -> dict:
    """The folder's metadata; a ConfigError naming ``setting`` if ``path`` is not a complete token folder."""
    meta_path = os.path.join(path, META)
    if not os.path.isdir(path):
        raise ConfigError(f"{setting}={path!r} does not exist: prepare a token folder with aah-prepare")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"{setting}={path!r} is not a token folder (it has no {META}): prepare one with aah-prepare"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{setting}={path!r}: {META} cannot be read ({type(e).__name__}): prepare the folder again"
        ) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(
            f"{setting}={path!r} is not a token folder ({META} is not aah's): prepare one with aah-prepare"
        )
    if meta.get("version") != VERSION:
        raise ConfigError(
            f"{setting}={path!r} has token folder format {meta.get('version')}, this aah reads {VERSION}: prepare it "
            f"again"
        )
    return meta


def _check_file(path: str, name: str, info: dict, setting: str, full: bool) -> None:
    file = os.path.join(path, name)
    size = os.path.getsize(file) if os.path.isfile(file) else None
    if size != info["size"]:
        found = "missing" if size is None else f"{size} bytes"
        raise ConfigError(
            f"{setting}={path!r}: {name} is {found}, {META} says {info['size']} bytes (truncated or replaced): "
            f"prepare the folder again"
        )
    crcs = info["crc32"]
    picks = (
        range(len(crcs))
        if full or len(crcs) <= SAMPLED_CHUNKS
        else sorted({round(i * (len(crcs) - 1) / (SAMPLED_CHUNKS - 1)) for i in range(SAMPLED_CHUNKS)})
    )
    piece = bytearray(1 << 20)  # read through one small buffer: checking never holds a chunk in memory
    shown = progress.current()
    with open(file, "rb") as f:
        for i in picks:
            f.seek(i * info["chunk"])
            crc, left = 0, min(info["chunk"], size - i * info["chunk"])
            while left:
                n = f.readinto(memoryview(piece)[: min(left, len(piece))])
                crc, left = zlib.crc32(memoryview(piece)[:n], crc), left - n
                shown.advance(n)
            if crc != crcs[i]:
                lo, hi = i * info["chunk"], min(size, (i + 1) * info["chunk"])
                raise ConfigError(
                    f"{setting}={path!r}: {name} is corrupt (bytes {lo}-{hi} fail their checksum): prepare the folder "
                    f"again"
                )


def verify(path: str, setting: str = "data.tokens.path", full: bool = False) -> dict:
    """Sizes of every file, and sampled (or, ``full``, all) chunk checksums. Returns the metadata."""
    meta = read_meta(path, setting)
    total = sum(info["size"] for info in meta["files"].values()) if full else None  # sampled: the time it takes
    with progress.stage(f"checking {path}", total=total, unit="B"):
        for name, info in meta["files"].items():
            _check_file(path, name, info, setting, full)
    return meta


def open_folder(path: str, setting: str = "data.tokens.path", check: bool = True) -> tuple[TokenStream, dict]:
    """The folder's token stream, memory-mapped (nothing is read into memory), and its metadata."""
    path = os.path.abspath(path)
    meta = verify(path, setting) if check else read_meta(path, setting)
    files = meta["files"]

    def mapped(name: str):
        info = files[name]
        if info["size"] == 0:
            return np.zeros(0, info["dtype"])
        return np.memmap(os.path.join(path, name), dtype=info["dtype"], mode="r")

    tokens, starts = mapped("tokens.bin"), mapped("starts.bin")
    byte_lengths = mapped("bytes.bin") if "bytes.bin" in files else None
    stream = TokenStream(
        tokens, starts, meta["eos_id"], byte_lengths, byte_level=meta["tokenizer"]["name"] == "byte", path=path
    )
    return stream, meta
