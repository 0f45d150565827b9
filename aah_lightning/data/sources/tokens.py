"""``tokens``: a token folder prepared by ``aah-prepare``, memory-mapped."""

from __future__ import annotations

from aah_lightning.data.sources.base import TokenStreamSource, register_source
from aah_lightning.data.token_folder import open_folder, read_meta
from aah_lightning.errors import ConfigError, require


@register_source
class TokenFolderSource(TokenStreamSource):
    name = "tokens"
    mixable = True

    def check(self) -> None:
        path = self.settings.tokens.path
        require(
            bool(path), "data.tokens.path", path, "a token folder (written by aah-prepare) when data.source='tokens'"
        )

    def check_tokenizer(self, tokenizer, meta: dict | None = None) -> None:
        """A folder of another tokenizer or vocabulary would train the model on ids that mean something else."""
        hp, path = self.settings, self.settings.tokens.path
        meta = meta or read_meta(path, "data.tokens.path")
        theirs = (meta["tokenizer"]["name"], meta["tokenizer"]["fingerprint"], meta["vocab_size"], meta["eos_id"])
        if theirs != (tokenizer.name, tokenizer.fingerprint, tokenizer.vocab_size, tokenizer.eos_id):
            other = (
                " (another tokenizer file)"
                if theirs[1] != tokenizer.fingerprint and theirs[0] == tokenizer.name
                else ""
            )
            raise ConfigError(
                f"data.tokens.path={path!r} holds tokens of tokenizer {theirs[0]!r} (vocabulary {theirs[2]}, "
                f"end-of-document {theirs[3]}), but data.tokenizer={hp.tokenizer!r}{other} has vocabulary "
                f"{tokenizer.vocab_size}, end-of-document {tokenizer.eos_id}: set data.tokenizer to the folder's "
                f"tokenizer, or prepare the folder with this one"
            )

    def describe(self) -> str:
        return f"data.tokens.path={self.settings.tokens.path!r}"

    def stream(self, tokenizer):
        stream, meta = open_folder(self.settings.tokens.path, "data.tokens.path")
        self.check_tokenizer(tokenizer, meta)
        return stream
