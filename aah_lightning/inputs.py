"""The files, folders and devices a command names, checked before any work: one ``ConfigError`` line each.

Every command (``aah``, ``aah-prepare``, the tools) checks the paths and devices it is given with these, so a missing
file, a folder where a file is expected, a file that cannot be read or is not UTF-8 text, a folder that cannot be
written, or a device this machine does not have ends the same way everywhere: one line that names the setting, the
value and what is allowed (``errors.ConfigError``; docs/robustness.md lists the checks).

Layer: imports only ``errors`` (and torch), so ``model/``, ``data/`` and everything above may use it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import torch

from aah_lightning.errors import ConfigError


def first_line(e: BaseException, limit: int = 160) -> str:
    """The first line of an exception's message (its type's name if it has none), cut to ``limit`` characters."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:limit]


# -- files -------------------------------------------------------------------------------------------------------------
def named(setting: str, path) -> str:
    """``setting='path'``, or ``setting 'path'`` for one entry of a list setting (``data.files.paths entry``)."""
    return f"{setting} {os.fspath(path)!r}" if setting.endswith(" entry") else f"{setting}={os.fspath(path)!r}"


def input_file(path, setting: str, what: str = "a file") -> str:
    """``path`` as a string, if it names a readable file; otherwise one line: missing, a folder, or unreadable."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"{named(setting, path)} does not exist: pass {what}")
    if os.path.isdir(path):
        raise ConfigError(f"{named(setting, path)} is a folder: pass {what}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{named(setting, path)} cannot be read (permission denied): check its permissions")
    return path


def _unreadable(path: str, setting: str, e: OSError) -> ConfigError:
    return ConfigError(f"{named(setting, path)} cannot be read ({e.strerror or type(e).__name__}): check the file")


def utf8_lines(path, setting: str, what: str = "a text file") -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of every line of a UTF-8 text file (a leading byte-order mark is dropped, the line
    ending kept). A file that is missing, a folder, unreadable or not UTF-8 is one line naming the line number."""
    path = input_file(path, setting, what)
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                try:
                    yield n, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ConfigError(not_utf8(path, setting, n, raw, e)) from None
    except OSError as e:
        raise _unreadable(path, setting, e) from e


def not_utf8(path: str, setting: str, line: int, raw: bytes, e: UnicodeDecodeError) -> str:
    """The one line for a file that is not UTF-8: where, which byte, and what to do."""
    column = len(raw[: e.start].decode("utf-8", errors="replace")) + 1
    return (
        f"{named(setting, path)} line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column}; "
        f"Latin-1 or another encoding?): the file must be encoded as UTF-8"
    )


def first_non_utf8(path: str, setting: str) -> str | None:
    """The ``not_utf8`` line of the first line of ``path`` that is not UTF-8, or None if the file is UTF-8 (or cannot
    be read: the caller's own error stands then). Read a line at a time, only to explain a failure."""
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return not_utf8(path, setting, n, raw, e)
    except OSError:
        return None
    return None


def utf8_text(path, setting: str, what: str = "a text file") -> str:
    """The whole of a UTF-8 text file, checked as ``utf8_lines`` does."""
    return "".join(line for _, line in utf8_lines(path, setting, what))


def read_yaml(path, setting: str = "--config"):
    """What the YAML file ``path`` holds; a missing, unreadable or non-UTF-8 file, or YAML that does not parse, is one
    line (the line number where it goes wrong)."""
    import yaml

    text = utf8_text(path, setting, "a YAML config file")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).strip().splitlines()[0]
        raise ConfigError(f"{setting}={os.fspath(path)!r}{where} is not valid YAML ({problem})") from None


# -- folders -----------------------------------------------------------------------------------------------------------
def writable_folder(path, setting: str) -> str:
    """``path`` can be used as an output folder: it is a folder that takes new files, or it does not exist yet and the
    nearest folder above it that exists does. Nothing is created (a temporary file is made and removed)."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{setting}={path!r} is a file, not a folder: name a folder (new or existing)")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(
            f"{setting}={path!r} cannot be created or written ({e.strerror or e}): choose a folder you can write to"
        ) from e
    return path


# -- devices -----------------------------------------------------------------------------------------------------------
def cuda_count() -> int:
    """CUDA devices this process can use (0 on a torch built without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def available_devices() -> str:
    """What a device setting may be on this machine, in words: 'cpu', 'cuda', 'cuda:0' to 'cuda:N-1', 'mps'."""
    n = cuda_count()
    allowed = ["cpu"]
    if n:
        allowed += ["cuda", "cuda:0" if n == 1 else f"cuda:0 to cuda:{n - 1}"]
    if mps_available():
        allowed.append("mps")
    text = ", ".join(allowed[:-1]) + " or " + allowed[-1] if len(allowed) > 1 else allowed[0]
    if not n and not mps_available():
        return text + " (cuda and cuda:N need a CUDA GPU, mps an Apple GPU; this machine has neither)"
    if not n:
        return text + " (cuda and cuda:N need a CUDA GPU; this machine has none)"
    return text


def torch_device(spec, setting: str = "--device") -> torch.device:
    """The ``torch.device`` of ``spec`` ('cpu', 'cuda', 'cuda:N', 'mps'), if this machine has it; otherwise one line
    naming ``setting``, why, and the devices that are available here."""
    text = str(spec).strip()
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{setting}={spec!r} is not a device: use {available_devices()}") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        n = cuda_count()
        if n == 0:
            raise ConfigError(
                f"{setting}={spec!r} is not allowed: no CUDA device is available on this machine"
                f"{'' if torch.backends.cuda.is_built() else ' (this torch is built without CUDA)'}: use "
                f"{available_devices()}"
            )
        if device.index is not None and device.index >= n:
            raise ConfigError(
                f"{setting}={spec!r} is not allowed: this machine has {n} CUDA device{'s' if n > 1 else ''}: use "
                f"{available_devices()}"
            )
        return device
    if device.type == "mps":
        if not mps_available():
            raise ConfigError(
                f"{setting}={spec!r} is not allowed: no Apple GPU (MPS) is available on this machine: use "
                f"{available_devices()}"
            )
        return device
    raise ConfigError(f"{setting}={spec!r} is not a device aah runs on: use {available_devices()}")
