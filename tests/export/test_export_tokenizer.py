"""The exported tokenizer loads with AutoTokenizer (no remote code) and encodes exactly as aah does."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer

from aah_lightning.data.tokenizers import ByteTokenizer, HFTokenizer
from aah_lightning.errors import ConfigError
from aah_lightning.export.tokenizer import prepare_tokenizer


def random_text(rng: random.Random, n: int) -> str:
    """Printable ASCII, whitespace, Latin, CJK, emoji and other astral code points (no surrogates)."""
    pools = [(32, 127), (9, 14), (0xA0, 0x800), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0x10000, 0x10FFFF)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        out.append(chr(rng.randrange(lo, hi)))
    return "".join(out)


@pytest.fixture(scope="module")
def byte_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte_tok")
    prepare_tokenizer("byte", 257).save(str(folder), 256)
    return str(folder)


def test_byte_tokenizer_round_trips_text_and_bytes(byte_folder):
    tok = AutoTokenizer.from_pretrained(byte_folder)
    assert type(tok).__module__.startswith("transformers.")  # a stock class, no code from the folder
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, len(tok)) == (256, 256, 256, 257)
    ours = ByteTokenizer()
    rng = random.Random(0)
    texts = [random_text(rng, rng.randrange(0, 60)) for _ in range(300)]
    texts += ["", " ", "  leading spaces", "tab\there\r\nwindows\n", "\x00\x01nul", "<|endoftext|> literal", "é" * 9]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == [256] + ours.encode(text).tolist(), repr(text)
        assert tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
        assert tok.decode(ids, skip_special_tokens=True) == text == ours.decode(ids)
    for _ in range(300):  # any byte sequence decodes as aah decodes it (invalid UTF-8 replaced the same way)
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 30)))
        assert tok.decode(list(raw)) == ours.decode(list(raw)) == raw.decode("utf-8", errors="replace")
    assert tok.decode([256, 104, 105, 256]) == "<|endoftext|>hi<|endoftext|>"


def write_word_tokenizer(path, with_eos: bool) -> str:
    words = ["def", "return", "class", "(", ")", ":", "x", "y", "[UNK]"] + (["</s>"] if with_eos else [])
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("with_eos", [True, False])
def test_hugging_face_tokenizer_keeps_aahs_ids(tmp_path, with_eos):
    spec = write_word_tokenizer(tmp_path / "tokenizer.json", with_eos)
    theirs = HFTokenizer(spec)
    export = prepare_tokenizer(spec, theirs.vocab_size)
    export.save(str(tmp_path / "out"), 128)
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok.eos_token_id == theirs.eos_id == 9  # "</s>", or the id aah appends past the 9 words
    assert tok.eos_token == ("</s>" if with_eos else "<|endoftext|>")
    assert len(tok) == theirs.vocab_size
    text = "def x ( y ) : return x"
    assert tok(text)["input_ids"] == [theirs.eos_id] + theirs.encode(text).tolist()
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == theirs.decode(theirs.encode(text))
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["split_special_tokens"] is False and config["model_max_length"] == 128


def test_tokenizer_with_more_ids_than_the_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="has 257 ids, the checkpoint's model 100"):
        prepare_tokenizer("byte", 100)
