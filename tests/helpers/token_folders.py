"""Small token folders of a known text, written by the real prepare step."""

from __future__ import annotations

import json

from aah_lightning.data import corpora, prepare
from aah_lightning.data.tokenizers import ByteTokenizer

TEXTS = [f"def f{i}(x):\n    return x + {i}  # héllo wörld €\n" * (1 + i % 7) for i in range(40)] + ["", "z"]


def texts_file(tmp_path, texts) -> str:
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    return str(path)


def small_folder(tmp_path, name="tf", texts=TEXTS) -> str:
    ds = corpora.file_corpus([texts_file(tmp_path, texts)], cache_dir=str(tmp_path / "hf"))
    return prepare.prepare(ds, ByteTokenizer(), str(tmp_path / name), {"key": "k"}, seed=0, progress=False)
