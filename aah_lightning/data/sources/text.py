"""Text sources tokenized once into a token folder under the cache folder: ``stdlib`` (the embedded default corpus,
the Python standard library's own sources: no network) and ``files`` (local .txt, .jsonl/.json, .parquet)."""

from __future__ import annotations

import os
import shutil

from lightning.pytorch.utilities import rank_zero_warn

from aah_lightning.data import corpora, prepare
from aah_lightning.data.sources.base import TokenStreamSource, register_source
from aah_lightning.data.token_folder import open_folder
from aah_lightning.errors import ConfigError


class CachedTextSource(TokenStreamSource):
    mixable = True

    def __init__(self, settings):
        super().__init__(settings)
        self._description: dict | None = None

    def description(self) -> dict:
        if self._description is None:  # once: it reads every file's size and time
            hp = self.settings
            self._description = prepare.describe_source(hp.source, hp.files.paths, hp.files.text_field)
        return self._description

    def folder(self, tokenizer) -> str:
        hp = self.settings
        key = prepare.folder_key(self.description(), tokenizer, hp.seed, hp.max_documents)
        return os.path.join(prepare.cache_root(hp.cache_dir), key)

    def prepare(self, tokenizer) -> None:
        """Tokenize the text into the cache once (a damaged cache entry is rebuilt, not trusted)."""
        hp, folder = self.settings, self.folder(tokenizer)
        if os.path.isdir(folder):
            try:
                open_folder(folder, "the cached token folder")
                return
            except ConfigError as e:
                rank_zero_warn(f"{e}; tokenizing again")
                shutil.rmtree(folder, ignore_errors=True)
        prepare.prepared_folder(
            folder,
            self.description(),
            tokenizer,
            hp.seed,
            hp.max_documents,
            hp.num_proc,
            hp.cache_dir,
            setting="the cached token folder",
        )

    def stream(self, tokenizer):
        folder = self.folder(tokenizer)
        if not os.path.isdir(folder):  # not prepared by the Trainer (the data module used on its own)
            self.prepare(tokenizer)
        return open_folder(folder, "the cached token folder")[0]


@register_source
class StdlibSource(CachedTextSource):
    name = "stdlib"


@register_source
class FilesSource(CachedTextSource):
    name = "files"

    def check(self) -> None:
        corpora.expand_paths(self.settings.files.paths or [])  # fail now, not after the model is built
