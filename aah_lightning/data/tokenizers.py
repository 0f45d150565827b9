"""Tokenizers: a byte-level default that needs nothing, or a Hugging Face ``tokenizers`` model by name or path."""

from __future__ import annotations

import hashlib
import os
import socket
import urllib.parse

import numpy as np

from aah_lightning.errors import ConfigError
from aah_lightning.extras import need


class ByteTokenizer:
    """UTF-8 bytes are the tokens (0..255); 256 is the end-of-document token."""

    name = "byte"
    fingerprint = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and the UTF-8 bytes of text each one encodes (one each)."""
        ids = self.encode(text)
        return ids, np.ones(len(ids), np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|im_end|>")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a tokenizer.json file, a folder holding one, or a hub name."""

    def __init__(self, spec: str, setting: str = "data.tokenizer"):
        Tokenizer = need("tokenizers", f"{setting}={spec!r}").Tokenizer
        self.name = spec
        path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
        if os.path.isdir(spec) and not os.path.isfile(path):
            raise ConfigError(f"{setting}={spec!r} is a folder without a tokenizer.json: pass a tokenizer.json file")
        if os.path.isfile(path):
            if not os.access(path, os.R_OK):
                raise ConfigError(f"{setting}={spec!r} cannot be read (permission denied): check its permissions")
            try:
                self.tok = Tokenizer.from_file(path)
            except Exception as e:  # not JSON, not UTF-8, not a tokenizer
                reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
                raise ConfigError(
                    f"{setting}={spec!r} is not a Hugging Face tokenizer.json ({reason}): pass a tokenizer.json "
                    f"(UTF-8 JSON) saved by the tokenizers library, or 'byte'"
                ) from None
        elif _looks_like_path(spec):
            raise ConfigError(f"{setting}={spec!r}: no such file or folder (expected a tokenizer.json)")
        else:
            self.tok = Tokenizer.from_file(_hub_tokenizer_file(spec, setting))
        vocab = self.tok.get_vocab()
        eos = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
        self.vocab_size = self.tok.get_vocab_size()
        if eos is None:  # no end-of-document token: use one id past the tokenizer's vocabulary
            eos = self.vocab_size
            self.vocab_size += 1
        self.eos_id = eos
        self.fingerprint = hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        return self.encode_batch_with_bytes([text])[0]

    def encode_batch_with_bytes(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Token ids and the UTF-8 bytes of text each token encodes (see ``token_byte_lengths``)."""
        out = []
        for text, enc in zip(texts, self.tok.encode_batch(texts, add_special_tokens=False)):
            out.append((np.asarray(enc.ids, dtype=np.int32), token_byte_lengths(text, enc.offsets)))
        return out

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def _looks_like_path(spec: str) -> bool:
    """A file or folder name, not a hub repository id (``name`` or ``owner/name``)."""
    return spec.startswith((".", os.path.sep, "~")) or spec.endswith(".json") or spec.count("/") > 1 or "\\" in spec


def _hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub (or to the HTTPS proxy that reaches it) opens within ``timeout``."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urllib.parse.urlparse(proxy if proxy else endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout).close()
        return True
    except OSError:
        return False


def _hub_tokenizer_file(spec: str, setting: str) -> str:
    """The tokenizer.json of hub repository ``spec``: from the local Hugging Face cache, else downloaded. Offline
    (``HF_HUB_OFFLINE``) or with the hub out of reach, one line at once instead of minutes of retries."""
    from huggingface_hub import constants, hf_hub_download

    try:
        return hf_hub_download(spec, "tokenizer.json", local_files_only=True)
    except Exception:  # not in the cache (or not a repository name): ask the hub
        pass
    fix = "pass a local tokenizer.json file or folder, or 'byte'"
    if "/" in spec:  # also a relative path that does not exist
        fix = f"no file or folder {spec!r} exists either; {fix}"
    # The environment as it is now, too: huggingface_hub reads it once, when it is first imported.
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise ConfigError(f"{setting}={spec!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: {fix}")
    if not _hub_reachable(constants.ENDPOINT):
        raise ConfigError(
            f"{setting}={spec!r} is not in the local Hugging Face cache and the hub ({constants.ENDPOINT}) cannot be "
            f"reached from this machine: {fix}"
        )
    try:
        return hf_hub_download(spec, "tokenizer.json")
    except Exception as e:
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{setting}={spec!r} could not be loaded from the Hugging Face hub ({type(e).__name__}: {reason}): {fix}"
        ) from None


def token_byte_lengths(text: str, offsets: list[tuple[int, int]]) -> np.ndarray:
    """UTF-8 bytes of ``text`` per token, from the tokens' character offsets: a token owns the text from its start to
    the next token's start (the first from the beginning, the last to the end), so the counts of a document add up to
    its size in bytes exactly, whatever the tokenizer drops or merges. Tokens that share a start (pieces of one
    character) count 0 but the last."""
    if not offsets:
        return np.zeros(0, np.int64)
    starts = np.maximum.accumulate(np.array([o[0] for o in offsets], np.int64))
    starts[0] = 0
    if text.isascii():
        char_end = np.arange(len(text) + 1, dtype=np.int64)
    else:  # bytes before each character: 1 to 4 per code point
        cp = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
        width = 1 + (cp >= 0x80) + (cp >= 0x800) + (cp >= 0x10000)
        char_end = np.concatenate([[0], np.cumsum(width, dtype=np.int64)])
    begin = char_end[np.minimum(starts, len(text))]
    return np.diff(np.append(begin, char_end[-1]))


def load_tokenizer(spec: str, setting: str = "data.tokenizer"):
    """The byte tokenizer for 'byte', else a Hugging Face one; a problem is one ``ConfigError`` naming ``setting``."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec, setting)
