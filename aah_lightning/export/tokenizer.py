"""The tokenizer of an export: files that ``transformers.AutoTokenizer.from_pretrained(folder)`` loads without remote
code, encoding text exactly as aah does.

* **byte** (aah's default): a ``tokenizers`` BPE model with no merges over a 256-entry vocabulary whose ids are the
  byte values (byte-level pre-tokenizer and decoder, so every byte sequence maps to its own bytes), plus the
  end-of-document token ``<|endoftext|>`` = 256 as a special token. Text that happens to spell ``<|endoftext|>`` is
  encoded as its bytes, as aah does (``split_special_tokens``).
* **Hugging Face tokenizers** (``data.tokenizer`` a name, tokenizer.json or folder): their own tokenizer.json, with the
  end-of-document token aah chose for it, added as ``<|endoftext|>`` when aah appended one past the vocabulary.

Either way encoding with special tokens (the transformers default) puts the end-of-document token first: aah trains
on documents that each follow one, and its own generation starts every prompt with it. ``add_special_tokens=False``
gives the plain tokens of the text.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from aah_lightning.data.tokenizers import ByteTokenizer, load_tokenizer
from aah_lightning.errors import ConfigError

EOD_TOKEN = "<|endoftext|>"


def _byte_alphabet() -> dict[int, str]:
    """The byte-level pre-tokenizer's printable character for each byte (the GPT-2 byte-to-unicode table): printable
    Latin-1 bytes stand for themselves, the others are shifted past U+00FF in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def byte_level_tokenizer():
    """A ``tokenizers.Tokenizer`` whose ids are byte values 0..255, with ``<|endoftext|>`` = 256 prepended."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    if tok.token_to_id(EOD_TOKEN) != ByteTokenizer.eos_id:  # pragma: no cover - tokenizers assigns the next id
        raise RuntimeError("the byte tokenizer's end-of-document token did not get id 256")
    _prepend_eod(tok, EOD_TOKEN, ByteTokenizer.eos_id)
    return tok


def _prepend_eod(tok, eod: str, eod_id: int) -> None:
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(
        single=f"{eod} $A", pair=f"{eod} $A {eod} $B", special_tokens=[(eod, eod_id)]
    )


@dataclass
class TokenizerExport:
    """A tokenizer ready to be written: its ``tokenizers.Tokenizer``, end-of-document token and settings."""

    spec: str
    tok: object  # tokenizers.Tokenizer
    eod: str
    eod_id: int
    split_special_tokens: bool

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def save(self, folder: str, model_max_length: int) -> None:
        """tokenizer.json and tokenizer_config.json (special tokens: the end-of-document token for all three)."""
        os.makedirs(folder, exist_ok=True)
        self.tok.save(os.path.join(folder, "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.eod,
            "eos_token": self.eod,
            "pad_token": self.eod,
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": self.split_special_tokens,
            "model_max_length": model_max_length,
            # A decoder-only model continues the end of each row: a batch is padded on the left (transformers'
            # generate warns and continues from padding otherwise).
            "padding_side": "left",
            "model_input_names": ["input_ids", "attention_mask"],  # no token_type_ids: the model has no segments
        }
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")


def prepare_tokenizer(spec: str, model_vocab: int, setting: str = "--tokenizer") -> TokenizerExport:
    """The export of aah tokenizer ``spec`` (``byte``, or what ``data.tokenizer`` names) for a model with
    ``model_vocab`` ids. Raises ``ConfigError``, naming ``setting`` (where ``spec`` came from), if it cannot be
    loaded or has more ids than the model."""
    theirs = load_tokenizer(spec, setting)  # ConfigError: a missing file, a hub name without network
    if theirs.vocab_size > model_vocab:
        raise ConfigError(
            f"{setting}={spec!r} has {theirs.vocab_size} ids, the checkpoint's model {model_vocab}: use the "
            f"tokenizer the model was trained with"
        )
    if isinstance(theirs, ByteTokenizer):
        return TokenizerExport(spec, byte_level_tokenizer(), EOD_TOKEN, theirs.eos_id, split_special_tokens=True)
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(theirs.tok.to_str())  # a copy: the post-processor changes below
    eod = tok.id_to_token(theirs.eos_id)
    if eod is None:  # aah appended an end-of-document id past the vocabulary
        tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
        eod = EOD_TOKEN
        if tok.token_to_id(EOD_TOKEN) != theirs.eos_id:
            raise ConfigError(
                f"--tokenizer {spec!r}: could not add the end-of-document token at id {theirs.eos_id} "
                f"(it landed at {tok.token_to_id(EOD_TOKEN)})"
            )
    _prepend_eod(tok, eod, theirs.eos_id)
    return TokenizerExport(spec, tok, eod, theirs.eos_id, split_special_tokens=False)
